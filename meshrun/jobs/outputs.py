"""What jobs leave on their members: files pulled back to the coordinator, and explicit cleanup.

A job runs in its project's persistent directory on every member (meshrun.system.files.projects), so
checkpoints outlive the job. `pull` fetches files from there over the overlay (the node's job API,
MAC'd as every job request; bounded); `prune` deletes finished jobs' records and the nodes' job
directories (never a project's files); `remove_project` deletes a project's directory everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from meshrun.core.jobspec import JobSpec
from meshrun.errors import MeshrunError, UsageError
from meshrun.jobs import control
from meshrun.jobs.handles import LocalShare, RemoteShare
from meshrun.mesh import member
from meshrun.mesh.coordinator import admin
from meshrun.system.files import archive, joblogs
from meshrun.system.files.projects import check_project
from meshrun.system.files.statedir import StateDir, remove_tree

__all__ = ["Pulled", "default_dest", "pull", "prune", "remove_project"]

log = logging.getLogger("meshrun.jobs.outputs")


@dataclass
class Pulled:
    """Files from one node: where they were written, how many; or why not."""

    node: str
    dest: Path | None = None
    files: int = 0
    error: str = ""


def _shares(state: StateDir, job_id: str, names: list[str]) -> list[RemoteShare | LocalShare]:
    """The job's members as shares this coordinator can talk to, in `names` order (members since
    removed are left out)."""
    network, members = admin.members(state)
    rec, _ = member.load(state)
    by_name = {m.name: m for m in members}
    out: list[RemoteShare | LocalShare] = []
    for n in names:
        if n == rec.get("name"):
            out.append(LocalShare(state, job_id, n, network.coordinator_ip))
        elif n in by_name:
            out.append(RemoteShare(network, by_name[n], member.job_key(state, by_name[n].public_key)))
    return out


def default_dest(job_id: str) -> Path:
    """Where `meshrun pull` puts a job's files unless told: ./meshrun-pulled/JOB, a directory the code
    sync never ships (pull is usually run from the project, whose next job would carry them otherwise)."""
    return Path(archive.PULLED_DIR) / job_id


def pull(
    state: StateDir, job_id: str, path: str, dest: Path | None = None, node: str | None = None, max_mb: int = 1024
) -> list[Pulled]:
    """Fetch `path` (relative to the job's working directory) from each of the job's nodes (or `node`)
    into dest/<node>/path (dest: `default_dest`); one Pulled per node. UsageError for a node that was
    not in the job."""
    dest = default_dest(job_id) if dest is None else dest
    rec = control.record(state, job_id)
    names = list(rec.nodes)
    if node is not None:
        if node not in names:
            raise UsageError(f"node {node!r} did not run job {job_id}", f"its nodes were: {', '.join(names) or 'none'}")
        names = [node]
    if not names:
        raise UsageError(f"job {job_id} never started on any node", "nothing to pull")

    def one(share) -> Pulled:
        try:
            blob = share.pull(job_id, path, max_mb << 20)
            where = Path(dest) / share.name
            files = archive.unpack_pulled(blob, where)
            return Pulled(share.name, where, len(files))
        except MeshrunError as exc:
            return Pulled(share.name, error=str(exc))

    shares = _shares(state, job_id, names)
    with ThreadPoolExecutor(max_workers=max(1, len(shares))) as pool:
        return list(pool.map(one, shares))


def prune(state: StateDir, say: Callable[[str], None]) -> list[str]:
    """Delete every finished job: its directory on each of its nodes, then its record here. Returns the ids.

    A job whose node cannot be reached keeps its record (pruned again later); projects are kept.
    """
    done = []
    for rec in control.list_jobs(state):
        if not rec.final:
            continue
        failed = []
        for share in _shares(state, rec.job_id, list(rec.nodes)):
            try:
                share.prune(rec.job_id)
            except MeshrunError as exc:
                failed.append(f"{share.name} ({exc.message})")
        if failed:
            say(f"kept {rec.job_id}: could not prune it on {', '.join(failed)}")
            continue
        remove_tree(joblogs.job_dir(state, rec.job_id).path)
        done.append(rec.job_id)
    return done


def remove_project(state: StateDir, project: str) -> list[str]:
    """Delete project `project`'s directory on every member (this coordinator included); the members it was on.

    UsageError while a job of the project runs; a member that does not answer is named in the error
    after the others are done (run it again once it is back)."""
    check_project(project)
    for job_id in joblogs.job_ids(state):
        try:
            spec = JobSpec.from_dict(joblogs.job_dir(state, job_id).read_json("spec.json"))
        except (MeshrunError, ValueError, TypeError):
            continue
        if (spec.project or spec.job_id) == project and not control.record(state, job_id).final:
            raise UsageError(
                f"job {job_id} of project {project!r} is still running", f"cancel it first (`meshrun cancel {job_id}`)"
            )
    _, members = admin.members(state)
    removed, failed = [], []
    for share in _shares(state, "-", [m.name for m in members]):
        try:
            if share.remove_project(project):
                removed.append(share.name)
        except MeshrunError as exc:
            failed.append(f"{share.name} ({exc.message})")
    if failed:
        raise UsageError(
            f"could not remove project {project!r} on {', '.join(failed)}"
            + (f" (removed on {', '.join(removed)})" if removed else ""),
            "run the command again when those members are back",
        )
    return removed
