"""A job's outcome: from what the supervisor observes of each share to "stop now?" and the verdict. Pure.

The supervisor on the coordinator (meshrun.jobs.supervisor) feeds `Outcome` with each share's end
(meshrun.core.jobspec.ShareEnd) and the nodes it lost, and asks it two questions: should the job stop
now (`stop_reason`), and how did it end (`verdict`: a JobState, an exit code and one line naming the
first real cause: a rank's exit code, a rank killed by a signal, a torchrun failure with its first
error line, or a lost node).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from meshrun.core.jobspec import EXIT_CANCELLED, EXIT_LOST, JobState, ShareEnd

__all__ = ["Outcome"]


@dataclass
class Outcome:
    """What the supervisor knows about every share of a job, and the decisions taken from it."""

    elastic: bool
    min_nodes: int
    shares: dict[str, ShareEnd | None] = field(default_factory=dict)  # node -> its end (None: running)
    lost: dict[str, float] = field(default_factory=dict)  # node -> when it was declared lost
    cancelled: bool = False
    below_min: str = ""

    def running(self) -> list[str]:
        return [n for n, end in self.shares.items() if end is None and n not in self.lost]

    def stop_reason(self) -> str:
        """Why the whole job must stop now ("" to carry on).

        A fixed-size job stops at its first failed share or lost node (torchrun on the others would
        otherwise wait for the dead node in its rendezvous or exit barrier); an elastic job stops when
        fewer than MIN shares can still run.
        """
        if self.cancelled:
            return "cancelled"
        if self.elastic:
            alive = len(self.running()) + sum(1 for e in self.shares.values() if e is not None and e.ok)
            if alive < self.min_nodes and (self.lost or any(e is not None and not e.ok for e in self.shares.values())):
                self.below_min = f"{alive} of {self.min_nodes} nodes left"
                return self.below_min
            return ""
        if self.lost:
            return f"lost {', '.join(sorted(self.lost))}"
        failed = [n for n, e in self.shares.items() if e is not None and not e.ok]
        return f"the share on {failed[0]} failed" if failed else ""

    def verdict(self, job_id: str) -> tuple[JobState, int, str]:
        """(state, exit code, one-line message) once every share has ended or is lost."""
        ok = [n for n, e in self.shares.items() if e is not None and e.ok]
        failures = [f for e in self.shares.values() if e is not None for f in e.failures]
        if self.cancelled:
            return JobState.CANCELLED, EXIT_CANCELLED, f"job {job_id} cancelled"
        if self.below_min:
            return JobState.FAILED, 1, f"job {job_id} stopped: {self.below_min} ({_lost_words(self.lost)})"
        if len(ok) == len(self.shares) or (self.elastic and len(ok) >= self.min_nodes and not self.running()):
            notes = []
            if self.lost:
                notes.append(f"lost {', '.join(sorted(self.lost))} mid-job; torch elastic continued without it")
            if failures:
                notes.append(f"{len(failures)} worker exit(s) recovered by restarts")
            return (
                JobState.SUCCEEDED,
                0,
                f"job {job_id} finished on {len(ok)} node(s)" + (f" ({'; '.join(notes)})" if notes else ""),
            )
        if self.lost and not self.elastic:
            # The others' failures are the consequence: their collectives broke when it vanished.
            return JobState.FAILED, EXIT_LOST, f"job {job_id} failed: {_lost_words(self.lost)}"
        if failures:
            return JobState.FAILED, *_rank_failure(job_id, min(failures, key=lambda f: f.get("time", 0)))
        bad = [(n, e) for n, e in self.shares.items() if e is not None and not e.ok]
        if bad:
            return JobState.FAILED, *_launcher_failure(job_id, *bad[0])
        return (
            JobState.FAILED,
            1,
            f"job {job_id} failed: {len(ok)} node(s) finished, fewer than the {self.min_nodes} needed",
        )


def _lost_words(lost: dict[str, float]) -> str:
    names = ", ".join(sorted(lost))
    return (
        f"lost node {names} (its agent stopped answering)"
        if len(lost) == 1
        else f"lost nodes {names} (their agents stopped answering)"
        if lost
        else "no node lost"
    )


def _rank_failure(job_id: str, f: dict) -> tuple[int, str]:
    where = f"rank {f.get('rank')} on {f.get('node')}"
    sig = f.get("signal")
    if sig:
        num = getattr(signal, str(sig), None)
        code = 128 + int(num) if num is not None else 1
        return code, f"job {job_id} failed: {where} was killed by {sig} (first failure)"
    code = int(f.get("exit_code") or 1)
    code = code if 0 < code < 256 else 1
    return code, f"job {job_id} failed: {where} exited with code {code} (first failure)"


def _launcher_failure(job_id: str, node: str, end: ShareEnd) -> tuple[int, str]:
    if end.signal:
        num = getattr(signal, end.signal, None)
        return (
            128 + int(num) if num is not None else 1,
            f"job {job_id} failed: torchrun on {node} was killed by {end.signal}",
        )
    code = end.code if end.code is not None and 0 < end.code < 256 else 1
    detail = f": {end.error}" if end.error else ""
    return code, f"job {job_id} failed: torchrun on {node} exited with code {code}{detail}"
