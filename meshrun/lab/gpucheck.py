"""`./dev.sh gpu-check`: what NCCL does over meshrun on this machine, in one command.

Builds NAT'd datacenters in network namespaces (meshrun.lab.testbed) on this one machine: a coordinator
and two sites of two nodes, joined with `meshrun join --site`; runs examples/nccl_check.py under
`meshrun train` with ``NCCL_DEBUG=INFO`` (one rank per node, node i on GPU i % the GPU count), and
prints, for the world group, the site group and the cross-site groups, the transports and interfaces
NCCL reported. Each node's ranks set ``NCCL_HOSTID`` to the node's name: the namespaces share one
host name and boot id, which is what NCCL tells hosts apart by, so without it NCCL would refuse two
ranks on one GPU and use shared memory or NVLink between "nodes" instead of the overlay. Without a GPU
the same check runs on gloo and says that NCCL was not exercised. Needs root.

    sudo .venv/bin/python -m meshrun.lab.gpucheck
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from meshrun.errors import HostError, MeshrunError
from meshrun.lab.testbed import DatacenterSpec, Mesh, World

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MARK = re.compile(r"^\[(\S+) r(\d+)\] == (.+) ==$")
# What NCCL says about its transport (NCCL_DEBUG=INFO, INIT and NET subsystems).
NCCL_LINE = re.compile(r"NCCL INFO (NET/\S+ : Using .*|Channel \d+/\d+ : .* via \S+|Using network \S+|NET/IB.*)")
SITES, NODES_PER_SITE = 2, 2


@dataclass(frozen=True)
class CheckPlan:
    """How the check runs here: the backend, each node's GPU, and what it tells the user first ("" nothing)."""

    backend: str  # "nccl" or "gloo"
    gpu_of: dict[str, int]  # node name -> its GPU (empty on gloo)
    message: str = ""

    def train_args(self) -> list[str]:
        """`meshrun train`'s options and script for this plan (run from examples/)."""
        args = ["--nproc-per-node", "1", "--env", "NCCL_DEBUG=INFO", "--env", "NCCL_DEBUG_SUBSYS=INIT,NET"]
        if self.backend == "gloo":
            return args + ["--env", "CUDA_VISIBLE_DEVICES=", "nccl_check.py"]
        gpus = ",".join(f"{node}={gpu}" for node, gpu in self.gpu_of.items())
        return args + ["nccl_check.py", "--gpu-map", gpus, "--hostid-per-node"]


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


def run(out=print) -> int:
    """Build the world, run the check, print the summary; the job's exit code."""
    if os.geteuid() != 0:
        raise HostError("the GPU check builds network namespaces and needs root", "run it with sudo")
    gpus = gpu_count()
    dcs = [DatacenterSpec("hq")] + [DatacenterSpec(f"s{i}", nodes=NODES_PER_SITE) for i in range(1, SITES + 1)]
    with World(dcs, prefix="gpuchk") as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        nodes = [n for n in world.nodes if n.dc != "hq"]
        plan = check_plan(gpus, [n.name for n in nodes])
        if plan.message:
            out(plan.message)
        for n in nodes:
            mesh.join(n, "--site", n.dc)
        res = mesh.meshrun("hq-a", "train", *plan.train_args(), cwd=EXAMPLES, timeout=600, check=False)
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
