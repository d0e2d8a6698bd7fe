"""A job's files on the member that runs its share: the code it receives, its pre-flight report, files pulled back.

The same functions serve a node's job API (meshrun.jobs.nodeapi) and the coordinator's own share
(meshrun.jobs.handles.LocalShare), so both behave alike. A shipped job runs in its project's
persistent directory (meshrun.system.files.projects); a --no-sync job runs where its code already is,
and still gets the project's directory as $MESHRUN_OUTPUT_DIR.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO

from meshrun.core import codeset
from meshrun.system.files import archive
from meshrun.system.files.projects import ProjectDir
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import host

__all__ = ["receive_code", "preflight", "workdir", "pull", "MAX_PULL_BYTES"]

MAX_PULL_BYTES = 1 << 30


def receive_code(state: StateDir, job_id: str, project: str, blob: bytes | BinaryIO, node: str) -> int:
    """Lay a job's code over its project's directory here; the number of files shipped.

    LaunchError when another job of the project runs here; UsageError for a bad archive.
    """
    proj = ProjectDir(state, project)
    proj.refuse_if_busy(job_id, node)
    proj.create()
    names = archive.unpack_into(blob, proj.work, proj.shipped())
    proj.record_shipment(names, job_id)
    return len(names)


def workdir(state: StateDir, project: str, cwd: str | None) -> Path:
    """Where the share runs: `cwd` for a --no-sync job, else the project's working directory."""
    return Path(cwd) if cwd else ProjectDir(state, project).work


def preflight(state: StateDir, job_dir: StateDir, python: str, project: str, cwd: str | None) -> dict:
    """This member's environment for a job (meshrun.core.preflight.EnvReport fields), with its clock.

    The code is hashed as it is now: the files of the last shipment in the project's directory, or,
    for a --no-sync job, what the project at `cwd` would ship (its ignore rules applied here).
    """
    t0 = time.monotonic()
    report = host.environment(python)
    if cwd:
        try:
            manifest = archive.hash_files(cwd, archive.select_files(cwd).names)
        except Exception:  # noqa: BLE001 -- a missing or unreadable directory: no code to compare
            manifest = None
    else:
        proj = ProjectDir(state, project)
        manifest = archive.hash_files(proj.work, proj.shipped())
    report.update(
        free_bytes=host.free_bytes(job_dir.path),
        code_hash=codeset.digest(manifest) if manifest is not None else None,
        code_files=manifest,
    )
    # "took" lets the caller tell our work from the network in the round trip (preflight.clock_offset)
    report.update(took=time.monotonic() - t0, time=time.time())
    return report


def pull(root: Path, path: str, max_bytes: int = MAX_PULL_BYTES) -> tuple[bytes, int]:
    """tar.gz of `path` under a job's working directory `root` (links not followed), and its file count."""
    return archive.pack_paths(root, path, max_bytes)
