"""Pre-flight: do the nodes of a job agree on what collectives need? Pure rules over environment reports.

Each node reports (meshrun.system.machine.host.environment) what the interpreter that will run the job has:
Python and torch versions, torch's build (CUDA/ROCm/CPU), NCCL's version, distributed backends,
GPUs; plus free disk in the job directory, the hash of the code as unpacked there, and its clock.
`compare` turns the reports into findings: BLOCK for what breaks collectives or the job (torch minor
version, NCCL major, a backend missing, code that differs, no disk, a clock beyond the job-control
window), WARN for what only costs speed or surprises (GPU model or count, Python patch, clock skew, files
other than Python source that only the coordinator's copy has, such as a log redirected into it).

A job declared `--mixed-accelerators` (its collectives run over gloo on CPU tensors, as DiLoCo's outer
sync does) may mix CUDA, ROCm and CPU builds of torch: a differing build only warns, and every node
must have gloo instead. The torch minor version must still match: gloo's wire format is torch's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from meshrun.core import codeset, termtext

BLOCK, WARN = "block", "warn"
DISK_BLOCK = 100 << 20  # less free space than this in the job directory: the job cannot even unpack
DISK_WARN = 1 << 30
CLOCK_WARN_S = 5.0
CLOCK_BLOCK_S = 240.0  # job-control MACs are refused past 300 s of skew (meshrun.core.auth)
CODE_SUFFIXES = (".py",)  # a node lacking one of these blocks; lacking any other file only warns


@dataclass
class EnvReport:
    """One node's environment, as the interpreter that will run the job sees it."""

    node: str
    python: str = ""  # the interpreter's path
    python_version: str = ""  # "3.11.7"
    torch: str | None = None  # torch.__version__ ("2.13.0+cpu"), None: not importable
    cuda: str | None = None  # torch.version.cuda
    hip: str | None = None  # torch.version.hip
    nccl: str | None = None  # "2.21.5" when the build has NCCL
    gloo: bool = False
    gpus: int = 0
    gpu_names: list[str] = field(default_factory=list)
    free_bytes: int | None = None  # in the job directory
    code_hash: str | None = None  # digest of the code as shipped there (or of --no-sync's directory)
    code_files: dict[str, str] | None = None  # {file: sha256} behind code_hash, to name the files that differ
    clock_offset_s: float | None = None  # node clock minus coordinator clock
    error: str = ""  # the probe itself failed

    @classmethod
    def from_dict(cls, node: str, d: dict) -> EnvReport:
        known = set(cls.__dataclass_fields__) - {"node"}
        return cls(node=node, **{k: v for k, v in d.items() if k in known})

    @property
    def build(self) -> str:
        return f"CUDA {self.cuda}" if self.cuda else f"ROCm {self.hip}" if self.hip else "CPU"


@dataclass(frozen=True)
class Finding:
    level: str  # BLOCK | WARN
    nodes: tuple[str, ...]
    what: str
    fix: str


def _minor(version: str | None) -> str | None:
    return ".".join(version.split("+")[0].split(".")[:2]) if version else None


def _major(version: str | None) -> str | None:
    return version.split(".")[0] if version else None


def _odd_ones(reports: list[EnvReport], key) -> tuple[object, list[EnvReport]]:
    """The value most nodes share (ties: the first node's), and the reports that differ from it."""
    values = [key(r) for r in reports]
    counts = Counter(values)
    top = max(counts.values())
    usual = next(v for v in values if counts[v] == top)
    return usual, [r for r in reports if key(r) != usual]


def _only_data_missing(reference: dict[str, str], other: dict[str, str]) -> bool:
    """Does `other` differ from `reference` only by lacking files that are not Python source?

    With --no-sync the reference is the coordinator's live directory, which holds what the operator wrote
    there and no node has: `meshrun train --no-sync train.py > train.log` would refuse every node.
    Code that differs, or is missing, or extra files on the node still block.
    """
    if set(other) - set(reference) or any(reference[n] != h for n, h in other.items() if n in reference):
        return False
    return all(not n.endswith(CODE_SUFFIXES) for n in set(reference) - set(other))


def compare(
    reports: list[EnvReport],
    code_hash: str | None = None,
    nproc_auto: bool = True,
    reference_files: dict[str, str] | None = None,
    mixed_accelerators: bool = False,
) -> list[Finding]:
    """Findings for a job's nodes: BLOCK ones stop the job, WARN ones are shown.

    `code_hash` is the digest of the coordinator's code (what was shipped, or its own copy of a
    --no-sync directory) and `reference_files` the manifest behind it; None: the nodes are compared
    among themselves (the copy most of them hold is the reference). `mixed_accelerators`: the job
    declared that its collectives run over gloo on CPU tensors, so CUDA, ROCm and CPU builds may mix.
    """
    out: list[Finding] = []
    for r in reports:
        if r.error:
            out.append(
                Finding(
                    BLOCK,
                    (r.node,),
                    f"the pre-flight probe failed with {r.python or 'python'}: {r.error}",
                    "check that the interpreter runs on that node, or pass --python",
                )
            )
    reports = [r for r in reports if not r.error]
    missing = [r for r in reports if r.torch is None]
    for r in missing:
        out.append(
            Finding(
                BLOCK,
                (r.node,),
                f"torch is not installed for {r.python}",
                "install the same torch as on the other nodes into that environment, or pass --python",
            )
        )
    have = [r for r in reports if r.torch is not None]
    if have:
        usual, odd = _odd_ones(have, lambda r: _minor(r.torch))
        for r in odd:
            out.append(
                Finding(
                    BLOCK,
                    (r.node,),
                    f"torch {r.torch} where the others have torch {usual}.x",
                    f"install torch {usual} on {r.node} (collectives need matching torch versions)",
                )
            )
        usual, odd = _odd_ones(have, lambda r: r.build.split(" ")[0])
        for r in odd:
            if mixed_accelerators:
                out.append(
                    Finding(
                        WARN,
                        (r.node,),
                        f"a {r.build} build of torch where the others have {usual}: allowed, the job "
                        "declared --mixed-accelerators",
                        "every collective of the job must run over gloo on CPU tensors "
                        "(meshrun.train.diloco.default_backend(); DiLoCo syncs through CPU memory)",
                    )
                )
            else:
                out.append(
                    Finding(
                        BLOCK,
                        (r.node,),
                        f"a {r.build} build of torch where the others have {usual}",
                        "use the same torch build everywhere (one backend: nccl on GPUs, gloo on CPUs), or, for "
                        "a DiLoCo job whose syncs run over gloo, declare it with --mixed-accelerators",
                    )
                )
        nccl = [r for r in have if r.cuda]
        if nccl:
            usual, odd = _odd_ones(nccl, lambda r: _major(r.nccl))
            for r in odd:
                out.append(
                    Finding(
                        BLOCK,
                        (r.node,),
                        f"NCCL {r.nccl} where the others have NCCL {usual}.x",
                        "install the same torch build (it bundles NCCL) on every node",
                    )
                )
        for r in have:
            if not r.gloo and (mixed_accelerators or not r.cuda):
                out.append(
                    Finding(
                        BLOCK,
                        (r.node,),
                        "torch has no gloo backend" + ("" if mixed_accelerators else " and no CUDA"),
                        "install a torch build with distributed support"
                        + (
                            " (a --mixed-accelerators job runs its collectives over gloo)" if mixed_accelerators else ""
                        ),
                    )
                )
        for r in have:
            if r.cuda and r.gpus == 0:
                out.append(
                    Finding(
                        WARN,
                        (r.node,),
                        "a CUDA build of torch but no GPU visible",
                        "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
                    )
                )
        usual, odd = _odd_ones(have, lambda r: r.python_version)
        for r in odd:
            out.append(
                Finding(
                    WARN,
                    (r.node,),
                    f"Python {r.python_version} where the others run {usual}",
                    "use the same Python everywhere (object collectives pickle across nodes)",
                )
            )
        gpu_nodes = [r for r in have if r.gpus]
        if len({tuple(sorted(set(r.gpu_names))) for r in gpu_nodes}) > 1:
            out.append(
                Finding(
                    WARN,
                    tuple(r.node for r in gpu_nodes),
                    "GPU models differ: "
                    + "; ".join(f"{r.node}: {', '.join(sorted(set(r.gpu_names)))}" for r in gpu_nodes),
                    "the slowest GPU sets the pace of every step",
                )
            )
        if nproc_auto and len({r.gpus for r in have}) > 1:
            out.append(
                Finding(
                    WARN,
                    tuple(r.node for r in have),
                    "GPU counts differ ("
                    + ", ".join(f"{r.node}: {r.gpus}" for r in have)
                    + "): nodes run different numbers of workers",
                    "pass --nproc-per-node to run the same number everywhere",
                )
            )
    hashed = [r for r in reports if r.code_hash is not None]
    whose = "the coordinator's"
    if code_hash is None and hashed:  # no reference copy on the coordinator: the nodes must agree
        code_hash, _ = _odd_ones(hashed, lambda r: r.code_hash)
        reference_files = next((r.code_files for r in hashed if r.code_hash == code_hash), None)
        whose = "most nodes'"
    for r in reports:
        if r.free_bytes is not None and r.free_bytes < DISK_BLOCK:
            out.append(
                Finding(
                    BLOCK,
                    (r.node,),
                    f"{r.free_bytes >> 20} MiB free in the job directory",
                    f"free disk space on {r.node} (meshrun keeps jobs under its state directory)",
                )
            )
        elif r.free_bytes is not None and r.free_bytes < DISK_WARN:
            out.append(
                Finding(
                    WARN,
                    (r.node,),
                    f"only {r.free_bytes >> 20} MiB free in the job directory",
                    "checkpoints and logs may not fit",
                )
            )
        if code_hash is not None and r.code_hash is not None and r.code_hash != code_hash:
            known = reference_files is not None and r.code_files is not None
            diffs = codeset.differences(reference_files, r.code_files) if known else []
            if known and _only_data_missing(reference_files, r.code_files):
                out.append(
                    Finding(
                        WARN,
                        (r.node,),
                        f"its copy lacks files {whose} has: {codeset.describe_differences(diffs)}",
                        "nothing to do if the job does not read them (a log written into the directory); "
                        "else copy them there, or drop --no-sync",
                    )
                )
            else:
                out.append(
                    Finding(
                        BLOCK,
                        (r.node,),
                        f"its copy of the code differs from {whose}"
                        + (f": {codeset.describe_differences(diffs)}" if diffs else ""),
                        "drop --no-sync so meshrun ships the code, or copy the same code there",
                    )
                )
        if r.clock_offset_s is not None and abs(r.clock_offset_s) >= CLOCK_WARN_S:
            level = BLOCK if abs(r.clock_offset_s) >= CLOCK_BLOCK_S else WARN
            out.append(
                Finding(
                    level,
                    (r.node,),
                    f"its clock is {r.clock_offset_s:+.1f} s off the coordinator's",
                    "synchronise the clocks (NTP/chrony)",
                )
            )
    return out


def clock_offset(sent: float, received: float, remote_time: float, remote_took: float = 0.0) -> float:
    """The remote clock minus ours, from one request: sent and received on our clock, the remote's
    clock when it answered, and how long it worked on the request before answering.

    The network's share of the round trip, (received - sent) - remote_took, is taken as symmetric,
    so the error is at most half of it, however long the remote worked (a first pre-flight report
    may import torch for many seconds).
    """
    network = max(0.0, (received - sent) - remote_took)
    return remote_time - (received - network / 2)


def blocking(findings: list[Finding]) -> bool:
    return any(f.level == BLOCK for f in findings)


def table(reports: list[EnvReport], findings: list[Finding]) -> list[str]:
    """The environments side by side, then every finding with its fix (what `meshrun train` prints)."""
    cols = ["NODE", "PYTHON", "TORCH", "BUILD", "NCCL", "GPUS", "FREE", "CODE", "CLOCK"]
    rows = [
        [
            r.node,
            r.python_version or "?",
            r.torch or "missing",
            r.build,
            r.nccl or "-",
            f"{r.gpus}" + (f" {r.gpu_names[0]}" if r.gpu_names else ""),
            "?" if r.free_bytes is None else f"{r.free_bytes >> 20} MiB",
            (r.code_hash or "-")[:10],
            "?" if r.clock_offset_s is None else f"{r.clock_offset_s:+.1f}s",
        ]
        for r in reports
    ]
    # What nodes reported is theirs to write: cells are cleaned before they are measured, so that the
    # columns line up and no escape sequence reaches the operator's terminal.
    rows = [[termtext.clean(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [cols] + rows]
    for f in sorted(findings, key=lambda f: (f.level != BLOCK, f.nodes)):
        lines.append(
            termtext.clean(f"{'BLOCK' if f.level == BLOCK else 'warn '} {', '.join(f.nodes)}: {f.what}; {f.fix}")
        )
    return lines
