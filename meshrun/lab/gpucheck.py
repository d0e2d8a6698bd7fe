"""`./dev.sh gpu-check`: what NCCL does over meshrun on this machine, in one command.

Builds NAT'd datacenters in network namespaces (meshrun.lab.testbed) on this one machine: a coordinator
and two sites (two nodes each with 4 GPUs or more, else one), joined with `meshrun join --site`; runs
examples/nccl_check.py under `meshrun train` with ``NCCL_DEBUG=INFO`` (each node on its own GPU), and
prints, for the world group, the site group and the cross-site groups, the transports and interfaces
NCCL reported. With fewer than two GPUs NCCL cannot run (one GPU per rank): the same check runs on
gloo and says that NCCL was not exercised. Needs root.

    sudo .venv/bin/python -m meshrun.lab.gpucheck
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from pathlib import Path

from meshrun.errors import HostError, MeshrunError
from meshrun.lab.testbed import DatacenterSpec, Mesh, World

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MARK = re.compile(r"^\[(\S+) r(\d+)\] == (.+) ==$")
# What NCCL says about its transport (NCCL_DEBUG=INFO, INIT and NET subsystems).
NCCL_LINE = re.compile(r"NCCL INFO (NET/\S+ : Using .*|Channel \d+/\d+ : .* via \S+|Using network \S+|NET/IB.*)")


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


def run(out=print) -> int:
    """Build the world, run the check, print the summary; the job's exit code."""
    if os.geteuid() != 0:
        raise HostError("the GPU check builds network namespaces and needs root", "run it with sudo")
    gpus = gpu_count()
    per_site = 2 if gpus >= 4 else 1
    nccl = gpus >= 2
    if not nccl:
        out(
            f"meshrun gpu-check: NCCL needs one GPU per rank and this machine has {gpus}: the check runs on gloo "
            "(CPU) instead, and NCCL is NOT exercised"
        )
    dcs = [DatacenterSpec("hq")] + [DatacenterSpec(f"s{i}", nodes=per_site) for i in (1, 2)]
    with World(dcs, prefix="gpuchk") as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        nodes = [n for n in world.nodes if n.dc != "hq"]
        for n in nodes:
            mesh.join(n, "--site", n.dc)
        env = ["--env", "NCCL_DEBUG=INFO", "--env", "NCCL_DEBUG_SUBSYS=INIT,NET"]
        if not nccl:
            env += ["--env", "CUDA_VISIBLE_DEVICES="]
        res = mesh.meshrun(
            "hq-a",
            "train",
            *env,
            "nccl_check.py",
            "--gpu-order",
            ",".join(n.name for n in nodes),
            cwd=EXAMPLES,
            timeout=600,
            check=False,
        )
    text = res.stdout + res.stderr
    for line in text.splitlines():
        if "backend=" in line or "site=" in line or ": ok" in line or "WRONG" in line:
            out(line)
    out("")
    seen = summarize(text)
    for group in ("world group", "site group", "cross-site groups"):
        lines = sorted(seen.get(group, set()))
        out(f"{group}: " + ("; ".join(lines) if lines else "(no NCCL transport lines: gloo, or NCCL logged none)"))
    out(f"gpu-check {'passed' if res.returncode == 0 else f'FAILED (exit {res.returncode})'}")
    return res.returncode


def main() -> int:
    try:
        return run()
    except MeshrunError as exc:
        print(f"meshrun gpu-check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
