"""`meshrun metrics`: gather this member's status (and, on a coordinator, its jobs) and render them in
Prometheus' text format (meshrun.core.metrics), to stdout or atomically into a textfile collector's file.
Here, not in meshrun.mesh, because a coordinator's metrics include its jobs."""

from __future__ import annotations

import time
from pathlib import Path

from meshrun import __version__
from meshrun.core import metrics
from meshrun.errors import UsageError
from meshrun.jobs import control
from meshrun.mesh import member
from meshrun.mesh import status as mstatus
from meshrun.system.files import provenance
from meshrun.system.files.statedir import StateDir, atomic_write


def collect(state: StateDir, now: float | None = None) -> str:
    """The member's metrics now: what `meshrun status --json` says without measuring latency (no packet is
    sent), and on a coordinator its jobs as `meshrun jobs --json` lists them."""
    st = mstatus.gather(state, measure=False)
    commit = provenance.describe(provenance.PACKAGE)
    families = metrics.member_families(st, __version__ + (f"+{commit}" if commit else ""))
    rec, _ = member.load(state)
    if rec.get("role") == "coordinator" and not rec.get("removed"):
        jobs = [r.to_dict() for r in control.list_jobs(state)]
        families += metrics.job_families(jobs, time.time() if now is None else now)
    return metrics.exposition(families)


def write_textfile(path: Path, text: str) -> Path:
    """Replace `path` with `text` in one rename (node_exporter's textfile collector reads *.prom files and must
    never see half of one), readable by the collector's user (metrics hold no secret). UsageError naming a path
    that is not a .prom file or whose directory does not exist."""
    path = Path(path)
    if path.suffix != ".prom":
        raise UsageError(f"--textfile {path} does not end in .prom", "node_exporter's textfile collector reads *.prom")
    if not path.parent.is_dir():
        raise UsageError(
            f"--textfile {path}: no directory {path.parent}",
            "give the directory of node_exporter's --collector.textfile.directory",
        )
    return atomic_write(path, text, 0o644)
