"""Shared helpers for the benchmarks: testbed worlds running meshrun, results files, summaries.

Every benchmark builds its own world under a unique prefix and tears it down on exit (also on
errors and Ctrl-C, through World's context manager), writes benchmarks/results/NAME.json and
prints one summary line. Ratios are always measured side by side in one run: the machine is
shared and absolute timings are noisy.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from meshrun.lab.gpucheck import spread  # noqa: E402, F401 (one definition: the GPU check's tables use it too)
from meshrun.lab.mesh import Mesh  # noqa: E402
from meshrun.lab.testbed import DatacenterSpec, World  # noqa: E402
from meshrun.system.machine.wgbinary import wireguard_binary  # noqa: E402


def need_root() -> None:
    if os.geteuid() != 0:
        sys.exit("this benchmark builds network namespaces: run it as root")


def prefix(tag: str) -> str:
    """A short unique testbed prefix: tag (<= 3 chars) + 4 hex digits."""
    return f"{tag[:3]}{secrets.token_hex(2)}"


@contextlib.contextmanager
def mesh_world(n_nodes: int, tag: str, rate_mbit: int | None = None, join: bool = True):
    """A world with one coordinator datacenter (dc1) plus `n_nodes` node datacenters, meshrun running.

    Yields (world, mesh, node_names). Joins run in parallel. Everything is torn down on exit.
    """
    specs = [DatacenterSpec(f"dc{i}", rate_mbit=rate_mbit) for i in range(1, n_nodes + 2)]
    with World(specs, prefix=prefix(tag)) as world:
        mesh = Mesh(world, "dc1-a")
        mesh.init()
        names = [f"dc{i}-a" for i in range(2, n_nodes + 2)]
        if join:
            join_all(mesh, names)
        try:
            yield world, mesh, names
        finally:
            for n in [*names, "dc1-a"]:  # stop daemons cleanly; down() kills whatever is left
                with contextlib.suppress(Exception):
                    mesh.meshrun(n, "leave" if n != "dc1-a" else "down", "--purge", check=False, timeout=30)


def join_all(mesh: Mesh, names: list[str]) -> list[float]:
    """`meshrun join` on every node at once; returns each join's wall time (raises the first error)."""

    def timed(n: str) -> float:
        t0 = time.monotonic()
        mesh.join(n)
        return time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:  # one thread each: all start together
        return list(pool.map(timed, names))


def cpu_jiffies() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine so far (/proc/stat).

    Busy is user nice system irq softirq: the CPU this machine's own work used. Steal (the hypervisor ran
    someone else on our CPU) is apart: it is no cost of the path measured, but it slows whatever runs while it
    lasts, so a measurement records it to show when the host, not the path, took the time."""
    f = open("/proc/stat").readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return user + nice + system + irq + softirq, steal


def environment() -> dict:
    """What the numbers were measured on: machine, date, load, torch, and the WireGuard binary."""
    import torch

    wg = wireguard_binary()
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "wireguard_go": wg["prints"],
        "wireguard": wg,
        "loadavg_at_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def sites_mesh(world: World, sites: tuple[str, ...] = ("s1", "s2")) -> Mesh:
    """meshrun init on hq-a and every node of `sites` joined with `--site` its site (nodes <site>-a, <site>-b)."""
    mesh = Mesh(world, "hq-a")
    mesh.init()
    for site in sites:
        for n in (f"{site}-a", f"{site}-b"):
            mesh.join(n, "--site", site)
    return mesh


def two_ranks(rank0, rank1, argv: list[str], timeout: float) -> tuple[str, str, str, str]:
    """Run `argv` + ["--rank", "0"] on node `rank0` and + ["--rank", "1"] on `rank1` (a two-rank job; rank 0
    first, it hosts the store); (stdout 0, stderr 0, stdout 1, stderr 1). Both are killed if still running."""
    p0 = rank0.popen(*argv, "--rank", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p1 = rank1.popen(*argv, "--rank", "1", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out0, err0 = p0.communicate(timeout=timeout)
        out1, err1 = p1.communicate(timeout=60)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
                p.wait()
    return out0, err0, out1, err1


def alternating(variants: list[str], rounds: int) -> list[str]:
    """The order to run `variants` in, `rounds` times over, alternating (A B, B A, A B, ...) so drift in the
    machine's load hits every variant alike."""
    order = []
    for r in range(rounds):
        order += variants if r % 2 == 0 else list(reversed(variants))
    return order


def write_result(name: str, data: dict, summary: str) -> Path:
    """benchmarks/results/NAME.json (with the summary line and the environment); prints the summary."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {
        "benchmark": name,
        "summary": summary,
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "environment": environment(),
        **data,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(summary, flush=True)
    return path


def set_congctl(node, dev: str, algo: str | None) -> None:
    """Congestion control `algo` (None: the host's default) for TCP over `dev`'s connected route.

    A route attribute, so it works inside namespaces, where only the algorithms listed in
    net.ipv4.tcp_allowed_congestion_control may be picked by sysctl.
    """
    route = node.run("ip", "-4", "route", "show", "dev", dev, "proto", "kernel").stdout.split()
    base = [route[0], "dev", dev, "proto", "kernel", "scope", "link", "src", route[route.index("src") + 1]]
    node.run("ip", "route", "replace", *base, *(["congctl", algo] if algo else []))


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
