"""DiLoCo and Streaming DiLoCo: train locally, sync a (compressed) pseudo-gradient now and then.

Usage (identical on every worker; all workers must call ``step()`` the same number of times)::

    from meshrun.train.diloco import DiLoCo
    opt = DiLoCo(model, inner_optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                 sync_every=100, compression="fp4", fragments=4)
    for batch in loader:                       # after a restart: skip the first opt.step_count steps
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
    opt.finish()                               # every worker ends on the same global model

Algorithm (Douillard et al. 2023, arXiv 2311.08105): each worker keeps a *global copy* of the
trainable parameters. ``step()`` runs the inner optimizer on the local model only. Every
``sync_every`` (H) inner steps the *pseudo-gradient* ``delta = global - local`` is averaged over the
workers (compressed on the wire as asked), fed to an outer ``torch.optim.SGD(lr=outer_lr,
momentum=outer_momentum, nesterov=outer_momentum > 0)`` that updates the global copy, and every
worker copies the new global copy into its model. The inner optimizer state is kept across rounds.
With world size 1 nothing is sent, but the math (including quantization) is the same.

Streaming (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv
2501.18512; schedule as in torchft's ``torchft/local_sgd.py``), turned on by ``fragments=F``:

- The parameter tensors are split into F fragments of about equal size (largest tensor first
  onto the lightest fragment; a tensor is never split, so F <= number of tensors). Each fragment
  syncs once every H steps, staggered: one fragment every H / F steps, fragment 0 first. Per sync
  only 1/F of the model crosses the wire: the same total bytes as DiLoCo, 1/F of the peak.
- Overlap (``overlap`` = tau inner steps, default 1 when F > 1, else 0): a fragment's pseudo-gradient
  is taken and its collective launched (``async_op=True``) tau steps before it is due, and
  training goes on meanwhile; at the due step the worker waits for it (usually long done), runs the
  outer step on that fragment's global copy, and merges: ``local = mixing * local + (1 - mixing) *
  global``. tau < H / F. ``mixing`` (alpha) defaults to 0, as in torchft: the paper's 0.5 gave an
  8 % worse validation loss on the benchmark of ``benchmarks/diloco_wan.py`` (docs/diloco.md).
- F = 1, tau = 0, alpha = 0 is plain DiLoCo (the default).

Compression (the pseudo-gradient only; floating-point buffers travel in their own dtype):

- ``"none"``: fp32 ``all_reduce(SUM)``, then divide by the world size. (gloo has no ``ReduceOp.AVG``.)
- ``"fp16"`` / ``"bf16"``: divide by the world size *first*, cast, ``all_reduce(SUM)``, cast back.
  Pre-dividing keeps the sum in range: fp16 overflows above 65504 (and flushes values below ~6e-8
  to zero); a pseudo-gradient that overflows anyway raises ``UsageError`` after the reduce instead
  of writing ``inf`` into the global copy. bf16 has fp32's range but 8 mantissa bits (fp16 has 11).
  No error feedback for these two: their rounding error is relative and unbiased.
- ``"int8"`` (1.002 bytes per element), ``"fp8"`` (E4M3 with a bf16 scale per 128 elements, 1.016
  bytes), ``"fp4"`` (FP4 E2M1 with a bf16 scale per 128 elements, 0.516 bytes per element),
  ``"int2"`` (four levels times the block's RMS, 0.266 bytes per element) and the sparse formats
  ``"sparse-int2"`` / ``"sparse-fp4"`` (SparseLoCo, arXiv 2508.15706: the ``density`` share of the
  elements, the largest of each chunk (64 elements at the default density 1/64: one of each), their
  positions in 6 bits, their values in int2 / fp4; 0.0159 bytes per element at 1/64): see
  ``meshrun.train.compress``. The sparse formats send *vectors* (parameters of one dimension or none:
  biases, norm scales) dense, in their values' format with error feedback, as PowerSGD leaves rank-1
  tensors uncompressed: a bias element steers a whole row, and the vectors are few (0.5 % of the
  benchmark's GRU, where they cost 7.5 % more payload per sync and gave a 0.2-1.2 % lower held-out loss
  on three seeds; under 0.1 % of a transformer's parameters). They travel in a collective of their own.
  All of them keep *error feedback*: this worker's residual ``x - dequant(quant(x))`` (for the
  sparse formats: everything not sent) is added to its next pseudo-gradient, so the error does not
  accumulate over syncs (the cumulative error stays within one rounding error). ``error_decay``
  (beta, default 1) scales the carried residual first: SparseLoCo's ``e = beta * e + delta``, with
  beta = 0.95 and no outer momentum, lets the decayed residual play the outer momentum. They are averaged
  by ``all_gather``: summing 8-, 4- or 2-bit codes in an ``all_reduce`` overflows, and the fixes
  that keep ``all_reduce`` cost the saving (reduce in int32) or the precision (a shared scale with
  ``levels // world_size`` levels per worker). Each worker dequantizes the ``world_size``
  contributions and averages them in rank order, so all
  workers get bit-identical results. Each worker *contributes* its payload once but *receives*
  ``world_size - 1`` payloads: fine for the handful of datacenters meshrun targets; for many
  workers a reduce-scatter scheme (torchft's fp8 path) is bandwidth-optimal. A sync's buckets (the
  sparse formats' vectors are a bucket of their own) travel in *one* all_gather, their payloads
  concatenated: a collective per bucket paid its framing per bucket.
- ``"sparse-shared"`` (``meshrun.train.compress.SharedSparse``): the sparse selection is made by one
  worker per sync, in turn (sync count mod world size), and broadcast; every worker's values at those
  positions are summed as int8 codes in one ``all_reduce``, so what a worker receives does not grow
  with the workers. Error feedback as above. Not with ``sites=`` (refused).

What ``bytes_sent_total`` / ``last_sync_bytes`` count: the payload this worker contributes to
collectives per sync (pseudo-gradient, scales, floating-point buffers), plus the model or state
it sends at construction (a broadcast or a recovery, see below). That is the figure to compare
with DDP, which contributes ``4 * numel`` bytes of fp32 gradients *every step*
(``ddp_equivalent_bytes``); it is not the per-link traffic of the algorithm the backend picks.
The state check's 8-byte digests are not counted. ``comm_blocked_s`` is the time this worker spent
waiting for its syncs' collectives (what overlap hides; ``last_sync_blocked_s`` for the last sync),
``sync_s`` all the time in sync code (forming and encoding the pseudo-gradient, waiting, decoding,
the outer step, the snapshot).

Presets (``meshrun train --compression auto|none|low|medium|high``, meshrun.core.presets): the job's
workers get ``MESHRUN_DILOCO_SYNC_EVERY``, ``MESHRUN_DILOCO_FRAGMENTS``, ``MESHRUN_DILOCO_COMPRESSION``,
``MESHRUN_DILOCO_DENSITY`` and, where the preset has its own outer step (``high``: SparseLoCo's),
``MESHRUN_DILOCO_OUTER_LR``, ``MESHRUN_DILOCO_OUTER_MOMENTUM`` and ``MESHRUN_DILOCO_ERROR_DECAY``; every
argument left at "auto" (``sync_every``, ``fragments``, ``compression``, ``density``, ``outer_lr``,
``outer_momentum``, ``error_decay``) takes the variable's value, else its default (H = DEFAULT_SYNC_EVERY,
1 fragment, "none", 1/64, 0.7, 0.9, 1). An explicit argument always wins. ``preset`` names the job's preset.

Mixed accelerators (``meshrun train --mixed-accelerators``): CUDA, ROCm and CPU workers in one job.
Every worker then creates a gloo group (``default_backend()``); with a gloo group and parameters on
an accelerator, DiLoCo keeps the global copy, the outer momentum and the error feedback in CPU memory,
forms the pseudo-gradient there and runs the outer step there, so all workers compute the same
bits whatever their device; the model itself stays on the accelerator.

State check (``check_state=True``): after every sync each worker hashes the fragment's global
parameters and outer momentum (64-bit BLAKE2b of the raw bytes: bit-exact, about 0.75 GB/s on one
CPU core here) and the digests are ``all_gather``ed in the background; the next sync (or
``finish()``) compares them, and a worker that differs from the majority makes every worker raise
``StateError`` naming the ranks. (Waiting for the digests at the sync itself would make every sync
a barrier.) ``verify_state()`` checks everything, blocking, now.

Membership changes (``snapshot_dir``, default ``$MESHRUN_OUTPUT_DIR/diloco-snapshots/$MESHRUN_RUN_ID``
when meshrun runs the script: in the project's persistent directory, one per run, so the job's own restarts
and ``meshrun train --resume JOB`` continue it while a new job of the project starts fresh; else off):
torchrun restarts *every* worker of an elastic job when a node dies or joins,
so in-memory state is gone. After every sync each worker writes a node-local snapshot
(``diloco-worker{LOCAL_RANK}.pt``: global copy, outer momentum, buffers, counters, and its own inner
optimizer state and error feedback). At construction the workers ``all_gather`` (sync count,
digest of the snapshot); the lowest rank holding the newest snapshot sends global copy, outer
momentum and buffers point-to-point to every worker whose snapshot is older, differs, or is
missing (a joiner); everyone sets its model to the global copy and goes on from that sync's
``step_count``. Survivors lose at most the inner steps since their last completed sync; nobody
writes checkpoint code. ``resumed`` says what happened. Without any snapshot the model is
broadcast from rank 0 unless every worker already holds identical parameters (compared by digest).

Sites (``sites=meshrun.train.sites.groups()``): one DiLoCo replica per site, for nodes that share a
fast network inside each datacenter. The inner step is the user's data parallelism *inside* the site
(``DistributedDataParallel(model, process_group=g.local)``; pass the bare module here), so the ranks of
a site hold the same pseudo-gradient. The outer sync then needs no reduction inside the site: local rank
i takes shard i of the pseudo-gradient, averages it with the other sites' shard i over the overlay (one
collective per local rank, all at once: every node's WAN uplink carries 1/n of the model), and the site
all-gathers the averaged shards on its own network. The average is over sites, not ranks. Compression
applies to the shards (error feedback per shard, on the rank that sends it). Needs two or more sites of
equal size (``g.hierarchical``); the state check and the start compare every rank of the job. DDP inside
a site; FSDP: not yet (every rank must hold the whole model: sharded parameters, DTensor or FSDP's, are
refused with UsageError, in every mode).

Checkpoints: ``state_dict()`` holds the inner and outer optimizer state, the global copy, the error
feedback, the step counters and the byte counters. It is *per worker* and does not include the model:
save ``model.state_dict()`` too and load both to resume bit-identically. Not while a sync is in flight.

How this differs from torchft's ``torchft.local_sgd.DiLoCo`` and from OpenDiLoCo, and why:

- Outer optimizer: torchft takes any user-built outer optimizer over the model's own parameters,
  which it restores from a backup before the outer step; meshrun builds the Nesterov SGD over a
  separate global copy (on the parameter's device: NCCL needs device tensors anyway).
- Fault tolerance: torchft's Manager forms a quorum per step (lighthouse), reconfigures the process
  group without restarting processes, and a recovering replica fetches the state from a live peer.
  meshrun runs under plain torchrun, which restarts everyone; the snapshot exchange above makes that
  restart cost at most one sync of progress (see docs/diloco.md).
- Compression: torchft quantizes to fp8 with row-wise scales (Triton, CUDA only), no error
  feedback; meshrun offers fp16/bf16/int8/fp4/int2 on gloo and NCCL with plain collectives.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrun.core import presets
from meshrun.errors import StateError, UsageError
from meshrun.train import snapshots
from meshrun.train.compress import DEFAULT_DENSITY, SharedSparse, SparseCodec, make_codec
from meshrun.train.progress import report
from meshrun.train.sites import SiteGroups, all_gather_single
from meshrun.train.snapshots import auto_snapshot_dir, state_digest

AUTO = "auto"
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "fp8", "fp4", "int2", "sparse-fp4", "sparse-int2", "sparse-shared")
DEFAULT_SYNC_EVERY = 100  # H when neither the script nor the job's preset gives one (the paper's low end)
DEFAULT_OUTER_LR = 0.7  # the DiLoCo paper's outer Nesterov step
DEFAULT_OUTER_MOMENTUM = 0.9
BUCKET_NUMEL = 1 << 24  # elements per collective (64 MiB of fp32); bounds the temporary memory
_WIRE_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
_STATE_FORMAT = "meshrun.train.diloco/1"


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(
            f"{name}={value!r} is not an integer >= {minimum}", f"pass {name} as an integer of at least {minimum}"
        )
    return value


def _check_float(name: str, value: Any, lo: float, hi: float, hi_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = lo <= value < hi if hi_open else lo < value <= hi
    if not ok:
        interval = f"[{lo}, {hi})" if hi_open else f"({lo}, {hi}]"
        raise UsageError(f"{name}={value!r} is outside {interval}", f"pass a finite number in {interval} as {name}")
    return float(value)


def preset_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The DiLoCo settings the job's preset put in the environment (``meshrun train --compression``).

    Keys among sync_every, fragments, compression, density, outer_lr, outer_momentum, error_decay, for the
    variables that are set (meshrun.core.presets names them). Raises ``UsageError`` naming a variable whose
    value is invalid.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, var in (("sync_every", presets.ENV_SYNC_EVERY), ("fragments", presets.ENV_FRAGMENTS)):
        if env.get(var):
            try:
                out[key] = int(env[var])
            except ValueError:
                out[key] = None
            if out[key] is None or out[key] < 1:
                raise UsageError(f"{var}={env[var]!r} is not an integer >= 1", f"unset {var}, or set it to e.g. 50")
    if env.get(presets.ENV_COMPRESSION):
        if env[presets.ENV_COMPRESSION] not in COMPRESSIONS:
            raise UsageError(
                f"{presets.ENV_COMPRESSION}={env[presets.ENV_COMPRESSION]!r} is not a DiLoCo compression",
                f"set it to one of {', '.join(COMPRESSIONS)}",
            )
        out["compression"] = env[presets.ENV_COMPRESSION]
    # hi_open: [lo, hi), else (lo, hi], as _check_float
    for key, var, lo, hi, hi_open, example in (
        ("density", presets.ENV_DENSITY, 0.0, 1.0, False, "0.015625"),
        ("outer_lr", presets.ENV_OUTER_LR, 0.0, 10.0, False, "0.7"),
        ("outer_momentum", presets.ENV_OUTER_MOMENTUM, 0.0, 1.0, True, "0.9"),
        ("error_decay", presets.ENV_ERROR_DECAY, 0.0, 1.0, False, "0.95"),
    ):
        if env.get(var):
            try:
                value = float(env[var])
            except ValueError:
                value = math.nan
            if not (lo <= value < hi if hi_open else lo < value <= hi):
                interval = f"[{lo:g}, {hi:g})" if hi_open else f"({lo:g}, {hi:g}]"
                fix = f"unset {var}, or set it to e.g. {example}"
                raise UsageError(f"{var}={env[var]!r} is not in {interval}", fix)
            out[key] = value
    return out


def mixed_accelerators() -> bool:
    """Whether this job mixes accelerators (``meshrun train --mixed-accelerators``): collectives must run on gloo."""
    return os.environ.get(presets.ENV_MIXED) == "1"


def default_backend() -> str:
    """The process-group backend for this worker: gloo in a mixed-accelerator job or without CUDA, else nccl.

    Every worker of a job must pick the same one: in a ``--mixed-accelerators`` job a CUDA worker
    uses gloo too (DiLoCo then stages its syncs through CPU memory, see the module docstring).
    """
    return "gloo" if mixed_accelerators() or not torch.cuda.is_available() else "nccl"


def sharding(model: nn.Module) -> str:
    """What shards `model`'s parameters across ranks, in words ("" when every rank holds them whole).

    FSDP (``fully_shard``'s DTensor parameters, ``FullyShardedDataParallel`` and its flat parameters) and
    tensor parallelism (DTensor). Looked up in the modules already imported: a model cannot hold a type
    that was never imported.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    for name, m in model.named_modules():
        if wrapper is not None and isinstance(m, wrapper):
            return f"module {name or 'model'!r} is FullyShardedDataParallel"
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for name, p in model.named_parameters():
        if dtensor is not None and isinstance(p, dtensor):
            return f"parameter {name!r} is a DTensor (FSDP's fully_shard or tensor parallelism)"
        if getattr(p, "_is_flat_param", False):
            return f"parameter {name!r} is FSDP's flat parameter"
    return ""


def _balanced_fragments(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``n`` groups of about equal total: largest first onto the lightest."""
    load = [0] * n
    groups: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(n), key=lambda f: (load[f], f))
        groups[f].append(i)
        load[f] += sizes[i]
    return [sorted(g) for g in groups]


@dataclass
class _InFlight:
    """A launched sync: per bucket its collective handle and how to read the average once done."""

    fragments: list[int]  # fragments synced
    indices: list[int]  # their parameter indices
    due: int  # step_count at which it is merged
    parts: list[tuple[list[int], Any, Callable[[], torch.Tensor]]]
    buffer_part: tuple[Any, torch.Tensor] | None
    nbytes: int


class DiLoCo:
    """Optimizer wrapper: local inner steps, an averaged outer Nesterov step per fragment every ``sync_every``.

    Args:
        model: the bare module being trained (not wrapped in DistributedDataParallel, not sharded by FSDP).
        inner_optimizer: a ``torch.optim.Optimizer`` over (some of) ``model``'s parameters; only
            those parameters are synchronized (the others never change locally).
        sync_every: inner steps between two syncs of the same fragment (H >= 1; a multiple of ``fragments``).
        outer_lr: learning rate of the outer SGD (> 0; the paper uses 0.7); "auto": the job's preset, else 0.7.
        outer_momentum: its momentum in [0, 1); Nesterov when > 0 (the paper uses 0.9); "auto": the job's
            preset, else 0.9.
        error_decay: beta in (0, 1], the carried residual's weight (quantized and sparse formats); "auto":
            the job's preset, else 1.
        compression: pseudo-gradient wire format: "none" (fp32), "fp16", "bf16", "int8", "fp4" or "int2".
        process_group: group to average over; default: the default group if
            ``torch.distributed`` is initialized, else none (world size 1, no communication).
        fragments: F >= 1; F > 1 turns on Streaming DiLoCo (see the module docstring).
        overlap: tau, inner steps a fragment's sync runs in the background (0 <= tau < H / F);
            default 1 when F > 1 (0 when H / F is 1), else 0.
        mixing: alpha in [0, 1), the weight of the local parameters in the merge (default 0).
        check_state: after each sync, compare a digest of the synced global state over the group.
        sites: ``meshrun.train.sites.groups()``: one replica per site, synced shard by shard (see
            "Sites" in the module docstring); instead of ``process_group``.
        snapshot_dir: an existing directory on this node where it keeps its snapshot for resuming
            after a restart; "auto": ``$MESHRUN_OUTPUT_DIR/diloco-snapshots/$MESHRUN_RUN_ID`` (created; in
            the project's directory on the node, which ``meshrun train`` sets; the run is the job's own id,
            or the resumed job's with ``--resume``) when those are set, else none; None: no snapshots.

    Construction is collective (every worker of the group must construct it). ``step()`` is
    collective at sync steps, ``sync_now()``, ``finish()`` and ``verify_state()`` always.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int | str = AUTO,
        outer_lr: float | str = AUTO,
        outer_momentum: float | str = AUTO,
        compression: str = AUTO,
        process_group: Any = None,
        fragments: int | str = AUTO,
        overlap: int | None = None,
        mixing: float = 0.0,
        check_state: bool = True,
        snapshot_dir: str | os.PathLike | None = AUTO,
        sites: SiteGroups | None = None,
        density: float | str = AUTO,
        error_decay: float | str = AUTO,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"model={type(model).__name__} is not a torch.nn.Module", "pass the model being trained")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise UsageError(
                "model is wrapped in DistributedDataParallel, which all-reduces every step",
                "pass the bare module (model.module); DiLoCo does the synchronization",
            )
        sharded = sharding(model)
        if sharded:
            raise UsageError(
                f"{sharded}: DiLoCo needs every rank to hold the whole model, FSDP is not supported yet",
                "use DistributedDataParallel instead (inside a site: process_group=g.local) and pass the bare module",
            )
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise UsageError(
                f"inner_optimizer={type(inner_optimizer).__name__} is not a torch.optim.Optimizer",
                "pass e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)",
            )
        preset = preset_from_env()
        self.preset = os.environ.get(presets.ENV_PRESET, "") if preset else ""
        # An explicit argument wins over the job's preset, which wins over the default.
        sync_every = preset.get("sync_every", DEFAULT_SYNC_EVERY) if sync_every == AUTO else sync_every
        compression = preset.get("compression", "none") if compression == AUTO else compression
        fragments = preset.get("fragments", 1) if fragments == AUTO else fragments
        density = preset.get("density", DEFAULT_DENSITY) if density == AUTO else density
        outer_lr = preset.get("outer_lr", DEFAULT_OUTER_LR) if outer_lr == AUTO else outer_lr
        if outer_momentum == AUTO:
            outer_momentum = preset.get("outer_momentum", DEFAULT_OUTER_MOMENTUM)
        error_decay = preset.get("error_decay", 1.0) if error_decay == AUTO else error_decay
        self.sync_every = _check_int("sync_every", sync_every, 1)
        self.outer_lr = _check_float("outer_lr", outer_lr, 0.0, math.inf, hi_open=False)
        self.outer_momentum = _check_float("outer_momentum", outer_momentum, 0.0, 1.0, hi_open=True)
        if compression not in COMPRESSIONS:
            raise UsageError(
                f"compression={compression!r} is not supported",
                f"use one of {', '.join(repr(c) for c in COMPRESSIONS)}",
            )
        self.compression = compression
        self.density = _check_float("density", density, 0.0, 1.0, hi_open=False)
        self.error_decay = _check_float("error_decay", error_decay, 0.0, 1.0, hi_open=False)
        self._codec = make_codec(compression, self.density)
        # The sparse formats' vectors go dense, in the values' format (see the module docstring).
        self._vector_codec = self._codec.values if isinstance(self._codec, SparseCodec) else None
        self.fragments = _check_int("fragments", fragments, 1)
        if self.sync_every % self.fragments:
            raise UsageError(
                f"sync_every={sync_every} is not a multiple of fragments={fragments}",
                "each fragment syncs every sync_every steps, one every sync_every / fragments: "
                f"use e.g. sync_every={self.fragments * max(1, sync_every // self.fragments)}",
            )
        self._period = self.sync_every // self.fragments
        default_overlap = min(1, self._period - 1) if self.fragments > 1 else 0
        self.overlap = _check_int("overlap", default_overlap if overlap is None else overlap, 0)
        if self.overlap >= self._period:
            raise UsageError(
                f"overlap={self.overlap} is not below sync_every / fragments = {self._period}",
                "a fragment's sync must land before the next one starts: lower overlap",
            )
        self.mixing = _check_float("mixing", mixing, 0.0, 1.0, hi_open=True)
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "process_group was given but torch.distributed is not initialized",
                "call torch.distributed.init_process_group() first, or drop process_group",
            )
        if sites is not None:
            if process_group is not None:
                raise UsageError("both sites and process_group were given", "pass one: sites replaces process_group")
            if not sites.hierarchical:
                raise UsageError(
                    f"sites={sites.layout.sites} are not two or more sites of equal size",
                    "give every site as many ranks, or drop sites= (DiLoCo then averages over every rank)",
                )
            if isinstance(self._codec, SharedSparse):
                raise UsageError(
                    "compression='sparse-shared' is not supported with sites= yet",
                    "use compression='sparse-int2' with sites=, or drop sites=",
                )
            process_group = sites.world
        self._sites = sites
        self.process_group = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self._distributed else 1
        self.rank = dist.get_rank(process_group) if self._distributed else 0
        self.check_state = bool(check_state)
        if snapshot_dir == AUTO:
            snapshot_dir = auto_snapshot_dir()
        if snapshot_dir is not None and not Path(snapshot_dir).is_dir():
            raise UsageError(
                f"snapshot_dir={str(snapshot_dir)!r} is not a directory",
                "create it first (one per node, on local disk), or pass snapshot_dir=None",
            )
        self.snapshot_path = (
            Path(snapshot_dir) / f"diloco-worker{os.environ.get('LOCAL_RANK', '0')}.pt"
            if snapshot_dir is not None
            else None
        )

        self.model = model
        self.inner_optimizer = inner_optimizer
        opt_params = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in opt_params]
        if len(named) != len(opt_params):
            raise UsageError(
                f"inner_optimizer holds {len(opt_params) - len(named)} tensor(s) that are not parameters of model",
                "build the inner optimizer from this model's parameters",
            )
        if self.fragments > len(named):
            raise UsageError(
                f"fragments={fragments} is more than the {len(named)} parameter tensors",
                f"use at most {len(named)} fragments (a tensor is never split)",
            )
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        self._fragment_indices = _balanced_fragments([p.numel() for p in self._params], self.fragments)
        # Where syncs happen: the parameters' device, except that a gloo group with accelerator parameters
        # (a --mixed-accelerators job) syncs through CPU memory, and keeps the global copy and the outer
        # step there, so that a CUDA, a ROCm and a CPU worker compute the same outer step bit for bit.
        self._comm_device = self._params[0].device
        if (
            sites is None
            and self._distributed
            and self._comm_device.type != "cpu"
            and dist.get_backend(process_group) == "gloo"
        ):
            self._comm_device = torch.device("cpu")

        # Global copy in the parameter's dtype, on the sync device (see module docstring).
        self._global = [p.detach().to(self._comm_device, copy=True) for p in self._params]
        self.outer_optimizer = torch.optim.SGD(
            self._global, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0
        )
        self._make_momentum()
        self._error_feedback: list[torch.Tensor] | None = None
        if self._codec is not None:
            self._error_feedback = [
                torch.zeros_like(g, dtype=torch.float32, device=self._comm_device) for g in self._global
            ]

        self.step_count = 0  # inner steps taken
        self.sync_count = 0  # syncs merged (one per fragment sync, sync_now or finish)
        self.last_sync_bytes = 0
        self.bytes_sent_total = 0
        self.comm_blocked_s = 0.0  # seconds this worker waited on its syncs' collectives (what overlap hides)
        self.sync_s = 0.0  # seconds in sync code: forming, encoding, waiting, decoding, outer step, snapshot
        self.last_sync_blocked_s = 0.0
        self._inflight: _InFlight | None = None
        self._clean: set[int] = set()  # fragments whose local part equals the global copy
        self._pending_check: tuple[int, Any, list[torch.Tensor]] | None = None  # sync, handle, digests
        self.resumed: dict[str, Any] | None = None
        self._start()

    # ----------------------------------------------------------------- optimizer-like API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (change ``lr`` here or schedule ``inner_optimizer``)."""
        return self.inner_optimizer.param_groups

    @property
    def numel(self) -> int:
        """Number of synchronized parameter elements."""
        return sum(p.numel() for p in self._params)

    @property
    def ddp_equivalent_bytes(self) -> int:
        """Bytes DDP would have contributed for the steps taken so far (fp32 grads every step)."""
        return self.step_count * 4 * self.numel if self.world_size > 1 else 0

    @property
    def in_flight(self) -> bool:
        """Whether a fragment's sync is running in the background (``state_dict()`` must wait)."""
        return self._inflight is not None

    @property
    def fragment_names(self) -> list[list[str]]:
        """The parameter names of each fragment, in sync order."""
        return [[self._names[i] for i in idx] for idx in self._fragment_indices]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the inner optimizer's gradients."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; launches and merges fragment syncs on schedule (collective then).

        Returns the closure's loss.
        """
        loss = self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()
        self.step_count += 1
        self._clean.clear()
        ahead = self.step_count + self.overlap
        if ahead % self._period == 0:
            fragment = (ahead // self._period - 1) % self.fragments
            self._inflight = self._launch([fragment], due=ahead)
        if self._inflight is not None and self._inflight.due == self.step_count:
            self._merge(self.mixing)
        return loss

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global copy by parameter name (live tensors; do not modify)."""
        return dict(zip(self._names, self._global))

    # ----------------------------------------------------------------- sync
    @torch.no_grad()
    def sync_now(self) -> None:
        """Sync every fragment now (collective, blocking); the model equals the global copy afterwards.

        A fragment in flight is merged first (with ``mixing``). Raises ``UsageError`` when the
        averaged pseudo-gradient is not finite (fp16 overflow or a diverged run); every worker
        sees the same reduced values, so all of them raise alike.
        """
        self._sync_blocking(list(range(self.fragments)))

    @torch.no_grad()
    def finish(self) -> None:
        """End of training (collective): sync what the model holds that the global copy lacks.

        Merges a fragment in flight, then syncs every fragment not synced (without mixing) since
        the last ``step()``, so all workers end on the same global model. With F = 1 and a final
        step that synced, it sends nothing.
        """
        self._sync_blocking([f for f in range(self.fragments) if f not in self._clean])

    def _sync_blocking(self, fragments: list[int]) -> None:
        if self._inflight is not None:
            self._merge(self.mixing)
        if fragments:
            self._inflight = self._launch(fragments, due=self.step_count)
            self._merge(0.0)
        self._check_digests()

    @torch.no_grad()
    def _launch(self, fragments: list[int], due: int) -> _InFlight:
        """Take the pseudo-gradient of ``fragments`` now and start averaging it (asynchronously).

        Floating-point buffers ride along with fragment 0.
        """
        started = time.perf_counter()
        indices = sorted(i for f in fragments for i in self._fragment_indices[f])
        parts = []
        nbytes = 0
        dev = self._comm_device
        gathers: list[tuple[list[int], Any, torch.Tensor, torch.Tensor]] = []
        if isinstance(self._codec, SharedSparse):
            part, nbytes = self._start_shared(indices)
            parts.append(part)
        else:
            for bucket in self._make_buckets(indices):
                dtype = self._compute_dtype(self._params[bucket[0]])
                flat = torch.cat(
                    [
                        (self._global[i].to(dtype) - self._params[i].to(device=dev, dtype=dtype)).reshape(-1)
                        for i in bucket
                    ]
                )
                if self._codec is not None and self._sites is None:  # gathered: one collective for every bucket
                    codec = self._codec_for(bucket)
                    gathers.append((bucket, codec, self._encode(codec, flat, bucket), flat))
                    continue
                work, finish, sent = self._start_average(flat, bucket)
                parts.append((bucket, work, finish))
                nbytes += sent
        if gathers:
            parts.extend(self._start_gather_payloads(gathers))
            nbytes += sum(payload.numel() for _, _, payload, _ in gathers)
        buffer_part = None
        if 0 in fragments and self._buffers and self.world_size > 1:
            # Buffers are averaged in their own dtype (no outer optimizer, no compression).
            flat = torch.cat([b.detach().to(dev).reshape(-1) for b in self._buffers])
            buffer_part = (dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True), flat)
            nbytes += flat.numel() * flat.element_size()
        self.sync_s += time.perf_counter() - started
        return _InFlight(fragments, indices, due, parts, buffer_part, nbytes if self.world_size > 1 else 0)

    def _start_average(self, flat: torch.Tensor, bucket: list[int]) -> tuple[Any, Callable[[], torch.Tensor], int]:
        """Start averaging ``flat`` by all-reduce (or per site): (handle or None, read the result, bytes contributed).

        The gathered formats go through ``_encode`` and ``_start_gather_payloads`` instead: one collective per sync.
        """
        if self._sites is not None:
            return self._start_site_average(flat, bucket)
        world, group = self.world_size, self.process_group
        wire = flat if self.compression == "none" else (flat / world).to(_WIRE_DTYPE[self.compression])
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True) if world > 1 else None
        if self.compression == "none":
            return work, lambda: wire / world, wire.numel() * wire.element_size()
        return work, lambda: wire.to(flat.dtype), wire.numel() * wire.element_size()

    def _carry(self, flat: torch.Tensor, bucket: list[int]) -> None:
        """Add the (decayed) error feedback of ``bucket`` to its pseudo-gradient ``flat``, in place."""
        assert self._error_feedback is not None
        carried = torch.cat([self._error_feedback[i].to(flat.dtype).reshape(-1) for i in bucket])
        flat += carried if self.error_decay == 1 else self.error_decay * carried

    def _keep_residual(self, residual: torch.Tensor, bucket: list[int]) -> None:
        """Store what was not sent of ``bucket`` (flat, in bucket order) as its error feedback."""
        assert self._error_feedback is not None
        offset = 0
        for i in bucket:
            ef = self._error_feedback[i]
            ef.copy_(residual[offset : offset + ef.numel()].view_as(ef))
            offset += ef.numel()

    def _encode(self, codec: Any, flat: torch.Tensor, bucket: list[int]) -> torch.Tensor:
        """A gathered format's payload for ``flat`` (error feedback added, the residual kept)."""
        self._carry(flat, bucket)
        payload, approx = codec.encode(flat)
        self._keep_residual(flat - approx, bucket)
        return payload

    def _start_gather_payloads(
        self, gathers: list[tuple[list[int], Any, torch.Tensor, torch.Tensor]]
    ) -> list[tuple[list[int], Any, Callable[[], torch.Tensor]]]:
        """One ``all_gather`` of every bucket's payload, concatenated (a collective per bucket would pay its
        framing per bucket: the vectors' is larger than their payload); one part per bucket, the handle on the
        first (``_merge`` waits for it before reading any)."""
        world, group = self.world_size, self.process_group
        payload = torch.cat([p for _, _, p, _ in gathers])
        gathered = [torch.empty_like(payload) for _ in range(world)] if world > 1 else [payload]
        work = dist.all_gather(gathered, payload, group=group, async_op=True) if world > 1 else None
        parts = []
        offset = 0
        for bucket, codec, mine, flat in gathers:
            lo, hi = offset, offset + mine.numel()
            offset = hi

            def average(codec: Any = codec, lo: int = lo, hi: int = hi, flat: torch.Tensor = flat) -> torch.Tensor:
                total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
                for part in gathered:  # fixed rank order: identical result on every worker
                    # a copy: a slice at an odd offset cannot be viewed as its bf16 / fp32 scales
                    total += codec.decode(part[lo:hi].clone(), flat.numel())
                return (total / world).to(flat.dtype)

            parts.append((bucket, work if not parts else None, average))
        return parts

    def _start_shared(self, indices: list[int]) -> tuple[tuple[list[int], Any, Callable[[], torch.Tensor]], int]:
        """sparse-shared (``SharedSparse``): the leader of this sync (sync count mod world size) broadcasts its
        selection, then every worker's codes are all-reduced (asynchronously). Returns (the part, bytes sent)."""
        codec = self._codec
        assert isinstance(codec, SharedSparse)
        dev, world, group = self._comm_device, self.world_size, self.process_group
        mats = [i for i in indices if self._params[i].dim() > 1]
        vecs = [i for i in indices if self._params[i].dim() <= 1]

        def pseudo(bucket: list[int]) -> torch.Tensor:
            if not bucket:
                return torch.zeros(0, dtype=torch.float32, device=dev)
            flat = torch.cat(
                [
                    (self._global[i].float() - self._params[i].to(device=dev, dtype=torch.float32)).reshape(-1)
                    for i in bucket
                ]
            )
            self._carry(flat, bucket)
            return flat

        matrices, vectors = pseudo(mats), pseudo(vecs)
        if not bool(torch.isfinite(matrices).all() and torch.isfinite(vectors).all()):
            # int8 codes cannot carry a NaN to the others as a gathered payload's scale does: stop here (the
            # others' collective then fails on the closed connection, and torchrun ends the job's workers)
            raise UsageError(
                "this worker's pseudo-gradient is not finite (compression='sparse-shared')",
                "lower the learning rate or sync_every: training diverged",
            )
        leader = self.sync_count % world
        if self.rank == leader:
            header = codec.header(matrices, vectors)
        else:
            header = torch.empty(codec.header_bytes(matrices.numel(), vectors.numel()), dtype=torch.uint8, device=dev)
        if world > 1:  # the codes depend on the leader's choice: wait for it (counted as blocked)
            self._wait(dist.broadcast(header, src=self._global_rank(leader), group=group, async_op=True))
        codes, sent_m, sent_v = codec.contribution(header, matrices, vectors, world)
        self._keep_residual(matrices - sent_m, mats)
        self._keep_residual(vectors - sent_v, vecs)
        work = dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=group, async_op=True) if world > 1 else None

        def average() -> torch.Tensor:
            return codec.average(header, codes, matrices.numel(), world)

        nbytes = codes.numel() * codes.element_size() + (header.numel() if self.rank == leader else 0)
        return (mats + vecs, work, average), nbytes

    def _start_site_average(self, flat: torch.Tensor, bucket: list[int]) -> tuple[Any, Callable[[], torch.Tensor], int]:
        """Site mode: this rank's shard of ``flat`` averaged across sites; reading it all-gathers the site."""
        g = self._sites
        assert g is not None
        sites, n, i, numel = g.num_sites, g.local_size, g.local_rank, flat.numel()
        chunk = -(-numel // n)
        lo, hi = min(i * chunk, numel), min((i + 1) * chunk, numel)
        codec = self._codec_for(bucket)
        if codec is not None:
            assert self._error_feedback is not None
            ef = torch.cat([self._error_feedback[j].to(flat.dtype).reshape(-1) for j in bucket])
            shard = flat[lo:hi] + (ef[lo:hi] if self.error_decay == 1 else self.error_decay * ef[lo:hi])
            payload, approx = codec.encode(shard)
            ef[lo:hi] = shard - approx  # the residual of what this rank sent; the rest is others' to send
            self._keep_residual(ef, bucket)
            gathered = [torch.empty_like(payload) for _ in range(sites)]
            work = dist.all_gather(gathered, payload, group=g.cross, async_op=True)

            def shard_average() -> torch.Tensor:
                total = torch.zeros(hi - lo, dtype=torch.float32, device=flat.device)
                for part in gathered:  # fixed site order: identical on every rank
                    total += codec.decode(part, hi - lo)
                return (total / sites).to(flat.dtype)

            sent = payload.numel()
        else:
            shard = flat[lo:hi].clone()
            wire = shard if self.compression == "none" else (shard / sites).to(_WIRE_DTYPE[self.compression])
            work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=g.cross, async_op=True)

            def shard_average() -> torch.Tensor:
                return wire / sites if self.compression == "none" else wire.to(flat.dtype)

            sent = wire.numel() * wire.element_size()

        def average() -> torch.Tensor:
            mine = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
            mine[: hi - lo] = shard_average()
            out = torch.empty(chunk * n, dtype=flat.dtype, device=flat.device)
            all_gather_single(out, mine, group=g.local)  # on the site's own network
            return out[:numel]

        return work, average, sent

    @torch.no_grad()
    def _merge(self, alpha: float) -> None:
        """Wait for the sync in flight, outer-step its fragment, mix it into the model (collective)."""
        job, self._inflight = self._inflight, None
        assert job is not None
        started, blocked = time.perf_counter(), self.comm_blocked_s
        self._check_digests()
        for bucket, work, read in job.parts:
            self._wait(work)
            avg = read()
            if not bool(torch.isfinite(avg).all()):
                raise UsageError(
                    f"the averaged pseudo-gradient is not finite with compression={self.compression!r}",
                    "use compression='bf16' (fp16 overflows above 65504), or lower the "
                    "learning rate / sync_every if training diverged",
                )
            offset = 0
            for i in bucket:
                g = self._global[i]
                g.grad = avg[offset : offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for i in job.indices:
            p, g = self._params[i], self._global[i]
            p.copy_(g if alpha == 0 else torch.lerp(g.to(p.device), p, alpha))
        if job.buffer_part is not None:
            work, flat = job.buffer_part
            self._wait(work)
            flat /= self.world_size
            offset = 0
            for b in self._buffers:
                avg = flat[offset : offset + b.numel()].view_as(b)
                b.copy_(avg if alpha == 0 else torch.lerp(avg.to(b.device), b, alpha))
                offset += b.numel()
        if alpha == 0:
            self._clean.update(job.fragments)
        self.last_sync_bytes = job.nbytes
        self.bytes_sent_total += job.nbytes
        self.sync_count += 1
        report(self.step_count, outer_step=self.sync_count)  # `meshrun jobs` shows it (rank 0, under meshrun)
        if self.check_state and self.world_size > 1:
            # Compared at the next sync (or finish): waiting here would make every sync a barrier.
            digest = state_digest(self._shared_tensors(job.indices))
            self._pending_check = (self.sync_count, *self._start_gather([digest]))
        if self.snapshot_path is not None:
            self._write_snapshot()
        self.last_sync_blocked_s = self.comm_blocked_s - blocked
        self.sync_s += time.perf_counter() - started

    def _wait(self, work: Any) -> None:
        """Wait for a collective (None: nothing was sent), counting the time in ``comm_blocked_s``."""
        if work is None:
            return
        t = time.perf_counter()
        work.wait()
        self.comm_blocked_s += time.perf_counter() - t

    # ----------------------------------------------------------------- state check
    def _shared_tensors(self, indices: list[int]) -> list[torch.Tensor]:
        """What every worker must hold identically for ``indices``: global copy, then outer momentum."""
        momentum = (
            [self.outer_optimizer.state[self._global[i]]["momentum_buffer"] for i in indices]
            if self.outer_momentum > 0
            else []
        )
        return [self._global[i] for i in indices] + momentum

    @torch.no_grad()
    def verify_state(self) -> None:
        """Check now that every worker holds bit-identical global state (collective).

        Compares 64-bit digests of the global copy, the outer momentum and the floating-point
        buffers. Raises ``StateError`` naming the ranks that differ from the majority.
        """
        if self.world_size == 1:
            return
        self._check_digests()
        work, out = self._start_gather([state_digest(self._snapshot_tensors())])
        self._pending_check = (self.sync_count, work, out)
        self._check_digests()

    def _check_digests(self) -> None:
        """Wait for the digests gathered after a sync and raise ``StateError`` if a worker differs."""
        if self._pending_check is None:
            return
        sync, work, out = self._pending_check
        self._pending_check = None
        self._wait(work)
        snapshots.check_digests([int(t[0]) for t in out], sync)

    def _start_gather(self, values: list[int]) -> tuple[Any, list[torch.Tensor]]:
        """Start an ``all_gather`` of a few int64 values: (handle, one tensor per rank once done)."""
        mine = torch.tensor(values, dtype=torch.int64, device=self._comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        return dist.all_gather(out, mine, group=self.process_group, async_op=True), out

    def _gather_ints(self, values: list[int]) -> list[list[int]]:
        """``all_gather`` a few int64 values from every worker (blocking): one row per rank."""
        work, out = self._start_gather(values)
        work.wait()
        return [t.tolist() for t in out]

    # ----------------------------------------------------------------- start, snapshots, recovery
    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.process_group, group_rank) if self.process_group is not None else group_rank

    def _snapshot_tensors(self) -> list[torch.Tensor]:
        """Global copy, outer momentum, buffers: the state a recovery sends, in a fixed layout."""
        return self._shared_tensors(list(range(len(self._params)))) + self._buffers

    def _write_snapshot(self) -> None:
        assert self.snapshot_path is not None
        snapshots.write_snapshot(
            self.snapshot_path,
            self._names,
            self.step_count,
            self.sync_count,
            self.bytes_sent_total,
            self._snapshot_tensors(),
            self.inner_optimizer.state_dict(),
            self._error_feedback,
        )

    @torch.no_grad()
    def _start(self) -> None:
        """Agree on the starting state: resume from the newest snapshot, or align the models (collective)."""
        snap = snapshots.read_snapshot(self.snapshot_path, self._names, self._snapshot_tensors(), self._comm_device)
        if snap is not None:  # this worker's own part
            self.inner_optimizer.load_state_dict(snap["inner_optimizer"])
            self.bytes_sent_total = int(snap["bytes_sent_total"])
        if self.world_size == 1:
            if snap is not None:
                self._adopt(snap["shared"], snap["step_count"], snap["sync_count"], snap)
            return
        if snap is not None:
            mine = [snap["sync_count"], snap["step_count"], state_digest(snap["shared"])]
        else:
            mine = [snapshots.FRESH, 0, state_digest(list(self.model.parameters()) + list(self.model.buffers()))]
        plan = snapshots.plan_start(self._gather_ints(mine))
        if not isinstance(plan, snapshots.Resume):  # a fresh start: broadcast only if the models differ
            if plan:
                self._broadcast_model()
            return
        newest, src, receivers = plan.sync_count, plan.source, plan.receivers
        group = self.process_group
        if self.rank in receivers:
            shared = [torch.empty_like(t, device=self._comm_device) for t in self._snapshot_tensors()]
            for t in shared:
                dist.recv(t, src=self._global_rank(src), group=group)
        else:
            assert snap is not None
            shared = snap["shared"]
        if self.rank == src:
            for r in receivers:
                for t in shared:
                    dist.send(t.to(self._comm_device).contiguous(), dst=self._global_rank(r), group=group)
                    self.bytes_sent_total += t.numel() * t.element_size()
        self._adopt(
            shared, plan.step_count, newest, snap if snap is not None and snap["sync_count"] == newest else None
        )
        self.resumed = {"sync_count": newest, "step_count": self.step_count, "source_rank": src, "receivers": receivers}
        if self.check_state:
            self.verify_state()

    def _broadcast_model(self) -> None:
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            staged = t.data if t.device == self._comm_device else t.data.to(self._comm_device)
            dist.broadcast(staged, src=self._global_rank(0), group=self.process_group)
            if staged is not t.data:
                t.data.copy_(staged)
            if self.rank == 0:
                self.bytes_sent_total += t.numel() * t.element_size() * (self.world_size - 1)
        for g, p in zip(self._global, self._params):
            g.copy_(p)

    def _adopt(self, shared: list[torch.Tensor], step_count: int, sync_count: int, own: dict[str, Any] | None) -> None:
        """Take ``shared`` (``_snapshot_tensors`` layout) as the state; the model becomes the global copy.

        ``own``: this worker's snapshot when it is of the same sync, so its error feedback still applies.
        """
        for t, s in zip(self._snapshot_tensors(), shared):
            t.copy_(s)
        for p, g in zip(self._params, self._global):
            p.copy_(g)
        if own is not None and self._error_feedback is not None and own["error_feedback"] is not None:
            for ef, s in zip(self._error_feedback, own["error_feedback"]):
                ef.copy_(s)
        self.step_count, self.sync_count = int(step_count), int(sync_count)
        # The model is the global copy now: a worker restarted after its last step must not sync
        # again in finish() (it would end one sync ahead of the others, on another model).
        self._clean = set(range(self.fragments))

    # ----------------------------------------------------------------- helpers
    def _make_momentum(self) -> None:
        """Give every global tensor an outer momentum buffer (zeros) if it has none yet.

        SGD would create each at its first step as a copy of the gradient, which is what a zero
        buffer gives as well; made up front, the shared state has one fixed layout for every fragment.
        """
        if self.outer_momentum > 0:
            for g in self._global:
                self.outer_optimizer.state[g].setdefault("momentum_buffer", torch.zeros_like(g))

    @staticmethod
    def _compute_dtype(p: torch.Tensor) -> torch.dtype:
        # Pseudo-gradients are formed in at least fp32 (a bf16 model's delta would lose the small updates).
        return torch.promote_types(p.dtype, torch.float32)

    def _is_vector(self, i: int) -> bool:
        """Parameter ``i`` is sent dense by a sparse format (a bias or a norm scale)."""
        return self._vector_codec is not None and self._params[i].dim() <= 1

    def _codec_for(self, bucket: list[int]) -> Any:
        """The codec of a bucket (its parameters are all vectors or none are: see ``_make_buckets``)."""
        return self._vector_codec if self._is_vector(bucket[0]) else self._codec

    def _make_buckets(self, indices: list[int]) -> list[list[int]]:
        """Group ``indices`` by (device, compute dtype, sent dense as a vector), at most BUCKET_NUMEL elements
        each."""
        buckets: list[list[int]] = []
        open_bucket: dict[tuple[torch.device, torch.dtype, bool], tuple[list[int], int]] = {}
        for i in indices:
            p = self._params[i]
            key = (p.device, self._compute_dtype(p), self._is_vector(i))
            idx, size = open_bucket.get(key, ([], 0))
            if idx and size + p.numel() > BUCKET_NUMEL:
                buckets.append(idx)
                idx, size = [], 0
            idx.append(i)
            open_bucket[key] = (idx, size + p.numel())
        buckets.extend(idx for idx, _ in open_bucket.values() if idx)
        return buckets

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This worker's DiLoCo state (save one per rank, next to ``model.state_dict()``).

        Raises ``UsageError`` while a fragment's sync is in flight (``in_flight``): its collective
        cannot be saved. Save right after a sync, when ``sync_count`` has just changed.
        """
        if self._inflight is not None:
            raise UsageError(
                f"state_dict() at step {self.step_count}: a fragment's sync is in flight "
                f"until step {self._inflight.due}",
                "save when opt.in_flight is False (e.g. right after sync_count changes)",
            )
        return {
            "format": _STATE_FORMAT,
            "compression": self.compression,
            "density": self.density,
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "world_size": self.world_size,
            "step_count": self.step_count,
            "sync_count": self.sync_count,
            "last_sync_bytes": self.last_sync_bytes,
            "bytes_sent_total": self.bytes_sent_total,
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "global_params": dict(zip(self._names, self._global)),
            "error_feedback": (
                dict(zip(self._names, self._error_feedback)) if self._error_feedback is not None else None
            ),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (load the model's own state dict as well).

        Changing ``compression`` across a resume is allowed: error feedback starts from zero
        when the checkpoint has none and is dropped when the new run does not quantize.
        Raises ``StateError`` when the checkpoint does not match this model.
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise StateError(
                "the DiLoCo checkpoint is not in the meshrun.train.diloco/1 format",
                "pass the dict returned by DiLoCo.state_dict()",
            )
        for key in (
            "step_count",
            "sync_count",
            "inner_optimizer",
            "outer_optimizer",
            "global_params",
            "error_feedback",
        ):
            if key not in state:
                raise StateError(f"the DiLoCo checkpoint lacks {key!r}", "save it with DiLoCo.state_dict()")
        saved = state["global_params"]
        if list(saved) != self._names:
            missing = sorted(set(self._names) - set(saved)) or sorted(set(saved) - set(self._names))
            raise StateError(
                f"the DiLoCo checkpoint's parameters differ from this model's (e.g. {missing[:3]})",
                "resume with the same model and inner optimizer as were saved",
            )
        for name, g in zip(self._names, self._global):
            if saved[name].shape != g.shape:
                raise StateError(
                    f"parameter {name!r} has shape {tuple(saved[name].shape)} in the checkpoint "
                    f"but {tuple(g.shape)} in the model",
                    "resume with the same model architecture",
                )
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._make_momentum()  # a checkpoint saved before the first sync by an older meshrun has none
        for name, g in zip(self._names, self._global):
            g.copy_(saved[name])
        if self._error_feedback is not None:
            ef_saved = state["error_feedback"]
            for name, ef in zip(self._names, self._error_feedback):
                if ef_saved is not None:
                    ef.copy_(ef_saved[name])
                else:
                    ef.zero_()
        self.step_count = int(state["step_count"])
        self.sync_count = int(state["sync_count"])
        self.last_sync_bytes = int(state.get("last_sync_bytes", 0))
        self.bytes_sent_total = int(state.get("bytes_sent_total", 0))
        self._clean.clear()

    def __repr__(self) -> str:
        return (
            f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum}, compression={self.compression!r}, "
            + (f"density={self.density}, " if self.compression.startswith("sparse-") else "")
            + f"error_decay={self.error_decay}, "
            f"fragments={self.fragments}, overlap={self.overlap}, mixing={self.mixing}, "
            f"world_size={self.world_size}, params={self.numel})"
        )
