"""Jobs as data: what the user asked for, each node's share as it ended, and what the job's outcome is.

Pure. The supervisor on the coordinator (meshrun.jobs.supervisor) feeds `Outcome` with what it
observes and asks it two questions: should the job stop now (`stop_reason`), and how did it end
(`verdict`: an exit code and one line naming the first real cause: a rank's exit code, a rank
killed by a signal, a torchrun failure with its first error line, or a lost node).
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import asdict, dataclass, field

from meshrun.core.codeset import PROJECT_RE
from meshrun.core.launch import parse_nnodes
from meshrun.errors import UsageError

JOB_ID_RE = re.compile(r"^(?!\.{1,2}\Z)[A-Za-z0-9_.-]{1,64}\Z")   # names a directory: never "." or ".."
FINAL = ("succeeded", "failed", "cancelled", "lost")
EXIT_LOST = 255           # a node (or the coordinator's supervisor) vanished: no process exit code exists
EXIT_CANCELLED = 130      # as a shell reports Ctrl-C


def check_job_id(job_id: str) -> str:
    if not JOB_ID_RE.match(job_id or ""):
        raise UsageError(f"job id {job_id!r} is not 1-64 characters of A-Z a-z 0-9 _ . -", "e.g. --job-id exp7")
    return job_id


@dataclass
class JobSpec:
    """What `meshrun train` was asked to run; kept in the job's directory on the coordinator."""

    job_id: str
    script: str
    script_args: list[str] = field(default_factory=list)
    nnodes: str | None = None
    nproc_per_node: int | None = None
    max_restarts: int = 0
    nodes: list[str] | None = None             # only these node names
    wait_timeout: float = 120.0
    no_sync: bool = False
    cwd: str = ""                              # the submitter's directory: shipped, or used as is (no_sync)
    sync_limit_mb: int = 50
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None                  # interpreter on the nodes [each agent's]
    module: bool = False
    rdzv_timeout: int = 900
    with_coordinator: bool = False             # the coordinator takes a share too
    skip_preflight: bool = False               # start even if the nodes' environments disagree
    # Where the job runs on each member: <state>/projects/<project>/work, kept between jobs, so the
    # next job of the same project finds what this one wrote (checkpoints). [the code directory's name]
    project: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobSpec":
        if not isinstance(d, dict):
            raise ValueError("job spec must be an object")
        known = set(cls.__dataclass_fields__)
        spec = cls(**{k: v for k, v in d.items() if k in known})
        check_job_id(spec.job_id)
        if not isinstance(spec.script, str) or not spec.script:
            raise ValueError("script is missing")
        if spec.nnodes is not None:
            parse_nnodes(spec.nnodes)
        if spec.project and not PROJECT_RE.match(spec.project):
            raise ValueError(f"project {spec.project!r} is not a valid project name")
        return spec

    def bounds(self, available: int) -> tuple[int, int]:
        """(MIN, MAX) nodes: from --nnodes, else every available node."""
        return parse_nnodes(self.nnodes) if self.nnodes else (available, available)

    @property
    def elastic(self) -> bool:
        return bool(self.nnodes) and parse_nnodes(self.nnodes)[0] != parse_nnodes(self.nnodes)[1]


@dataclass
class ShareEnd:
    """How one node's share ended (its status.json, written by the share process on the node)."""

    code: int | None                 # torchrun's exit code (None: killed by a signal)
    signal: str | None = None        # torchrun itself killed by a signal
    failures: list[dict] = field(default_factory=list)   # worker exit records with a non-zero code
    error: str = ""                  # torchrun's first error line
    cancelled: bool = False
    ended: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "ShareEnd":
        return cls(code=d.get("code"), signal=d.get("signal"), failures=list(d.get("failures") or []),
                   error=str(d.get("error") or ""), cancelled=bool(d.get("cancelled")),
                   ended=float(d.get("ended") or 0.0))

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.cancelled


@dataclass
class Outcome:
    """What the supervisor knows about every share of a job, and the decisions taken from it."""

    elastic: bool
    min_nodes: int
    shares: dict[str, ShareEnd | None] = field(default_factory=dict)     # node -> its end (None: running)
    lost: dict[str, float] = field(default_factory=dict)                 # node -> when it was declared lost
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

    def verdict(self, job_id: str) -> tuple[str, int, str]:
        """(state, exit code, one-line message) once every share has ended or is lost."""
        ok = [n for n, e in self.shares.items() if e is not None and e.ok]
        failures = [f for e in self.shares.values() if e is not None for f in e.failures]
        if self.cancelled:
            return "cancelled", EXIT_CANCELLED, f"job {job_id} cancelled"
        if self.below_min:
            return "failed", 1, f"job {job_id} stopped: {self.below_min} ({_lost_words(self.lost)})"
        if len(ok) == len(self.shares) or (self.elastic and len(ok) >= self.min_nodes and not self.running()):
            notes = []
            if self.lost:
                notes.append(f"lost {', '.join(sorted(self.lost))} mid-job; torch elastic continued without it")
            if failures:
                notes.append(f"{len(failures)} worker exit(s) recovered by restarts")
            return "succeeded", 0, f"job {job_id} finished on {len(ok)} node(s)" + (f" ({'; '.join(notes)})"
                                                                                     if notes else "")
        if self.lost and not self.elastic:
            # The others' failures are the consequence: their collectives broke when it vanished.
            return "failed", EXIT_LOST, f"job {job_id} failed: {_lost_words(self.lost)}"
        if failures:
            return "failed", *_rank_failure(job_id, min(failures, key=lambda f: f.get("time", 0)))
        bad = [(n, e) for n, e in self.shares.items() if e is not None and not e.ok]
        if bad:
            return "failed", *_launcher_failure(job_id, *bad[0])
        return "failed", 1, f"job {job_id} failed: {len(ok)} node(s) finished, fewer than the {self.min_nodes} needed"


def _lost_words(lost: dict[str, float]) -> str:
    names = ", ".join(sorted(lost))
    return f"lost node {names} (its agent stopped answering)" if len(lost) == 1 else \
        f"lost nodes {names} (their agents stopped answering)" if lost else "no node lost"


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
        return (128 + int(num) if num is not None else 1,
                f"job {job_id} failed: torchrun on {node} was killed by {end.signal}")
    code = end.code if end.code is not None and 0 < end.code < 256 else 1
    detail = f": {end.error}" if end.error else ""
    return code, f"job {job_id} failed: torchrun on {node} exited with code {code}{detail}"


@dataclass
class JobRecord:
    """A job as `meshrun jobs` lists it (job.json on the coordinator, written by its supervisor)."""

    job_id: str
    state: str = "starting"           # starting | running | succeeded | failed | cancelled | lost
    nodes: list[str] = field(default_factory=list)
    ranks: int = 0
    created: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    message: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobRecord":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def duration(self, now: float) -> float:
        return ((self.ended or now) - self.started) if self.started else 0.0


# --------------------------------------------------------------------------- log lines

LINE_RE = re.compile(r"^\[(?P<node>[a-z0-9][a-z0-9-]{0,31})(?: r(?P<rank>\d+))?\] ")
# torch's TCPStore logs this for every client whose address has no reverse DNS (overlay addresses
# never do): one line per node and rank, nothing anyone can act on. Only this exact line is dropped.
REVERSE_DNS_NOISE = re.compile(r"^\[W\d{4} \d\d:\d\d:\d\d\.\d+ socket\.cpp:\d+\] \[c10d\] The hostname of the "
                               r"client socket cannot be retrieved\. err=-?\d+$")


def is_noise(line: str) -> bool:
    """True for an output line (with or without its `[node rR] ` prefix) that is c10d's reverse-DNS warning."""
    return bool(REVERSE_DNS_NOISE.match(LINE_RE.sub("", line, count=1)))


def line_matches(line: str, node: str | None, rank: int | None) -> bool:
    """Does a job output line (prefixed `[node rR]` or `[node]`) belong to `node` / `rank`?"""
    if node is None and rank is None:
        return True
    m = LINE_RE.match(line)
    if not m:
        return False
    if node is not None and m.group("node") != node:
        return False
    return rank is None or (m.group("rank") is not None and int(m.group("rank")) == rank)
