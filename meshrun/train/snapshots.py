"""A data-parallel worker's state outside its sync loop: digests that every worker holds the same state,
snapshot files, and who resumes from whom after a restart.

DiLoCo (meshrun.train.diloco) writes a node-local snapshot after every sync and checks a digest of the synced
global state over the group; DeMo (meshrun.train.demo) checks its parameters' digest. Kept apart from the
sync loops because they change for other reasons: a snapshot's format and checks, and the rule for which
worker's state a re-formed group adopts, are about recovery, not about how a pseudo-gradient travels.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrun.core.jobspec import JOB_ID_RE
from meshrun.errors import StateError, UsageError
from meshrun.system.files import tensorfiles
from meshrun.system.files.statedir import make_dir

SNAPSHOT_FORMAT = "meshrun.train.diloco.snapshot/1"
FRESH = -1  # the sync count a worker without a snapshot reports


def auto_snapshot_dir() -> Path | None:
    """Where a worker meshrun started keeps its DiLoCo snapshot: the run's directory in the project's
    (``$MESHRUN_OUTPUT_DIR/diloco-snapshots/$MESHRUN_RUN_ID``, created), so restarts and resumes of the run find
    it and a new job does not; None outside meshrun (either variable unset, or the project directory missing).
    A run id without $MESHRUN_RUN_ID's form (meshrun sets a job id: letters, digits, ``_ . -``) is a UsageError."""
    out, run = os.environ.get("MESHRUN_OUTPUT_DIR"), os.environ.get("MESHRUN_RUN_ID")
    if not out or not run or not Path(out).is_dir():
        return None
    if not JOB_ID_RE.match(run):
        raise UsageError(f"MESHRUN_RUN_ID={run!r} is not a job id", "leave MESHRUN_RUN_ID to meshrun (unset it)")
    path = Path(out) / "diloco-snapshots" / run
    make_dir(path)
    return path


def state_digest(tensors: list[torch.Tensor]) -> int:
    """64-bit BLAKE2b of the tensors' raw bytes, in order, as a signed int (fits an int64 tensor)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy())
    return int.from_bytes(h.digest(), "little", signed=True)


def check_digests(digests: list[int], sync: int) -> None:
    """Raise ``StateError`` naming the ranks whose digest (one per rank, gathered after sync `sync`) differs from
    the majority's (a tie goes to the digest the lowest rank holds)."""
    majority = max(digests, key=lambda d: (digests.count(d), -digests.index(d)))
    odd = [r for r, d in enumerate(digests) if d != majority]
    if odd:
        agree = [r for r, d in enumerate(digests) if d == majority]
        raise StateError(
            f"the DiLoCo global state differs between workers after sync {sync}: "
            f"rank(s) {odd} disagree with rank(s) {agree}",
            "a worker diverged (faulty hardware, a non-deterministic outer step, or state "
            "changed by hand); restart the job: workers resume from the newest snapshot",
        )


def write_snapshot(
    path: Path,
    names: list[str],
    step_count: int,
    sync_count: int,
    bytes_sent_total: int,
    shared: list[torch.Tensor],
    inner_optimizer: dict[str, Any],
    error_feedback: list[torch.Tensor] | None,
) -> None:
    """This worker's snapshot at `path` (atomic): `shared` is what every worker holds alike (global copy, outer
    momentum, buffers, in the optimizer's fixed layout), the rest is this worker's own."""
    tensorfiles.save(
        path,
        {
            "format": SNAPSHOT_FORMAT,
            "names": names,
            "step_count": step_count,
            "sync_count": sync_count,
            "bytes_sent_total": bytes_sent_total,
            "shared": shared,
            "inner_optimizer": inner_optimizer,
            "error_feedback": error_feedback,
        },
    )


def read_snapshot(
    path: Path | None, names: list[str], layout: list[torch.Tensor], device: torch.device
) -> dict[str, Any] | None:
    """The snapshot at `path`, checked against this model (its parameter `names` and the shapes and dtypes of
    its shared `layout`); None when there is none. StateError naming the file and the fix otherwise."""
    if path is None or not path.exists():
        return None
    try:
        snap = tensorfiles.load(path, map_location=device)
    except StateError as exc:
        raise StateError(
            f"cannot read the DiLoCo snapshot: {exc.message}",
            f"delete {path} to make this worker start as a joiner",
        ) from None
    shared = snap.get("shared") if isinstance(snap, dict) else None
    if (
        not isinstance(snap, dict)
        or snap.get("format") != SNAPSHOT_FORMAT
        or snap.get("names") != names
        or not isinstance(shared, list)
        or len(shared) != len(layout)
        or any(s.shape != t.shape or s.dtype != t.dtype for s, t in zip(shared, layout))
    ):
        raise StateError(
            f"the DiLoCo snapshot {path} is not for this model and outer optimizer",
            f"a new job starts fresh (`meshrun train` without --resume); resume only a job of this model, "
            f"or delete {path}",
        )
    return snap


@dataclass(frozen=True)
class Resume:
    """Which state a (re-)formed group adopts: rank `source`'s snapshot of sync `sync_count` (after
    `step_count` inner steps), sent to every rank in `receivers`."""

    sync_count: int
    step_count: int
    source: int
    receivers: list[int]


def plan_start(table: list[list[int]]) -> Resume | bool:
    """From every rank's [sync count (FRESH without a snapshot), step count, digest], in rank order: the Resume
    when any rank has a snapshot, else whether the fresh models differ (then rank 0's is broadcast).

    The lowest rank holding the newest snapshot is the source; every rank whose snapshot is older, or of that
    sync with another digest, or absent, receives it."""
    newest = max(row[0] for row in table)
    if newest == FRESH:
        return len({row[2] for row in table}) > 1
    src = next(r for r, row in enumerate(table) if row[0] == newest)
    receivers = [r for r, row in enumerate(table) if (row[0], row[2]) != (newest, table[src][2])]
    return Resume(newest, table[src][1], src, receivers)
