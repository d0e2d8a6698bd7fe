"""Compression presets for DiLoCo jobs: what `meshrun train --compression` sets, and what `auto` picks. Pure.

A preset is a DiLoCo configuration (H, fragments, pseudo-gradient format) handed to the job's workers
as environment variables, which ``meshrun.train.diloco.DiLoCo`` reads for every argument the script
leaves at "auto" (the script's explicit arguments win):

    MESHRUN_DILOCO_PRESET        the preset's name (informational)
    MESHRUN_DILOCO_SYNC_EVERY    H, inner steps between two syncs of a fragment
    MESHRUN_DILOCO_FRAGMENTS     Streaming DiLoCo fragments (1: plain DiLoCo)
    MESHRUN_DILOCO_COMPRESSION   the pseudo-gradient format ("none", "bf16", "fp4", "sparse-int2", ...)
    MESHRUN_DILOCO_DENSITY       share of the elements a sparse format sends (the largest of each chunk)
    MESHRUN_DILOCO_OUTER_LR, MESHRUN_DILOCO_OUTER_MOMENTUM, MESHRUN_DILOCO_ERROR_DECAY
                                 the outer step, where the format needs its own (high: SparseLoCo's)

`decide` turns what was asked (auto, none, low, medium, high), the bandwidth `meshrun bench` measured
and the model size into a preset and the reason for it. `auto` takes the least compressed level whose
expected sync time, ``wire bytes per parameter x parameters / bandwidth``, is at most SYNC_FRACTION of
the compute between two syncs, ``H x step time``. The step time is what the user gave, else
ASSUMED_STEP_S. Without a measurement or a model size it says so and takes `medium`.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from meshrun.core.launch import ENV_MIXED  # noqa: F401  (re-exported: meshrun.train.diloco reads it)
from meshrun.errors import UsageError

ENV_PRESET = "MESHRUN_DILOCO_PRESET"
ENV_SYNC_EVERY = "MESHRUN_DILOCO_SYNC_EVERY"
ENV_FRAGMENTS = "MESHRUN_DILOCO_FRAGMENTS"
ENV_COMPRESSION = "MESHRUN_DILOCO_COMPRESSION"
ENV_DENSITY = "MESHRUN_DILOCO_DENSITY"
ENV_OUTER_LR = "MESHRUN_DILOCO_OUTER_LR"
ENV_OUTER_MOMENTUM = "MESHRUN_DILOCO_OUTER_MOMENTUM"
ENV_ERROR_DECAY = "MESHRUN_DILOCO_ERROR_DECAY"

LEVELS = ("none", "low", "medium", "high")  # least to most compressed
CHOICES = ("auto", *LEVELS)
FALLBACK = "medium"  # auto without a measurement or a model size
SYNC_FRACTION = 0.05  # auto: a sync may take at most this share of the compute between two syncs
ASSUMED_STEP_S = 1.0  # auto: seconds per inner step when --step-time is not given (a GPU step of a large batch)

# Payload bytes per element of each format (meshrun.train.compress; a unit test keeps them equal), and
# whether it is averaged by all_reduce (ring: 2(n-1)/n on the wire) or all_gather ((n-1) on the wire).
_PAYLOAD = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.002, "fp8": 1.016, "fp4": 0.516, "int2": 0.266}
_SPARSE_VALUE_BITS = {"sparse-int2": 2, "sparse-fp4": 4}
_REDUCED = ("none", "fp16", "bf16")
# The sparse formats' chunk (meshrun.train.compress imports this; here so the CLI computes bytes without torch).
SPARSE_CHUNK_MIN = 64  # a position inside takes 6 bits
SPARSE_CHUNK_MAX = 1 << 16  # positions up to 16 bits


def sparse_chunk(density: float) -> int:
    """The chunk a sparse format cuts a tensor into at ``density``: the power of two nearest ``1 / density``,
    within SPARSE_CHUNK_MIN..SPARSE_CHUNK_MAX. About one value per chunk is sent, and its position costs
    ``log2(chunk)`` bits."""
    exponent = round(math.log2(1 / density)) if density > 0 else 16
    return min(SPARSE_CHUNK_MAX, max(SPARSE_CHUNK_MIN, 1 << max(0, exponent)))


def chunk_selection(density: float, chunk: int) -> tuple[int, int]:
    """What a top-k chunk sends (the sparse formats, and DeMo's DCT chunks): ``(k, position_bits)``, the
    ``round(density * chunk)`` largest values (at least 1) and the bits that pack one position in the chunk."""
    return min(chunk, max(1, round(density * chunk))), (chunk - 1).bit_length()


@dataclass(frozen=True)
class Preset:
    """One DiLoCo configuration a job's workers get through the environment."""

    name: str
    sync_every: int
    fragments: int
    compression: str
    density: float | None = None  # sparse formats only
    # The outer step, when the format needs its own (None: the script's, else DiLoCo's defaults).
    outer_lr: float | None = None
    outer_momentum: float | None = None
    error_decay: float | None = None

    def payload_per_param(self) -> float:
        """Bytes per parameter this worker contributes to one sync of the whole model."""
        if self.compression in _SPARSE_VALUE_BITS:
            density = self.density or 0.0
            chunk = sparse_chunk(density)
            k, position_bits = chunk_selection(density, chunk)
            # per value sent: its position, its bits, a bf16 scale per 128 values
            return k / chunk * ((position_bits + _SPARSE_VALUE_BITS[self.compression]) / 8 + 2 / 128)
        return _PAYLOAD[self.compression]

    def wire_per_param(self, workers: int) -> float:
        """Bytes per parameter that leave one worker for one sync of the whole model (ring algorithms)."""
        n = max(1, workers)
        if self.compression in _REDUCED:
            return self.payload_per_param() * 2 * (n - 1) / n
        return self.payload_per_param() * (n - 1)

    def env(self) -> dict[str, str]:
        """The workers' environment for this preset."""
        out = {
            ENV_PRESET: self.name,
            ENV_SYNC_EVERY: str(self.sync_every),
            ENV_FRAGMENTS: str(self.fragments),
            ENV_COMPRESSION: self.compression,
        }
        for var, value in (
            (ENV_DENSITY, self.density),
            (ENV_OUTER_LR, self.outer_lr),
            (ENV_OUTER_MOMENTUM, self.outer_momentum),
            (ENV_ERROR_DECAY, self.error_decay),
        ):
            if value is not None:
                out[var] = repr(value)
        return out

    def describe(self) -> str:
        """``DiLoCo H=50, 2 fragments, fp4``."""
        frags = f", {self.fragments} fragments" if self.fragments > 1 else ""
        dens = ""
        if self.density is not None:
            inverse = 1 / self.density
            shown = f"1/{round(inverse)}" if abs(inverse - round(inverse)) < 1e-9 else f"{self.density:.4g}"
            dens = f" (density {shown})"
        outer = []
        if self.outer_lr is not None:
            outer.append(f"outer lr {self.outer_lr:g}")
        if self.outer_momentum is not None:
            outer.append(f"momentum {self.outer_momentum:g}")
        if self.error_decay is not None:
            outer.append(f"error decay {self.error_decay:g}")
        tail = f", {', '.join(outer)}" if outer else ""
        return f"DiLoCo H={self.sync_every}{frags}, {self.compression}{dens}{tail}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "compression": self.compression,
            "density": self.density,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "error_decay": self.error_decay,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Preset:
        return cls(
            str(d["name"]),
            int(d["sync_every"]),
            int(d["fragments"]),
            str(d["compression"]),
            d.get("density"),
            d.get("outer_lr"),
            d.get("outer_momentum"),
            d.get("error_decay"),
        )


PRESETS = {
    # fp32 pseudo-gradients, synced often: closest to DDP's loss.
    "none": Preset("none", 20, 1, "none"),
    # bf16 all-reduce: 2 bytes per parameter, no error feedback needed.
    "low": Preset("low", 50, 1, "bf16"),
    # FP4 with error feedback, streamed in 2 fragments (docs/diloco.md: as good as fp16 on the benchmark).
    "medium": Preset("medium", 50, 2, "fp4"),
    # SparseLoCo: the largest of every 64 elements, 2-bit values, ~0.016 bytes per parameter per sync (vectors
    # dense: a few % more), and its outer step: lr 1, no momentum, the error feedback decayed by 0.95. On
    # benchmarks/diloco_wan.py (600 steps, a 0.66 M GRU) this gave 1.010-1.025x DDP's held-out loss over three
    # seeds; the tuning split there preferred lr 1.3 and decay 0.9 (1.003x at 2015x fewer bytes), kept out of
    # the preset: one small model is weaker evidence than the paper's runs. H=30 did worse there.
    "high": Preset("high", 20, 1, "sparse-int2", 1 / 64, outer_lr=1.0, outer_momentum=0.0, error_decay=0.95),
}


@dataclass(frozen=True)
class Link:
    """The cross-site bandwidth a `meshrun bench` result shows."""

    bytes_per_s: float
    what: str  # where the figure comes from, in words


@dataclass(frozen=True)
class Choice:
    """What a job's `--compression` came to: the preset (None: nothing set) and why."""

    asked: str
    preset: Preset | None
    reason: str

    def to_dict(self) -> dict:
        return {"asked": self.asked, "preset": self.preset.to_dict() if self.preset else None, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> Choice:
        preset = Preset.from_dict(d["preset"]) if d.get("preset") else None
        return cls(str(d["asked"]), preset, str(d.get("reason", "")))

    def line(self) -> str:
        """The line printed at job start."""
        if self.preset is None:
            return f"compression: {self.asked}: {self.reason}"
        return (
            f"compression {self.asked}"
            + (f" -> {self.preset.name}" if self.asked != self.preset.name else "")
            + f": {self.preset.describe()} ({self.reason}; the script's explicit DiLoCo arguments win)"
        )


_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBgGtT]?)\s*$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_model_size(text: str | int) -> int:
    """``"1.3B"`` -> 1_300_000_000 (K, M, B or G, T; decimal); UsageError for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _COUNT.match(str(text))
        if not m:
            raise UsageError(
                f"--model-size {text!r} is not a parameter count", "e.g. --model-size 1.3B, 350M or 125000000"
            )
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise UsageError(f"--model-size {text!r} is less than one parameter", "e.g. --model-size 1.3B")
    return int(value)


def check_choice(asked: str) -> str:
    """`asked` if it is one of CHOICES, else UsageError."""
    if asked not in CHOICES:
        raise UsageError(f"--compression {asked!r} is not a preset", f"use one of {', '.join(CHOICES)}")
    return asked


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:,.0f} Mbit/s"


def _params(n: int) -> str:
    for unit, mult in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= mult:
            return f"{n / mult:.3g}{unit} parameters"
    return f"{n} parameters"


def link_from_bench(result: dict) -> Link | None:
    """The slowest cross-site figure of a `meshrun bench` result (its --json), or None when it has none.

    Pairs between different sites (all pairs when the result names fewer than two sites): the slowest
    one's TCP bandwidth; and the all-reduce sweep's best bus bandwidth, which is what one collective
    over the whole mesh reached. The smaller of the two is taken: a sync goes as fast as its slowest link.
    """
    site_of = {node: site for site, nodes in (result.get("sites") or {}).items() for node in nodes}
    pairs = [p for p in result.get("pairs") or [] if float(p.get("mbit_s") or 0) > 0]
    cross = [p for p in pairs if site_of.get(p.get("src")) != site_of.get(p.get("dst"))]
    if len(set(site_of.values())) < 2:
        cross = pairs
    figures: list[tuple[float, str]] = []
    if cross:
        slow = min(cross, key=lambda p: float(p["mbit_s"]))
        figures.append((float(slow["mbit_s"]) * 1e6 / 8, f"slowest cross-site pair {slow['src']} -> {slow['dst']}"))
    busbw = result.get("best_busbw_GBps")
    if isinstance(busbw, (int, float)) and busbw > 0:
        figures.append((float(busbw) * 1e9, "all-reduce bus bandwidth"))
    if not figures:
        return None
    rate, what = min(figures)
    when = result.get("measured_at")
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime(when)) + " UTC" if isinstance(when, (int, float)) else "?"
    return Link(rate, f"{what} {_rate(rate)}, `meshrun bench` of {stamp}")


def decide(
    asked: str,
    link: Link | None,
    model_params: int | None,
    workers: int,
    step_s: float | None = None,
) -> Choice:
    """The preset for `asked` (CHOICES) with its reason.

    `link`: the measured cross-site bandwidth (None: no `meshrun bench` result); `model_params`: the
    model's size (None: unknown); `workers`: DiLoCo replicas (nodes); `step_s`: seconds per inner step
    (None: ASSUMED_STEP_S). A level asked by name is taken as is.
    """
    check_choice(asked)
    if asked != "auto":
        return Choice(asked, PRESETS[asked], "asked for")
    if link is None:
        return Choice(
            asked,
            PRESETS[FALLBACK],
            f"no `meshrun bench` result on this coordinator, so {FALLBACK}; "
            "run `meshrun bench` to choose from the link",
        )
    if model_params is None:
        return Choice(
            asked, PRESETS[FALLBACK], f"model size unknown, so {FALLBACK}; pass --model-size to choose from {link.what}"
        )
    step = ASSUMED_STEP_S if step_s is None else step_s
    assumed = " assumed" if step_s is None else ""
    costs = []
    for level in LEVELS:
        p = PRESETS[level]
        sync_s = p.wire_per_param(workers) * model_params / link.bytes_per_s
        budget = SYNC_FRACTION * p.sync_every * step
        costs.append(f"{level} {sync_s:.3g} s")
        if sync_s <= budget:
            return Choice(
                asked,
                p,
                f"{link.what}; {_params(model_params)}, {workers} workers: a sync takes ~{sync_s:.3g} s, "
                f"{sync_s / (p.sync_every * step):.1%} of {p.sync_every} steps x {step:g} s{assumed} "
                f"(at most {SYNC_FRACTION:.0%}; {', '.join(costs)})",
            )
    p = PRESETS["high"]
    return Choice(
        asked,
        p,
        f"{link.what}; {_params(model_params)}, {workers} workers: even high takes ~{sync_s:.3g} s per sync, "
        f"{sync_s / (p.sync_every * step):.0%} of {p.sync_every} steps x {step:g} s{assumed}, over "
        f"{SYNC_FRACTION:.0%}: expect the syncs to slow training down",
    )
