"""DiLoCo: train locally for ``sync_every`` steps, then all-reduce one (compressed) pseudo-gradient.

Usage (identical on every worker; all workers must call ``step()`` the same number of times)::

    from meshrun.train.diloco import DiLoCo
    opt = DiLoCo(model, inner_optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                 sync_every=100, outer_lr=0.7, outer_momentum=0.9, compression="fp16")
    for batch in loader:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()

Algorithm (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"):
each worker keeps a *global copy* of the trainable parameters. ``step()`` runs the inner optimizer
on the local model only. Every ``sync_every`` inner steps the *pseudo-gradient*
``delta = global - local`` is averaged over the workers (compressed on the wire as asked), fed to an
outer ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)`` that
updates the global copy, and every worker copies the new global copy into its model and goes on.
The inner optimizer state (e.g. AdamW moments) is kept across rounds, as in the paper.
With world size 1 nothing is sent, but the math (including quantization) is the same.

What travels, and what ``bytes_sent_total`` / ``last_sync_bytes`` count: the payload this worker
contributes to the collective per sync (numel * wire element size, plus the int8 scales, plus
the floating-point buffers). That is the figure to compare with DDP, which contributes
``4 * numel`` bytes of fp32 gradients *every step* (see ``ddp_equivalent_bytes``). It is not the
per-link traffic of the ring/tree algorithm the backend picks. With world size 1 it is 0.

Compression (the pseudo-gradient only; buffers always travel in their own dtype):

- ``"none"``: fp32 ``all_reduce(SUM)``, then divide by the world size. (gloo has no ``ReduceOp.AVG``.)
- ``"fp16"`` / ``"bf16"``: divide by the world size *first*, cast, ``all_reduce(SUM)``, cast back.
  Pre-dividing keeps the sum in range: fp16 overflows above 65504 (and flushes values below
  ~6e-8 to zero); a pseudo-gradient that overflows anyway raises ``UsageError`` after the reduce
  instead of silently writing ``inf`` into the global copy. bf16 has fp32's range but only 8
  mantissa bits (~0.4 % relative error, fp16 has 11); prefer bf16 when pseudo-gradients can be large.
  No error feedback for these two (as specified): their rounding error is relative and unbiased.
- ``"int8"``: symmetric per-chunk quantization (one fp32 scale per ``INT8_CHUNK`` elements,
  ``scale = absmax / 127``), with *error feedback*: the residual ``x - dequant(quant(x))`` of this
  worker is kept (one fp32 buffer per parameter) and added to the next pseudo-gradient, so the
  quantization error does not accumulate over syncs (the cumulative error stays below scale/2).
  Why ``all_gather`` rather than ``all_reduce``: summing int8 values in an ``all_reduce`` overflows
  (two workers at +127 wrap around), and the fixes that keep ``all_reduce`` either cost the saving
  (reduce in int32: 4 bytes per element on the wire again) or the precision (agree a shared scale
  via ``all_reduce(MAX)`` and quantize to ``127 // world_size`` levels so the int8 sum cannot
  overflow: only 63 levels at 2 workers, 15 at 8). So each worker ``all_gather``s its int8 payload
  with its scales appended (one collective), and every worker dequantizes the ``world_size``
  contributions and averages them locally in fp32, in the same order, so all workers get
  bit-identical results. Each worker *contributes* ``numel + 4 * chunks`` bytes, but *receives*
  ``(world_size - 1)`` times that, which is fine for the handful of datacenters meshrun targets; for
  many workers a reduce-scatter scheme (what torchft does, below) is bandwidth-optimal.

Buffers: floating-point buffers (e.g. BatchNorm ``running_mean``/``running_var``) are averaged at
each sync (``all_reduce(SUM)`` in their own dtype, then divided; no outer optimizer, no
compression). Integer buffers (e.g. ``num_batches_tracked``) are left as they are. At construction,
parameters and buffers are broadcast from rank 0 of the group (as DDP does) so all workers start
from the same model.

Checkpoints: ``state_dict()`` holds the inner and outer optimizer state, the global copy, the int8
error-feedback buffers, the step counters and the byte counters. Like a torch optimizer's, it is
*per worker* (inner state and error feedback differ between workers: save one file per rank) and
does not include the model: save ``model.state_dict()`` too and load both to resume bit-identically.
Its tensors are shared with live state, so ``torch.save`` it (or deep-copy it) before training on.

How this differs from torchft's ``torchft.local_sgd.DiLoCo`` and from OpenDiLoCo, and why:

- Outer optimizer: torchft takes any user-built outer optimizer (over the model's own parameters,
  which it restores from a backup before the outer step); OpenDiLoCo builds Nesterov SGD over
  ``model.parameters()`` and swaps ``param.data``. meshrun builds the Nesterov SGD itself over a
  separate global copy: fewer ways to get the pairing wrong, and a checkpoint with clear parts.
- Where the global copy lives: torchft and OpenDiLoCo keep it on the CPU (pinned) to save GPU
  memory. meshrun keeps it on the parameter's device (costs 1x parameters, plus 1x outer momentum)
  because NCCL needs device tensors anyway and models trained over meshrun are small-to-medium.
- Fault tolerance: torchft runs each sync under its Manager (quorum, ``should_commit``, recovery
  from live peers, streaming fragments). meshrun has none: a dead worker blocks the collective until
  the process group's timeout; recover by restarting the job from the per-rank checkpoints.
- Compression: torchft quantizes to fp8 with row-wise scales through all-to-all + local reduce +
  all-gather (Triton, CUDA only) and has no error feedback; OpenDiLoCo's torch path sends fp32
  with ``ReduceOp.AVG`` (NCCL only), its hivemind path can send fp16. meshrun offers
  fp16/bf16/int8 on both gloo and NCCL using plain torch.distributed collectives, int8 with error
  feedback, and averages floating-point buffers as well.
- API: torchft hooks the inner optimizer inside a context manager; meshrun is an optimizer-like
  wrapper (``step``/``zero_grad``/``state_dict``), so it drops into an existing loop.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from meshrun.errors import StateError, UsageError

COMPRESSIONS = ("none", "fp16", "bf16", "int8")
INT8_CHUNK = 2048  # elements per int8 scale: 4 bytes of scale per 2048 bytes of payload (0.2 %)
BUCKET_NUMEL = 1 << 24  # elements per collective (64 MiB of fp32); bounds the temporary memory
_WIRE_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
_STATE_FORMAT = "meshrun.train.diloco/1"


def quantize_int8(x: torch.Tensor, chunk: int = INT8_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor to int8 with one fp32 scale per ``chunk`` elements.

    Returns ``(q, scales)``: ``q`` has ``x``'s length, ``scales`` has ``ceil(len / chunk)`` entries.
    ``dequantize_int8(q, scales)`` differs from ``x`` by at most ``scale / 2`` per element (round to
    nearest; ``scale = absmax / 127`` of the chunk, or 1 for an all-zero chunk).
    """
    n = x.numel()
    nchunks = max(1, math.ceil(n / chunk))
    padded = torch.zeros(nchunks * chunk, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(nchunks, chunk)
    absmax = rows.abs().amax(dim=1)
    # absmax == 0 -> scale 1 (all q are 0). NaN/inf stay in the scale on purpose: the receiver's
    # finite check then catches a diverged worker instead of averaging garbage.
    scales = torch.where(absmax == 0, torch.ones_like(absmax), absmax / 127.0)
    q = torch.round(rows / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, chunk: int = INT8_CHUNK) -> torch.Tensor:
    """Invert ``quantize_int8``: fp32 tensor of ``q``'s length."""
    n = q.numel()
    nchunks = scales.numel()
    padded = torch.zeros(nchunks * chunk, dtype=torch.float32, device=q.device)
    padded[:n] = q.to(torch.float32)
    return (padded.view(nchunks, chunk) * scales[:, None]).view(-1)[:n]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name}={value!r} is not an integer >= {minimum}",
                         f"pass {name} as an integer of at least {minimum}")
    return value


def _check_float(name: str, value: Any, lo: float, hi: float, hi_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = lo <= value < hi if hi_open else lo < value <= hi
    if not ok:
        interval = f"[{lo}, {hi})" if hi_open else f"({lo}, {hi}]"
        raise UsageError(f"{name}={value!r} is outside {interval}",
                         f"pass a finite number in {interval} as {name}")
    return float(value)


class DiLoCo:
    """Optimizer wrapper: local inner steps, an averaged outer Nesterov step every ``sync_every``.

    Args:
        model: the bare module being trained (not wrapped in DistributedDataParallel).
        inner_optimizer: a ``torch.optim.Optimizer`` over (some of) ``model``'s parameters; only
            those parameters are synchronized (the others never change locally).
        sync_every: inner steps between syncs (>= 1).
        outer_lr: learning rate of the outer SGD (> 0; the paper uses 0.7).
        outer_momentum: its momentum in [0, 1); Nesterov when > 0 (the paper uses 0.9).
        compression: pseudo-gradient wire format: "none" (fp32), "fp16", "bf16" or "int8".
        process_group: group to average over; default: the default group if
            ``torch.distributed`` is initialized, else none (world size 1, no communication).

    Construction broadcasts the model from rank 0, so every worker of the group must construct it.
    ``step()`` and ``sync_now()`` are collective at sync time: call them on every worker alike.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compression: str = "none",
        process_group: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"model={type(model).__name__} is not a torch.nn.Module",
                             "pass the model being trained")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise UsageError("model is wrapped in DistributedDataParallel, which all-reduces every step",
                             "pass the bare module (model.module); DiLoCo does the synchronization")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise UsageError(f"inner_optimizer={type(inner_optimizer).__name__} is not a torch.optim.Optimizer",
                             "pass e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)")
        self.sync_every = _check_int("sync_every", sync_every, 1)
        self.outer_lr = _check_float("outer_lr", outer_lr, 0.0, math.inf, hi_open=False)
        self.outer_momentum = _check_float("outer_momentum", outer_momentum, 0.0, 1.0, hi_open=True)
        if compression not in COMPRESSIONS:
            raise UsageError(f"compression={compression!r} is not supported",
                             f"use one of {', '.join(repr(c) for c in COMPRESSIONS)}")
        self.compression = compression

        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise UsageError("process_group was given but torch.distributed is not initialized",
                             "call torch.distributed.init_process_group() first, or drop process_group")
        self.process_group = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self._distributed else 1
        self.rank = dist.get_rank(process_group) if self._distributed else 0

        self.model = model
        self.inner_optimizer = inner_optimizer
        opt_params = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in opt_params]
        if len(named) != len(opt_params):
            raise UsageError(f"inner_optimizer holds {len(opt_params) - len(named)} tensor(s) that are "
                             "not parameters of model",
                             "build the inner optimizer from this model's parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]

        if self.world_size > 1:
            self._broadcast_model()
        # Global copy in the parameter's dtype and device (see module docstring).
        self._global = [p.detach().clone() for p in self._params]
        self.outer_optimizer = torch.optim.SGD(self._global, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.outer_momentum > 0)
        self._error_feedback: list[torch.Tensor] | None = None
        if compression == "int8":
            self._error_feedback = [torch.zeros_like(p, dtype=torch.float32) for p in self._params]
        self._buckets = self._make_buckets()

        self.step_count = 0  # inner steps taken
        self.steps_since_sync = 0
        self.sync_count = 0
        self.last_sync_bytes = 0
        self.bytes_sent_total = 0

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the inner optimizer's gradients."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; every ``sync_every``-th call also syncs (collective). Returns the closure's loss."""
        loss = self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()
        self.step_count += 1
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.sync_every:
            self.sync_now()
        return loss

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global copy by parameter name (live tensors; do not modify)."""
        return dict(zip(self._names, self._global))

    # ----------------------------------------------------------------- sync
    @torch.no_grad()
    def sync_now(self) -> None:
        """Sync now (collective): average the pseudo-gradient, outer step, all workers take the result.

        Raises ``UsageError`` when the averaged pseudo-gradient is not finite (fp16 overflow or a
        diverged run); every worker sees the same reduced values, so all of them raise alike.
        """
        nbytes = 0
        for bucket in self._buckets:
            dtype = self._compute_dtype(self._params[bucket[0]])
            flat = torch.cat([(self._global[i].to(dtype) - self._params[i].to(dtype)).reshape(-1)
                              for i in bucket])
            if self._error_feedback is not None:
                flat += torch.cat([self._error_feedback[i].to(dtype).reshape(-1) for i in bucket])
            avg, sent = self._average(flat, bucket)
            nbytes += sent
            if not bool(torch.isfinite(avg).all()):
                raise UsageError(f"the averaged pseudo-gradient is not finite with compression={self.compression!r}",
                                 "use compression='bf16' (fp16 overflows above 65504), or lower the "
                                 "learning rate / sync_every if training diverged")
            offset = 0
            for i in bucket:
                g = self._global[i]
                g.grad = avg[offset:offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for p, g in zip(self._params, self._global):
            p.copy_(g)
        nbytes += self._average_buffers()

        self.last_sync_bytes = nbytes if self.world_size > 1 else 0
        self.bytes_sent_total += self.last_sync_bytes
        self.sync_count += 1
        self.steps_since_sync = 0

    def _average(self, flat: torch.Tensor, bucket: list[int]) -> tuple[torch.Tensor, int]:
        """Average ``flat`` over the group with the configured compression; returns (avg, bytes contributed)."""
        world = self.world_size
        if self.compression == "none":
            if world > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
                flat /= world
            return flat, flat.numel() * flat.element_size()
        if self.compression in _WIRE_DTYPE:
            wire = (flat / world).to(_WIRE_DTYPE[self.compression])
            if world > 1:
                dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.process_group)
            return wire.to(flat.dtype), wire.numel() * wire.element_size()
        # int8: quantize, keep the residual as error feedback, all_gather payload+scales, average locally.
        q, scales = quantize_int8(flat)
        mine = dequantize_int8(q, scales)
        residual = flat - mine
        assert self._error_feedback is not None
        offset = 0
        for i in bucket:
            ef = self._error_feedback[i]
            ef.copy_(residual[offset:offset + ef.numel()].view_as(ef))
            offset += ef.numel()
        # Scales ride along as raw bytes so one collective carries everything; they go first so
        # the receiver's float32 view of them starts at an aligned offset.
        head = scales.numel() * 4
        payload = torch.cat([scales.view(torch.int8), q])
        if world == 1:
            return mine.to(flat.dtype), payload.numel()
        gathered = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(gathered, payload, group=self.process_group)
        total = torch.zeros(q.numel(), dtype=torch.float32, device=flat.device)
        for part in gathered:  # fixed rank order: identical result on every worker
            total += dequantize_int8(part[head:], part[:head].view(torch.float32))
        return (total / world).to(flat.dtype), payload.numel()

    def _average_buffers(self) -> int:
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        if self.world_size == 1 or not buffers:
            return 0
        nbytes = 0
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in buffers:
            groups.setdefault((b.device, b.dtype), []).append(b)
        for group in groups.values():
            flat = torch.cat([b.reshape(-1) for b in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            flat /= self.world_size
            nbytes += flat.numel() * flat.element_size()
            offset = 0
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
        return nbytes

    @torch.no_grad()
    def _broadcast_model(self) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t.data, src=src, group=self.process_group)

    @staticmethod
    def _compute_dtype(p: torch.Tensor) -> torch.dtype:
        # Pseudo-gradients are formed in at least fp32 (a bf16 model's delta would lose the small updates).
        return torch.promote_types(p.dtype, torch.float32)

    def _make_buckets(self) -> list[list[int]]:
        """Group parameter indices by (device, compute dtype), at most BUCKET_NUMEL elements each."""
        buckets: list[list[int]] = []
        open_bucket: dict[tuple[torch.device, torch.dtype], tuple[list[int], int]] = {}
        for i, p in enumerate(self._params):
            key = (p.device, self._compute_dtype(p))
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
        """This worker's DiLoCo state (save one per rank, next to ``model.state_dict()``)."""
        return {
            "format": _STATE_FORMAT,
            "compression": self.compression,
            "sync_every": self.sync_every,
            "world_size": self.world_size,
            "step_count": self.step_count,
            "steps_since_sync": self.steps_since_sync,
            "sync_count": self.sync_count,
            "last_sync_bytes": self.last_sync_bytes,
            "bytes_sent_total": self.bytes_sent_total,
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "global_params": dict(zip(self._names, self._global)),
            "error_feedback": (dict(zip(self._names, self._error_feedback))
                               if self._error_feedback is not None else None),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (load the model's own state dict as well).

        Changing ``compression`` across a resume is allowed: int8 error feedback starts from zero
        when the checkpoint has none and is dropped when the new run is not int8.
        Raises ``StateError`` when the checkpoint does not match this model.
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise StateError("the DiLoCo checkpoint is not in the meshrun.train.diloco/1 format",
                             "pass the dict returned by DiLoCo.state_dict()")
        for key in ("step_count", "steps_since_sync", "sync_count", "inner_optimizer",
                    "outer_optimizer", "global_params", "error_feedback"):
            if key not in state:
                raise StateError(f"the DiLoCo checkpoint lacks {key!r}", "save it with DiLoCo.state_dict()")
        saved = state["global_params"]
        if list(saved) != self._names:
            missing = sorted(set(self._names) - set(saved)) or sorted(set(saved) - set(self._names))
            raise StateError(f"the DiLoCo checkpoint's parameters differ from this model's (e.g. {missing[:3]})",
                             "resume with the same model and inner optimizer as were saved")
        for name, g in zip(self._names, self._global):
            if saved[name].shape != g.shape:
                raise StateError(f"parameter {name!r} has shape {tuple(saved[name].shape)} in the checkpoint "
                                 f"but {tuple(g.shape)} in the model",
                                 "resume with the same model architecture")
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
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
        self.steps_since_sync = int(state["steps_since_sync"])
        self.sync_count = int(state["sync_count"])
        self.last_sync_bytes = int(state.get("last_sync_bytes", 0))
        self.bytes_sent_total = int(state.get("bytes_sent_total", 0))

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, compression={self.compression!r}, "
                f"world_size={self.world_size}, params={self.numel})")

