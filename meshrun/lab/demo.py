"""`meshrun demo`: the whole product on one Linux machine, with nothing to configure.

Builds a NAT'd multi-datacenter world in network namespaces (meshrun.lab.testbed), shows plain
torchrun failing across the NAT, then runs the real `meshrun init`, `join`, `status` and
`train` inside it, and tears everything down. Needs root and the examples/ directory of a
meshrun checkout (the bundled DDP example it trains). With `sites`, two datacenters of two nodes
each join with `--site` and train examples/sites_diloco.py: DDP inside each site on its LAN,
DiLoCo across the sites, and the bytes that crossed each datacenter's gateway are shown.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from pathlib import Path

from meshrun.errors import HostError, LaunchError, UsageError
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec, World, remove_stale
from meshrun.system.files.statedir import StateDir, read_json_files
from meshrun.system.machine import procs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RDZV_PORT = 29500
NEGATIVE_TIMEOUT = 15
# One record per running demo ({"prefix", "pid"}): demos side by side take prefixes of their own, and a demo
# finds what a killed one left (its namespaces, its WireGuard processes) and removes it.
DEMO_RUNS = Path("/run/meshrun-demo")


def claim_prefix(out=print, runs: Path = DEMO_RUNS) -> str:
    """A testbed prefix of this demo's own, recorded in `runs`; what demos killed earlier left is torn down
    first (said), a demo running beside this one is left alone (said)."""
    for rec in read_json_files(runs, "demo*.json"):
        prefix, pid = str(rec.get("prefix", "")), int(rec.get("pid") or 0)
        if not re.fullmatch(r"demo[0-9a-f]{4}", prefix):
            continue
        if pid and procs.alive(pid):
            out(f"    another meshrun demo runs beside this one (pid {pid}, namespaces {prefix}-*): left alone")
            continue
        gone = remove_stale(prefix)
        StateDir(runs).remove(f"{prefix}.json")
        out(f"    removed what a killed demo (pid {pid}) left behind: {len(gone)} namespaces {prefix}-*")
    prefix = "demo" + secrets.token_hex(2)
    StateDir(runs).create()
    StateDir(runs).write_json(f"{prefix}.json", {"prefix": prefix, "pid": os.getpid()})
    return prefix


def _say(out, step: int, total: int, text: str) -> None:
    out(f"\n==> [{step}/{total}] {text}")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def negative_control(world: World, out) -> str:
    """Plain torchrun between two datacenters: rendezvous at A's public IP (1:1 NAT forwards it),
    no --local-addr, no interface pinning. Returns the line that shows why it failed."""
    a = world.nodes[1]
    b = next(n for n in world.nodes[2:] if n.dc != a.dc)  # another datacenter: across the NAT
    script = EXAMPLES / "ddp_train.py"
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{a.public_ip}:{RDZV_PORT}",
        "--rdzv-id",
        "nomesh",
        "--rdzv-conf",
        f"join_timeout={NEGATIVE_TIMEOUT},read_timeout={NEGATIVE_TIMEOUT}",
        str(script),
        "--epochs",
        "1",
        "--steps-per-epoch",
        "2",
        "--checkpoint",
        "/dev/null/none",
    ]
    out(f"    {a.name}: torchrun --rdzv-endpoint {a.public_ip}:{RDZV_PORT} --rdzv-conf is_host=1 ... ddp_train.py")
    out(f"    {b.name}: torchrun --rdzv-endpoint {a.public_ip}:{RDZV_PORT} --rdzv-conf is_host=0 ... ddp_train.py")
    env = {"PYTHONUNBUFFERED": "1"}
    runs = [
        n.popen(
            *common[:13],
            "--rdzv-conf",
            f"is_host={int(i == 0)}",
            *common[13:][2:],
            env=env,
            stdout=procs.PIPE,
            stderr=procs.STDOUT,
            text=True,
        )
        for i, n in enumerate((a, b))
    ]
    t0 = time.monotonic()
    outputs = []
    for p in runs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, NEGATIVE_TIMEOUT + 10 - (time.monotonic() - t0)))[0])
        except procs.TimeoutExpired:
            p.kill()
            outputs.append((p.communicate()[0] or "") + "\n(killed after the time limit: hung)")
    codes = [p.returncode for p in runs]
    if all(c == 0 for c in codes):
        raise LaunchError(
            "plain torchrun unexpectedly worked across the NAT",
            "the testbed is not simulating NAT; report this as a bug",
        )
    text = "\n".join(outputs)
    took = time.monotonic() - t0
    if "connectFullMesh" in text or "ProcessGroupGloo" in text:
        return (
            f"failed after {took:.0f} s: the rendezvous got through {a.public_ip} (1:1 NAT), then Gloo's "
            f"full-mesh connect failed: each rank announced its private address {a.private_ip}, "
            "which in the other datacenter is that node itself"
        )
    pattern = re.compile(
        r"(Connection refused|timed out|timeout|No route|unreachable|failed to|"
        r"Network is unreachable|Name or service not known|hung)",
        re.I,
    )
    reasons = [ln.strip() for ln in text.splitlines() if pattern.search(ln)]
    reason = reasons[0] if reasons else text.strip().splitlines()[-1] if text.strip() else "no output"
    return f"failed after {took:.0f} s (exit codes {codes}): {reason[:240]}"


SITE_NODES = 2  # nodes per datacenter with --sites


def run(nodes: int = 3, out=print, sites: bool = False) -> int:
    """Run the demo; returns the exit code (0 when the job trained across every datacenter).

    `nodes`: training datacenters (one node each); with `sites`, two datacenters of SITE_NODES nodes.
    """
    if os.geteuid() != 0:
        raise HostError("meshrun demo builds network namespaces and needs root", "run it with sudo")
    if not 2 <= nodes <= 8:
        raise UsageError(f"--nodes {nodes} is outside 2..8", "e.g. meshrun demo --nodes 3")
    example = "sites_diloco.py" if sites else "ddp_train.py"
    for name in {"ddp_train.py", example}:
        if not (EXAMPLES / name).is_file():
            raise UsageError(
                f"the bundled example {EXAMPLES / name} is missing",
                "run the demo from a meshrun checkout (pip install -e .)",
            )
    total = 6
    t_start = time.monotonic()
    if sites:
        dcs = [DatacenterSpec("hq")] + [DatacenterSpec(f"dc{i}", nodes=SITE_NODES) for i in (1, 2)]
    else:
        dcs = [DatacenterSpec("hq")] + [DatacenterSpec(f"dc{i}") for i in range(1, nodes + 1)]
    prefix = claim_prefix(out)
    try:
        return _run_world(dcs, prefix, nodes, out, sites, total, t_start, example)
    finally:
        StateDir(DEMO_RUNS).remove(f"{prefix}.json")


def _run_world(dcs, prefix: str, nodes: int, out, sites: bool, total: int, t_start: float, example: str) -> int:
    with World(dcs, prefix=prefix) as world:
        _say(
            out,
            1,
            total,
            f"Building {len(dcs)} datacenters behind NAT in network namespaces (every one reuses 172.31.32.0/20)",
        )
        world.up()
        out(_indent(world.describe()))
        coord = world.nodes[0]
        workers = world.nodes[1:]

        _say(out, 2, total, f"Plain torchrun across the NAT, without meshrun (bounded to {NEGATIVE_TIMEOUT} s)")
        out("    " + negative_control(world, out))

        _say(out, 3, total, f"meshrun init on {coord.name} (public {coord.public_ip})")
        mesh = Mesh(world, coord.name)
        t0 = time.monotonic()
        init_out = mesh.meshrun(coord, "init", "--endpoint", str(coord.public_ip)).stdout.strip().splitlines()
        mesh.token = init_out[-1]
        out(_indent("\n".join(init_out[:-1])))
        out(f"    token: {mesh.token[:24]}...{mesh.token[-6:]}  ({time.monotonic() - t0:.1f} s)")

        _say(out, 4, total, f"meshrun join on {', '.join(n.name for n in workers)}")
        for n in workers:
            t0 = time.monotonic()
            res = mesh.join(n, *(["--site", n.dc] if sites else []))
            out(f"    {n.name}: {res.stdout.strip()}  ({time.monotonic() - t0:.1f} s)")
        for n in workers:
            for m in workers:
                if m is not n:
                    mesh.wait_ping(n, mesh.overlay_ip(m), timeout=20)
        out(f"    every node pings every other over the overlay ({len(workers) * (len(workers) - 1)} pairs)")

        _say(out, 5, total, f"meshrun status on {coord.name}")
        out(_indent(mesh.meshrun(coord, "status").stdout))

        if sites:
            _say(out, 6, total, f"meshrun train {example}: DDP inside each site on its LAN, DiLoCo across the sites")
            args = ["--steps", "40", "--sync-every", "10"]
            before = {dc.name: world.gateway_counters(dc.name) for dc in dcs[1:]}
        else:
            _say(out, 6, total, f"meshrun train {example} on {len(workers)} datacenters (gloo over the overlay)")
            args = ["--epochs", "5", "--steps-per-epoch", "20"]
        argv = [mesh.python, "-m", "meshrun", "train", "--state-dir", str(mesh.state_dir(coord)), example, *args]
        proc = coord.popen(*argv, cwd=EXAMPLES, stdout=procs.PIPE, stderr=procs.STDOUT, text=True)
        checksums = {}
        for line in proc.stdout:
            line = line.rstrip()
            if "hostname of the client socket" in line:  # c10d noise: namespaces have no reverse DNS
                continue
            m = re.search(r"param_checksum rank=(\d+) value=(\w+)", line)
            if m:
                checksums[m.group(1)] = m.group(2)
            out("    " + line)
        code = proc.wait()
        if sites:
            for dc in dcs[1:]:
                after = world.gateway_counters(dc.name)
                sent = after["forward_out_bytes"] - before[dc.name]["forward_out_bytes"]
                out(f"    {dc.name}: {sent / 2**20:.1f} MiB left the datacenter (the DDP gradients stayed on its LAN)")
        if code == 0 and len(set(checksums.values())) == 1 and len(checksums) == len(workers):
            out(f"    all {len(checksums)} ranks ended with identical parameters")
        elif code == 0:
            out(f"    ranks disagree on their parameters: {checksums}")
            code = 1
        out(f"\n==> tearing down the world (demo took {time.monotonic() - t_start:.0f} s)")
    out("demo " + ("finished: one job trained across every datacenter" if code == 0 else f"failed (exit {code})"))
    return code
