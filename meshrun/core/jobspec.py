"""Jobs as data: what the user asked for (`JobSpec`), where a job stands (`JobState`, `JobRecord`) and how
one node's share ended (`ShareEnd`). Pure; the rules that turn shares' ends into a verdict are
meshrun.core.outcome's.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from meshrun.core import presets
from meshrun.core.codeset import PROJECT_RE
from meshrun.core.launch import DEFAULT_WORKERS, WORKER_KINDS, TrainOptions, parse_nnodes
from meshrun.core.model import Network
from meshrun.errors import UsageError

JOB_ID_RE = re.compile(r"^(?!\.{1,2}\Z)[A-Za-z0-9_.-]{1,64}\Z")  # names a directory: never "." or ".."


class JobState(str, Enum):
    """Where a job stands, as job.json records it.

    STARTING (the supervisor waits for the nodes, ships the code, runs the pre-flight) goes to RUNNING once
    every planned share started, or straight to FAILED (could not start) or CANCELLED. RUNNING ends in
    SUCCEEDED, FAILED or CANCELLED, decided by meshrun.core.outcome.Outcome. LOST is never written: a
    reader reports it for a job whose record is not final while its supervisor is gone (the coordinator
    machine rebooted). The last four are final.
    """

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"

    @property
    def final(self) -> bool:
        return self not in (JobState.STARTING, JobState.RUNNING)

    def __str__(self) -> str:
        return self.value


FINAL = tuple(st.value for st in JobState if st.final)
EXIT_LOST = 255  # a node (or the coordinator's supervisor) vanished: no process exit code exists
EXIT_CANCELLED = 130  # as a shell reports Ctrl-C


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
    nodes: list[str] | None = None  # only these node names
    wait_timeout: float = 120.0
    no_sync: bool = False
    cwd: str = ""  # the submitter's directory: shipped, or used as is (no_sync)
    sync_limit_mb: int = 50
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None  # interpreter on the nodes [each agent's]
    module: bool = False
    rdzv_timeout: int = 900
    with_coordinator: bool = False  # the coordinator takes a share too
    skip_preflight: bool = False  # start even if the nodes' environments disagree
    site_fabric: bool = False  # NCCL may use InfiniBand/RoCE inside a site (meshrun.core.launch.worker_env)
    # Where the job runs on each member: <state>/projects/<project>/work, kept between jobs, so the
    # next job of the same project finds what this one wrote (checkpoints). [the code directory's name]
    project: str = ""
    # DiLoCo preset asked for (meshrun.core.presets.CHOICES), None: none; `preset` is what it came to
    # (presets.Choice as a dict, decided when the job is submitted: `auto` reads the latest `meshrun bench`).
    compression: str | None = None
    model_size: int | None = None  # parameters, for compression = "auto"
    step_time: float | None = None  # seconds per inner step, for compression = "auto"
    preset: dict | None = None
    # CUDA, ROCm and CPU workers in one job whose collectives run over gloo on CPU tensors (DiLoCo):
    # the pre-flight then only warns when torch builds differ.
    mixed_accelerators: bool = False
    # The run it continues (`meshrun train --resume JOB`: JOB's run, the first job's id); "": a fresh run, its own.
    run_id: str = ""
    workers: str = DEFAULT_WORKERS  # how each worker starts: warm or cold (meshrun.core.launch.WORKER_KINDS)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> JobSpec:
        if not isinstance(d, dict):
            raise ValueError("job spec must be an object")
        known = set(cls.__dataclass_fields__)
        spec = cls(**{k: v for k, v in d.items() if k in known})
        check_job_id(spec.job_id)
        if spec.run_id:
            check_job_id(spec.run_id)
        if not isinstance(spec.script, str) or not spec.script:
            raise ValueError("script is missing")
        if spec.nnodes is not None:
            parse_nnodes(spec.nnodes)
        if spec.project and not PROJECT_RE.match(spec.project):
            raise ValueError(f"project {spec.project!r} is not a valid project name")
        if spec.workers not in WORKER_KINDS:
            raise ValueError(f"workers {spec.workers!r} is not one of {', '.join(WORKER_KINDS)}")
        if spec.compression is not None and spec.compression not in presets.CHOICES:
            raise ValueError(f"compression {spec.compression!r} is not one of {', '.join(presets.CHOICES)}")
        if spec.preset is not None:
            presets.Preset.from_dict(spec.preset["preset"])  # raises KeyError/TypeError/ValueError if malformed
        return spec

    @property
    def preset_env(self) -> dict[str, str]:
        """The DiLoCo preset's variables for the workers (empty without a preset)."""
        if not self.preset or not self.preset.get("preset"):
            return {}
        return presets.Preset.from_dict(self.preset["preset"]).env()

    def launch_options(
        self, network: Network, store_port: int, shipped: bool, coordinators: tuple[str, ...] = ()
    ) -> TrainOptions:
        """The torchrun options of this job on `network`, its rendezvous store at `store_port` (the one place
        a spec becomes launch options). `shipped`: the script's directory is the job's working directory,
        so the script is named by its file name. `coordinators` ("IP:PORT" each): several coordinators keep
        the rendezvous instead of a store."""
        script = Path(self.script).name if shipped and not self.module else self.script
        return TrainOptions(
            script=script,
            script_args=tuple(self.script_args),
            nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            max_restarts=self.max_restarts,
            job_id=self.job_id,
            rdzv_host=network.coordinator_ip,
            rdzv_port=store_port,
            interface=network.interface,
            python=self.python or "python3",
            rdzv_timeout=self.rdzv_timeout,
            module=self.module,
            site_fabric=self.site_fabric,
            job_env=tuple(sorted(self.preset_env.items())),
            mixed_accelerators=self.mixed_accelerators,
            rdzv_coordinators=tuple(coordinators),
            run_id=self.run_id or self.job_id,
            workers=self.workers,
        )

    def bounds(self, available: int) -> tuple[int, int]:
        """(MIN, MAX) nodes: from --nnodes, else every available node."""
        return parse_nnodes(self.nnodes) if self.nnodes else (available, available)

    @property
    def elastic(self) -> bool:
        return bool(self.nnodes) and parse_nnodes(self.nnodes)[0] != parse_nnodes(self.nnodes)[1]


@dataclass
class ShareEnd:
    """How one node's share ended (its status.json, written by the share process on the node)."""

    code: int | None  # torchrun's exit code (None: killed by a signal)
    signal: str | None = None  # torchrun itself killed by a signal
    failures: list[dict] = field(default_factory=list)  # worker exit records with a non-zero code
    error: str = ""  # torchrun's first error line
    cancelled: bool = False
    ended: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> ShareEnd:
        return cls(
            code=d.get("code"),
            signal=d.get("signal"),
            failures=list(d.get("failures") or []),
            error=str(d.get("error") or ""),
            cancelled=bool(d.get("cancelled")),
            ended=float(d.get("ended") or 0.0),
        )

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.cancelled


@dataclass
class JobRecord:
    """A job as `meshrun jobs` lists it (job.json on the coordinator, written by its supervisor)."""

    job_id: str
    state: JobState = JobState.STARTING
    nodes: list[str] = field(default_factory=list)
    ranks: int = 0
    created: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    message: str = ""
    workers: str = ""  # how its workers started: warm or cold (JobSpec.workers); "" in a record from before
    # As its supervisor follows it: how far rank 0 is (meshrun.core.progress.Progress.record: {} before its
    # first step), which node has rank 0, when the newest line arrived (unix s), how often the group re-formed.
    progress: dict = field(default_factory=dict)
    rank0: str = ""
    last_output: float | None = None
    regroups: int = 0

    def __post_init__(self) -> None:
        self.state = JobState(self.state)

    def to_dict(self) -> dict:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_dict(cls, d: dict) -> JobRecord:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def final(self) -> bool:
        return self.state.final

    def duration(self, now: float) -> float:
        return ((self.ended or now) - self.started) if self.started else 0.0
