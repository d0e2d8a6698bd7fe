"""`./dev.sh gpu-check`: what NCCL does over meshrun on this machine, and how fast, in one command.

Builds NAT'd datacenters in network namespaces (meshrun.lab.testbed) on this one machine: a coordinator
and two sites of two nodes, joined with `meshrun join --site`; runs examples/nccl_check.py under
`meshrun train` with ``NCCL_DEBUG=INFO`` (one rank per node, node i on GPU i % the GPU count), and
prints, for the world group, the site group and the cross-site groups, the transports and interfaces
NCCL reported. Each node's ranks set ``NCCL_HOSTID`` to the node's name: the namespaces share one
host name and boot id, which is what NCCL tells hosts apart by, so without it NCCL would refuse two
ranks on one GPU and use shared memory or NVLink between "nodes" instead of the overlay. Without a GPU
the same check runs on gloo and says that NCCL was not exercised. Needs root.

Then it measures (``--no-bench`` skips it) one table with examples/nccl_bench.py: all-reduce bus bandwidth
(``--mib``, 256 MiB) between two nodes of one site through the raw site LAN (``NCCL_SOCKET_IFNAME=eth0`` in the
namespaces: no meshrun on the data path), through meshrun0 (same site), between nodes of two sites through
meshrun0, and (unless ``--no-lan-path``) between the nodes of site s2, trusted with `meshrun site trust`, on the
site LAN path (meshrun.core.lanpath); on NCCL, meshrun0's rows for each socket setting of ``--settings``
(``default``: neither ``NCCL_SOCKET_NTHREADS`` nor ``NCCL_NSOCKS_PERTHREAD`` set, NCCL's own choice; ``TxS``: T
threads x S sockets per thread; `meshrun train` leaves them to NCCL, meshrun.core.launch). Each setting is one
`meshrun train` job (NCCL reads them once per process) with ``--rounds-per-job`` rounds of the pairs alternating;
jobs run in passes, forward then backward, while ``--budget-s`` lasts. On gloo the socket settings mean nothing:
one pass of the LAN and meshrun0 jobs, which exercises the same path. ``--out FILE`` gets the table as JSON after
every job (on NCCL by default benchmarks/results/gpu_datapath.json), with the environment and the lines NCCL logged
about the interfaces, sockets and graphs (``NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH``).

    sudo .venv/bin/python -m meshrun.lab.gpucheck [--no-bench] [--budget-s 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.core.launch import DEFAULT_WORKERS, WORKER_KINDS
from meshrun.errors import HostError, MeshrunError
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec, World
from meshrun.system.files.statedir import atomic_write
from meshrun.system.machine.cmd import run as run_command
from meshrun.system.machine.wgbinary import wireguard_binary

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "benchmarks" / "results" / "gpu_datapath.json"
MARK = re.compile(r"^\[(\S+) r(\d+)\] == (.+) ==$")
# What NCCL says about its transport (NCCL_DEBUG=INFO, INIT and NET subsystems).
NCCL_LINE = re.compile(r"NCCL INFO (NET/\S+ : Using .*|Channel \d+/\d+ : .* via \S+|Using network \S+|NET/IB.*)")
SITES, NODES_PER_SITE = 2, 2
LAN_IFNAME = "eth0"  # each node's interface on its site network (meshrun.lab.testbed)
SETTINGS = ("default", "1x1", "2x8", "4x4", "8x2")  # NCCL socket threads x sockets per thread
SETTING = re.compile(r"(default|\d+x\d+)(\+NCCL_[A-Z0-9_]+=[\w.-]+)*")  # a setting, NCCL variables of its own added
BENCH_NODES = ("s1-a", "s1-b", "s2-a")  # a site's pair, and a node of another site
LAN_PATH_SITE, LAN_PATH_NODES = "s2", ("s2-a", "s2-b")  # trusted (`meshrun site trust`): the site LAN path's pair
# What NCCL logs about the network, its sockets and the graphs it built (NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH).
NCCL_NET_LINE = re.compile(
    r"NCCL INFO (.*(?:NET/|Using network|threads|sockets|speed|[Bb]w |maxBw|Pattern|nChannels|Ring 00|Tree 0 |"
    r"Trees|Channel 00/|comm 0x|NCCL_SOCKET|NCCL_NSOCKS|NCCL version).*)"
)


@dataclass(frozen=True)
class CheckPlan:
    """How the check runs here: the backend, each node's GPU, and what it tells the user first ("" nothing)."""

    backend: str  # "nccl" or "gloo"
    gpu_of: dict[str, int]  # node name -> its GPU (empty on gloo)
    message: str = ""
    workers: str = DEFAULT_WORKERS  # `meshrun train --workers`

    def train_args(self, script: str = "nccl_check.py", subsys: str = "INIT,NET") -> list[str]:
        """`meshrun train`'s options and script for this plan (run from examples/); the script's own args follow."""
        args = ["--nproc-per-node", "1", "--workers", self.workers]
        args += ["--env", "NCCL_DEBUG=INFO", "--env", f"NCCL_DEBUG_SUBSYS={subsys}"]
        if self.backend == "gloo":
            return args + ["--env", "CUDA_VISIBLE_DEVICES=", script]
        gpus = ",".join(f"{node}={gpu}" for node, gpu in self.gpu_of.items())
        return args + [script, "--gpu-map", gpus, "--hostid-per-node"]


@dataclass(frozen=True)
class BenchJob:
    """One `meshrun train` job of the bandwidth table: a path ("lan" or "meshrun0") and a socket setting."""

    path: str
    sockets: str  # "default" or "TxS"
    nodes: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.path} {self.sockets}"

    def train_args(self, plan: CheckPlan, mib: int, rounds: int, backward: bool = False) -> list[str]:
        """`meshrun train`'s arguments for this job (run from examples/). `backward`: the pairs' other order.
        A setting's ``+NCCL_X=V`` parts go to the job's environment, the sockets part to nccl_bench."""
        sockets, *extra = self.sockets.split("+")
        env = [x for var in extra for x in ("--env", var)]
        if self.path == "lan":  # the data path on the site network, meshrun only for the rendezvous
            env += ["--env", f"NCCL_SOCKET_IFNAME=={LAN_IFNAME}", "--env", f"GLOO_SOCKET_IFNAME={LAN_IFNAME}"]
        # "lanpath": meshrun0's address as for any job; the trusted site's routes take it onto the LAN path.
        # "wan": meshrun0 across the sites with the delay line between them (meshrun.lab.wan), that pair only.
        both = "cross,same" if backward else "same,cross"
        pairs = {"lan": "same", "lanpath": "same", "wan": "cross"}.get(self.path, both)
        bench = ["--sockets", sockets, "--mib", str(mib), "--rounds", str(rounds), "--pairs", pairs]
        return ["--nodes", ",".join(self.nodes), *env, *plan.train_args("nccl_bench.py", "INIT,NET,GRAPH"), *bench]


def bench_jobs(
    plan: CheckPlan, settings: tuple[str, ...] = SETTINGS, lan_path: bool = False, wan: bool = False
) -> list[BenchJob]:
    """The jobs of one pass: the raw site LAN at NCCL's default, then meshrun0 at each setting (gloo: one), then,
    with `lan_path` (the trusted site's pair is on it), the site LAN path at NCCL's default. With `wan`: only the
    cross-site pair over the WAN, at each setting. Pure."""
    if plan.backend == "gloo":
        settings = ("default",)  # socket threads and sockets are NCCL's: gloo has one setting
    if wan:
        return [BenchJob("wan", s, BENCH_NODES) for s in settings]
    jobs = [BenchJob("lan", "default", BENCH_NODES[:2])]
    jobs += [BenchJob("meshrun0", s, BENCH_NODES) for s in settings]
    return jobs + ([BenchJob("lanpath", "default", LAN_PATH_NODES)] if lan_path else [])


def cell_name(path: str, pair: str, sockets: str) -> str:
    """A row of the table: 'lan same-site default', 'meshrun0 cross-site 2x8', ..."""
    return f"{path} {'same-site' if pair == 'same' else 'cross-site'} {sockets}"


def bench_result(text: str) -> dict | None:
    """The ``NCCL_BENCH {json}`` line nccl_bench.py printed, parsed; None if there is none."""
    for line in text.splitlines():
        at = line.find("NCCL_BENCH ")
        if at >= 0:
            try:
                return json.loads(line[at + len("NCCL_BENCH ") :])
            except ValueError:
                return None
    return None


def nccl_net_lines(text: str, limit: int = 60) -> list[str]:
    """The distinct lines NCCL logged about networks, sockets and graphs, rank prefixes and host/pid removed."""
    seen: list[str] = []
    for line in text.splitlines():
        hit = NCCL_NET_LINE.search(line)
        if not hit:
            continue
        msg = re.sub(r"0x[0-9a-f]+", "0x..", hit.group(1)).strip()
        if msg not in seen:
            seen.append(msg)
            if len(seen) >= limit:
                break
    return seen


def spread(values: list[float]) -> dict:
    """{"min", "median", "max", "n"} of a measurement's rounds ({"n": 0} for none); the benchmarks' too."""
    v = sorted(float(x) for x in values)
    return {"min": v[0], "median": statistics.median(v), "max": v[-1], "n": len(v)} if v else {"n": 0}


@dataclass
class BenchTable:
    """The table as it fills: per cell every round's GB/s, per job NCCL's lines; written after every job."""

    backend: str
    mib: int
    environment: dict
    cells: dict[str, list[float]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # jobs as run, with their pass
    nccl: dict[str, list[str]] = field(default_factory=dict)  # job label -> NCCL's lines (first run of it)
    speeds: dict[str, str] = field(default_factory=dict)  # interface -> /sys/class/net/IF/speed
    failures: list[str] = field(default_factory=list)
    wan: dict = field(default_factory=dict)  # the WAN part's set-up and delay line counters (empty: none)

    def add(self, job: BenchJob, result: dict | None, text: str, rc: int, pass_no: int, secs: float) -> None:
        self.order.append(f"pass {pass_no}: {job.label} ({secs:.0f} s, exit {rc})")
        if job.label not in self.nccl:
            self.nccl[job.label] = nccl_net_lines(text)
        if rc != 0 or result is None:
            self.failures.append(f"pass {pass_no}: {job.label}: exit {rc}" + ("" if result else ", no result"))
            return
        for node in result.get("nodes", []):
            self.speeds[f"{result.get('ifname')}"] = str(node.get("speed"))
        for pair, data in result.get("pairs", {}).items():
            self.cells.setdefault(cell_name(job.path, pair, job.sockets), []).extend(data.get("rounds", []))

    def as_json(self) -> dict:
        return {
            "what": (
                f"all-reduce bus bandwidth (GB/s) of {self.mib} MiB between two nodes, {self.backend}; per cell "
                "every round's value is the median of its timed iterations; 'lan' is the raw site network "
                f"({LAN_IFNAME}, no meshrun), 'meshrun0' the overlay; sockets: NCCL threads x sockets per thread, "
                "'default' neither variable set"
            ),
            "backend": self.backend,
            "environment": self.environment,
            "cells": {name: {**spread(v), "rounds": v} for name, v in self.cells.items()},
            "iface_speed_mbps": self.speeds,
            "jobs": self.order,
            "failures": self.failures,
            "nccl_lines": self.nccl,
            **({"wan": self.wan} if self.wan else {}),
        }

    def rows(self) -> list[str]:
        out = [f"{'path / pair / sockets':34} {'min':>7} {'median':>7} {'max':>7}  n   (GB/s, {self.backend})"]
        for name, v in self.cells.items():
            s = spread(v)
            out.append(f"{name:34} {s['min']:7.3f} {s['median']:7.3f} {s['max']:7.3f}  {s['n']}")
        return out


def environment(backend: str) -> dict:
    """The machine the table was measured on: GPU, driver, NCCL, torch, kernel, wireguard-go, date."""
    wg = wireguard_binary()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": backend,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "wireguard_go": wg["prints"],
        "wireguard": wg,
        "meshrun_commit": cmd("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            env["driver"] = cmd("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    except ImportError:
        env["torch"] = "missing"
    return env


def cmd(*argv: str) -> str:
    """The first line `argv` prints, or "unavailable" (missing, failed, or silent)."""
    try:
        res = run_command(argv, check=False, quiet=True, timeout=20)
    except MeshrunError:
        return "unavailable"
    lines = res.stdout.strip().splitlines()
    return lines[0] if res.returncode == 0 and lines else "unavailable"


def run_bench(
    mesh: Mesh,
    plan: CheckPlan,
    settings: tuple[str, ...],
    mib: int,
    budget_s: float,
    rounds_per_job: int,
    out_path: Path | None,
    log_path: Path | None,
    out=print,
    job_timeout_s: float = 240,
    lan_path: bool = False,
    table: BenchTable | None = None,
    wan: bool = False,
) -> BenchTable:
    """Passes of bench_jobs (forward, then backward, ...) while `budget_s` lasts; the table (`table`, or a new
    one), written as it fills. `wan`: the WAN's jobs (the caller has the delay line in place)."""
    table = table or BenchTable(plan.backend, mib, environment(plan.backend))
    jobs = bench_jobs(plan, settings, lan_path, wan)
    t0, longest = time.monotonic(), 0.0
    logs: list[str] = []
    passes = 1 if plan.backend == "gloo" else 99
    for pass_no in range(passes):
        order = jobs if pass_no % 2 == 0 else jobs[::-1]
        for job in order:
            elapsed = time.monotonic() - t0
            if pass_no > 0 and elapsed + longest > budget_s:
                out(f"[{_stamp()}] bench: budget of {budget_s:.0f} s reached after {elapsed:.0f} s, {pass_no} pass(es)")
                return table
            out(f"[{_stamp()}] bench pass {pass_no}: {job.label} ...")
            started = time.monotonic()
            job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", f"bench{pass_no}-{job.path}-{job.sockets}")[:64]
            try:
                res = mesh.meshrun(
                    "hq-a",
                    "train",
                    "--job-id",
                    job_id,
                    *job.train_args(plan, mib, rounds_per_job, backward=pass_no % 2 == 1),
                    cwd=EXAMPLES,
                    timeout=job_timeout_s,
                    check=False,
                )
                text, rc = res.stdout + res.stderr, res.returncode
            except MeshrunError as exc:  # it hung: the job belongs to the coordinator, so cancel it there
                text, rc = f"{exc}\n", 124
                mesh.meshrun("hq-a", "cancel", job_id, check=False, timeout=60)
                text += mesh.job_logs("hq-a", job_id)
            secs = time.monotonic() - started
            longest = max(longest, secs)
            result = bench_result(text)
            table.add(job, result, text, rc, pass_no, secs)
            got = "; ".join(
                f"{p}: {', '.join(f'{x:.3f}' for x in d.get('rounds', []))}"
                for p, d in (result or {}).get("pairs", {}).items()
            )
            out(f"[{_stamp()}] bench pass {pass_no}: {job.label}: {got or 'NO RESULT'} GB/s ({secs:.0f} s)")
            logs.append(f"===== pass {pass_no} {job.label} exit {rc} ({secs:.0f} s)\n{text}\n")
            if log_path is not None:  # rewritten whole after every job, as the table: a killed run keeps both
                atomic_write(log_path, "".join(logs), mode=0o644)
            if out_path is not None:
                atomic_write(out_path, json.dumps(table.as_json(), indent=1) + "\n", mode=0o644)
    return table


@dataclass(frozen=True)
class WanPlan:
    """The WAN part of the table: the cross-site pair over `rtt_ms` more round trip and `loss_pct` % loss each way
    (meshrun.lab.wan), all-reducing `mib` MiB, passes while `budget_s` lasts; `only`: without the LAN table."""

    rtt_ms: float
    loss_pct: float = 0.0
    mib: int = 32
    budget_s: float = 200
    only: bool = False


def run_wan_bench(
    world: World,
    mesh: Mesh,
    plan: CheckPlan,
    settings: tuple[str, ...],
    wan_plan: WanPlan,
    rounds_per_job: int,
    table: BenchTable | None,
    out_path: Path | None,
    log_path: Path | None,
    out=print,
) -> BenchTable:
    """The WAN's jobs (bench_jobs with `wan`) with the delay line between the cross-site pair; into `table`."""
    from meshrun.lab import wan

    a, b = BENCH_NODES[0], BENCH_NODES[2]
    dst = mesh.overlay_ip(b)
    before = wan.rtt_ms(world.node(a), dst)
    with wan.delayed(world, a, b, wan_plan.rtt_ms, wan_plan.loss_pct) as stats:
        rtt = wan.rtt_ms(world.node(a), dst)
        out(f"[{_stamp()}] WAN {a}-{b}: overlay RTT {before} ms -> {rtt} ms, {wan_plan.loss_pct:g} % loss each way")
        table = table or BenchTable(plan.backend, wan_plan.mib, environment(plan.backend))
        table.wan = {"pair": [a, b], "rtt_ms_added": wan_plan.rtt_ms, "loss_pct_each_way": wan_plan.loss_pct}
        table.wan |= {"mib": wan_plan.mib, "overlay_rtt_ms_before": before, "overlay_rtt_ms_with_wan": rtt}
        table = run_bench(
            mesh,
            plan,
            settings,
            wan_plan.mib,
            wan_plan.budget_s,
            rounds_per_job,
            out_path,
            log_path,
            out,
            table=table,
            wan=True,
        )
    table.wan["delay_line"] = stats
    table.wan["emulation"] = "NFQUEUE delay line in the internet namespace (meshrun.lab.wan)"
    if out_path is not None:
        atomic_write(out_path, json.dumps(table.as_json(), indent=1) + "\n", mode=0o644)
    return table


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def check_plan(gpus: int, nodes: list[str]) -> CheckPlan:
    """NCCL with node i on GPU i % `gpus` (several nodes may share one), or gloo when there is no GPU. Pure."""
    if gpus < 1:
        return CheckPlan(
            "gloo",
            {},
            "meshrun gpu-check: this machine has no GPU: the check runs on gloo (CPU) instead, and NCCL is NOT "
            "exercised",
        )
    gpu_of = {node: i % gpus for i, node in enumerate(nodes)}
    shared = len(nodes) > gpus
    note = (
        f"meshrun gpu-check: {len(nodes)} nodes share {gpus} GPU(s) (node i on GPU i % {gpus}); each node's "
        "NCCL_HOSTID is its name, so NCCL treats them as separate hosts"
    )
    return CheckPlan("nccl", gpu_of, note if shared else "")


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def summarize(output: str) -> dict[str, set[str]]:
    """{group: the distinct NCCL transport lines logged after that group's marker} (ranks' prefixes removed)."""
    current: dict[str, str] = {}
    seen: dict[str, set[str]] = defaultdict(set)
    for line in output.splitlines():
        m = MARK.match(line.strip())
        if m:
            current[m.group(1) + m.group(2)] = m.group(3)
            continue
        prefix = re.match(r"^\[(\S+) r(\d+)\] (.*)$", line.strip())
        if not prefix:
            continue
        hit = NCCL_LINE.search(prefix.group(3))
        group = current.get(prefix.group(1) + prefix.group(2))
        if hit and group:
            # Addresses and ranks differ per rank; the transport and interface are what matter.
            seen[group].add(re.sub(r"\d+\[\d+\] -> \d+\[\d+\]", "a -> b", hit.group(1)))
    return seen


def run(
    out=print,
    bench: bool = True,
    settings: tuple[str, ...] = SETTINGS,
    mib: int = 256,
    budget_s: float = 300,
    rounds_per_job: int = 2,
    out_path: Path | None = None,
    log_path: Path | None = None,
    job_timeout_s: float = 240,
    lan_path: bool = True,
    wan: WanPlan | None = None,
    lan_encapsulation: str = "vxlan",
    workers: str = DEFAULT_WORKERS,
) -> int:
    """Build the world, run the check, print the summary, then the bandwidth table; the check's exit code
    (a bench job that fails makes it 1 too). `lan_path`: site s2 is trusted (with `lan_encapsulation`), its pair
    measured on the LAN path.
    `wan`: then the cross-site pair again at each setting over a WAN (`WanPlan.only`: instead of the table)."""
    if os.geteuid() != 0:
        raise HostError("the GPU check builds network namespaces and needs root", "run it with sudo")
    gpus = gpu_count()
    dcs = [DatacenterSpec("hq")] + [DatacenterSpec(f"s{i}", nodes=NODES_PER_SITE) for i in range(1, SITES + 1)]
    with World(dcs, prefix="gpuchk") as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        nodes = [n for n in world.nodes if n.dc != "hq"]
        plan = dataclasses.replace(check_plan(gpus, [n.name for n in nodes]), workers=workers)
        if plan.message:
            out(plan.message)
        for n in nodes:
            mesh.join(n, "--site", n.dc)
        if bench and lan_path and not (wan and wan.only):
            lan_path = trust_site(mesh, out, encapsulation=lan_encapsulation)
        out(f"[{_stamp()}] world up; groups check ({plan.backend})")
        res = mesh.meshrun("hq-a", "train", *plan.train_args(), cwd=EXAMPLES, timeout=600, check=False)
        report_check(res, out)
        table = None
        if bench:
            if out_path is None and plan.backend == "nccl":
                out_path = RESULTS
            if plan.backend == "gloo":
                mib = min(mib, 16)  # the path, not the speed: a CPU machine's gloo at 256 MiB takes long
            if wan is None or not wan.only:
                table = run_bench(
                    mesh,
                    plan,
                    settings,
                    mib,
                    budget_s,
                    rounds_per_job,
                    out_path,
                    log_path,
                    out,
                    job_timeout_s,
                    lan_path,
                )
            if wan is not None:
                table = run_wan_bench(world, mesh, plan, settings, wan, rounds_per_job, table, out_path, log_path, out)
    if table is not None:
        out("")
        wan_note = f"; wan: {wan.mib} MiB, {wan.rtt_ms:g} ms more RTT, {wan.loss_pct:g} % loss" if wan else ""
        out(f"all-reduce bus bandwidth, {mib} MiB, two nodes (lan: {LAN_IFNAME}, no meshrun{wan_note}):")
        for row in table.rows():
            out(row)
        for iface, speed in sorted(table.speeds.items()):
            out(f"/sys/class/net/{iface}/speed in a node: {speed}")
        for label, lines in table.nccl.items():
            for line in lines:
                if re.search(r"NET/Socket|Using network|threads|maxBw|Pattern|speed", line):
                    out(f"NCCL [{label}]: {line}")
        for failure in table.failures:
            out(f"bench FAILED: {failure}")
        if out_path is not None:
            out(f"table written to {out_path}")
    ok = res.returncode == 0 and (table is None or not table.failures)
    out(f"gpu-check {'passed' if ok else f'FAILED (exit {res.returncode or 1})'}")
    return 0 if ok else (res.returncode or 1)


def trust_site(mesh: Mesh, out=print, timeout_s: float = 40, encapsulation: str = "vxlan") -> bool:
    """`meshrun site trust` LAN_PATH_SITE with `encapsulation` and wait until its pair is on the site LAN path;
    False (said) if not."""
    from meshrun.core import lanpath

    mesh.meshrun("hq-a", "site", "trust", LAN_PATH_SITE, "--encapsulation", encapsulation)
    a, b = LAN_PATH_NODES
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = {r["name"]: r["path"] for r in mesh.status(a)["peers"]}
        if rows.get(b) in (lanpath.LABEL, lanpath.ROUTED_LABEL):
            out(f"[{_stamp()}] site {LAN_PATH_SITE} trusted: {a}-{b} on the site LAN path")
            return True
        time.sleep(1)
    out(f"site LAN path not up after {timeout_s:.0f} s ({mesh.status(a).get('lan')}); its row is left out")
    for n in LAN_PATH_NODES:  # what the agents said about it
        log = mesh.state_dir(mesh.world.node(n)) / "daemon.log"
        res = mesh.world.node(n).run("sh", "-c", f"grep -i -e lan -e site {log} | tail -12", check=False)
        out(f"{n}'s agent: " + res.stdout.strip().replace("\n", f"\n{n}'s agent: "))
    return False


FAILURE_TAIL = 40  # lines of a failed check's ranks shown
RANK_LINE = re.compile(r"^\[\S+ r\d+\] ")  # a worker's line, as meshrun train prefixes it


def report_check(res, out=print) -> None:
    """The groups check's lines and each group's NCCL transport (`res`: the `meshrun train` CompletedProcess)."""
    text = res.stdout + res.stderr
    for line in text.splitlines():
        if "backend=" in line or "site=" in line or ": ok" in line or "WRONG" in line:
            out(line)
    if "cuda_at_start=True" in text:  # a warm worker was forked from a process that had initialised CUDA
        out("CUDA was initialised before a warm worker's script started: its fork cannot use the GPU")
    out("")
    seen = summarize(text)
    for group in ("world group", "site group", "cross-site groups"):
        lines = sorted(seen.get(group, set()))
        out(f"{group}: " + ("; ".join(lines) if lines else "(no NCCL transport lines: gloo, or NCCL logged none)"))
    if res.returncode != 0:  # what the ranks said last, NCCL's log left out: why it failed
        said = [line for line in text.splitlines() if RANK_LINE.match(line) and "NCCL INFO" not in line]
        out("\n".join(said[-FAILURE_TAIL:] + text.splitlines()[-4:]))
    out(f"groups check {'passed' if res.returncode == 0 else f'FAILED (exit {res.returncode})'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshrun.lab.gpucheck", description=__doc__.splitlines()[0])
    p.add_argument("--no-bench", action="store_true", help="only the groups check, no bandwidth table")
    p.add_argument("--workers", choices=WORKER_KINDS, default=DEFAULT_WORKERS, help="meshrun train --workers")
    p.add_argument(
        "--settings", default=",".join(SETTINGS), help="NCCL socket settings: default and/or TxS, each +NCCL_VAR=V ..."
    )
    p.add_argument("--mib", type=int, default=256, help="all-reduce size, MiB (gloo: at most 16)")
    p.add_argument("--budget-s", type=float, default=300, help="no new pass of the bench after this many seconds")
    p.add_argument("--rounds-per-job", type=int, default=2)
    p.add_argument("--job-timeout-s", type=float, default=240, help="a bench job still running then is cancelled")
    p.add_argument("--out", type=Path, help="the table as JSON [NCCL: benchmarks/results/gpu_datapath.json]")
    p.add_argument("--log", type=Path, help="every bench job's whole output, in one file")
    p.add_argument("--no-lan-path", action="store_true", help="do not trust site s2 nor measure the site LAN path")
    p.add_argument(
        "--lan-encapsulation",
        choices=("vxlan", "none"),
        default="vxlan",
        help="how site s2 is trusted (`meshrun site trust --encapsulation`) [vxlan]",
    )
    p.add_argument("--wan-rtt-ms", type=float, help="then the cross-site pair again, over a WAN of this much RTT")
    p.add_argument("--wan-loss-pct", type=float, default=0.0, help="the WAN's loss each way, percent [0]")
    p.add_argument("--wan-mib", type=int, default=32, help="all-reduce size over the WAN, MiB [32]")
    p.add_argument("--wan-budget-s", type=float, default=200, help="no new WAN pass after this many seconds [200]")
    p.add_argument("--wan-only", action="store_true", help="the WAN rows without the LAN table")
    a = p.parse_args(argv)
    settings = tuple(x.strip() for x in a.settings.split(",") if x.strip())
    for x in settings:
        if not SETTING.fullmatch(x):
            p.error(
                f"--settings: {x!r} is not 'default' or TxS, either optionally +NCCL_VAR=VALUE ..., "
                "e.g. 4x4+NCCL_BUFFSIZE=16777216"
            )
    if a.wan_only and a.wan_rtt_ms is None:
        p.error("--wan-only needs --wan-rtt-ms: the WAN's round trip, e.g. --wan-rtt-ms 60")
    wan = None
    if a.wan_rtt_ms is not None:
        wan = WanPlan(a.wan_rtt_ms, a.wan_loss_pct, a.wan_mib, a.wan_budget_s, a.wan_only)
    try:
        return run(
            bench=not a.no_bench,
            wan=wan,
            settings=settings,
            mib=a.mib,
            budget_s=a.budget_s,
            rounds_per_job=a.rounds_per_job,
            out_path=a.out,
            log_path=a.log,
            job_timeout_s=a.job_timeout_s,
            lan_path=not a.no_lan_path,
            lan_encapsulation=a.lan_encapsulation,
            workers=a.workers,
        )
    except MeshrunError as exc:
        print(f"meshrun gpu-check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
