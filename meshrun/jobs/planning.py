"""Before a job starts: which members may take it, what ships, how every node's torchrun is planned.

Shared by the supervisor (meshrun.jobs.supervisor), the dry run and the checks of `meshrun train`
(meshrun.jobs.submission). Nothing here starts anything.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshrun.core import launch, preflight, topology
from meshrun.core.jobspec import JobSpec
from meshrun.core.model import Member, Network
from meshrun.errors import MeshrunError, UsageError
from meshrun.jobs.handles import LocalShare, RemoteShare, ShareHandle
from meshrun.mesh import member
from meshrun.system.files import archive
from meshrun.system.files.archive import Packed
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import firewall

__all__ = [
    "candidates",
    "check_environments",
    "coordinator_copy",
    "pack",
    "placements",
    "ask_health",
    "nproc",
    "code_dir",
    "plan",
]


def candidates(state: StateDir, spec: JobSpec, network: Network, members: list[Member], rec: dict) -> list[ShareHandle]:
    """Every member that may take a share of `spec`, in the order the plan gives them ranks (the
    coordinator first when it trains). UsageError when --nodes names a member that does not exist."""
    nodes = [m for m in members if not m.is_coordinator]
    if spec.nodes:
        unknown = sorted(set(spec.nodes) - {m.name for m in nodes})
        if unknown:
            raise UsageError(
                f"--nodes names unknown node(s): {', '.join(unknown)}",
                f"members are: {', '.join(m.name for m in nodes) or 'none'}",
            )
        nodes = [m for m in nodes if m.name in spec.nodes]
    out: list[ShareHandle] = [RemoteShare(network, m, member.job_key(state, m.public_key)) for m in nodes]
    if spec.with_coordinator or rec.get("train"):
        gate = firewall.job_gate(spec.job_id, network)
        out.insert(0, LocalShare(state, spec.job_id, rec["name"], network.coordinator_ip, network.interface, gate))
    return out


def check_environments(
    spec: JobSpec, shares, healths: dict[str, dict], job_id: str, project: str
) -> tuple[list[preflight.EnvReport], dict[str, str] | None]:
    """Every share's environment report, asked in parallel, with its clock offset from ours; and, for a
    --no-sync job, the coordinator's own copy of the code hashed at the same moment (None otherwise)."""

    def one(s) -> preflight.EnvReport:
        python = spec.python or str(healths.get(s.name, {}).get("python") or "python3")
        t0 = time.time()
        try:
            d = s.preflight(job_id, python, _unsynced_code(spec), project)
        except MeshrunError as exc:
            return preflight.EnvReport(s.name, python=python, error=exc.message)
        t1 = time.time()
        d["clock_offset_s"] = (
            preflight.clock_offset(t0, t1, float(d["time"]), float(d.get("took", 0.0))) if "time" in d else None
        )
        return preflight.EnvReport.from_dict(s.name, d)

    with ThreadPoolExecutor(max_workers=max(1, len(shares)) + 1) as pool:
        here = pool.submit(coordinator_copy, spec)
        reports = list(pool.map(one, shares))
        return reports, here.result()


def _unsynced_code(spec: JobSpec) -> str | None:
    """The directory each node hashes for a --no-sync job (None: the shipped copy, or nothing to hash).

    A module job without sync (`meshrun bench`) runs what each node's environment has installed,
    which the version rows compare; its cwd may be anything ("/"), so it is not hashed.
    """
    return spec.cwd if spec.no_sync and not spec.module else None


def coordinator_copy(spec: JobSpec) -> dict[str, str] | None:
    """The coordinator's own copy of a --no-sync job's code, hashed now ({file: sha256}); None when the
    job ships its code (the shipped manifest is the reference), has none here, or it is too large to
    hash (the nodes are then compared among themselves)."""
    unsynced = _unsynced_code(spec)
    if not unsynced or not Path(unsynced).is_dir():
        return None
    return archive.hash_files(unsynced, archive.select_files(unsynced).names)


def pack(spec: JobSpec, state: StateDir) -> Packed:
    """The job's code as it ships: the project's files (ignore rules applied, never meshrun's state), read once."""
    return archive.pack(archive.select_files(code_dir(spec), exclude=[state.path]), spec.sync_limit_mb)


def placements(shares: list[ShareHandle], sites: dict[str, topology.Site]) -> dict[str, topology.Placement]:
    """The site of each share within the job, numbered in the shares' order (the candidates', so that a node
    that joins an elastic job later finds the numbering the others got). `sites`: topology.assign's."""
    return topology.placement([s.name for s in shares], sites)


def ask_health(s) -> dict | None:
    """The share's health answer (GPUs, interpreter), or None if its agent does not answer."""
    try:
        return s.health()
    except MeshrunError:
        return None


def nproc(p: launch.NodeLaunch) -> int:
    return int(p.argv[p.argv.index("--nproc-per-node") + 1])


def code_dir(spec: JobSpec) -> Path:
    """The directory a job ships: its cwd (a module job), else the script's directory."""
    cwd = Path(spec.cwd)
    if spec.module:
        return cwd
    script = cwd / spec.script
    if not script.is_file():
        raise UsageError(
            f"script {spec.script!r} not found in {cwd}",
            "run `meshrun train` from the directory of your training code, or use --no-sync",
        )
    return script.parent


def plan(
    spec: JobSpec,
    network: Network,
    ready: list[tuple[str, str, dict]],
    store_port: int,
    local: bool = False,
    sites: dict[str, topology.Placement] | None = None,
    coordinators: tuple[str, ...] = (),
) -> list[launch.NodeLaunch]:
    """Every ready node's torchrun command and environment for `spec` (ready: name, overlay IP, health).

    `sites`: every node's site within the job (`placements`); None: the ready nodes', each a site of its own.
    """
    opts = spec.launch_options(network, store_port, shipped=not spec.no_sync, coordinators=coordinators)
    if sites is None:
        sites = topology.placement([name for name, _, _ in ready], {})
    infos = [launch.NodeInfo(name, ip, int(h.get("gpus", 0) or 0), sites.get(name)) for name, ip, h in ready]
    plans = launch.plan(infos, opts, spec.env, local=local)
    if spec.python:
        return plans
    # By default each node uses the interpreter its agent runs under: it has meshrun and torch.
    pythons = {name: str(h.get("python") or "python3") for name, _, h in ready}
    return [launch.NodeLaunch(p.node, (pythons[p.node], *p.argv[1:]), p.env) for p in plans]
