"""DeMo (decoupled momentum): data-parallel training that sends only the fast-moving part of the momentum.

Use it instead of DistributedDataParallel's gradient all-reduce: keep the bare model (no DDP wrapper,
or DDP under ``no_sync()``), and step this optimizer, which is collective::

    from meshrun.train.demo import DeMo
    opt = DeMo(model.parameters(), lr=1e-3, compression="int2")      # the default process group
    for batch in loader:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()

Algorithm (Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870;
the reference is bloc97/DeMo's ``demo.py``). Every worker keeps its own momentum ``m`` per parameter,
never averaged. Each step:

1. ``m = momentum_decay * m + lr * grad`` (with the worker's own gradient);
2. ``m`` is cut into chunks of ``chunk`` elements (the flattened tensor, zero-padded at its end), each
   chunk is taken to the frequency domain by an orthonormal DCT-II (``meshrun.train.compress.dct_matrix``,
   a fixed matrix), and the ``k = round(density * chunk)`` largest coefficients of each chunk are
   kept: the fast-moving components;
3. their values are encoded (``compression``: "none" fp32, "bf16", "fp8", "fp4" or "int2") and what
   was sent, as the receivers will decode it, is *removed from the local momentum* (the decoupling: the
   rest keeps accumulating until it is large enough to be sent);
4. every worker ``all_gather``s the values and the positions (``log2(chunk)`` bits each, packed: 6 at
   the default chunk of 64), decodes all contributions in rank order, averages them and takes them back
   by the inverse DCT;
5. the update is ``-lr * sign(average)`` (``sign=True``, DeMo's signum) or ``-lr * average``, plus
   decoupled weight decay ``p *= 1 - lr * weight_decay`` first.

Every worker applies the same update computed from the same bytes in the same order, so replicas that
start identical stay bit-identical on the same kind of device (construction compares digests and
broadcasts rank 0's parameters when they differ; every ``check_every`` steps the digests are compared
again and a mismatch raises ``StateError`` naming the ranks). Where this differs from the reference:
chunks are 1-D runs of the flattened tensor (the reference uses 2-D tiles of matrices, 64 x 64), the
DCT is one matrix product per chunk, positions are packed bits, and the average is a plain mean over
workers (the reference's scatter "mean" averages only over the workers that sent a position; after
``sign`` both give the same update).

Bytes: a step sends the values plus ``ceil(numel / chunk) * k`` positions; at the defaults (chunk 64,
density 1/32: 2 of every 64, bf16 values) 0.086 bytes per parameter, 47x less than DDP's 4 (fp32
gradients); with int2 values 0.032 (126x). ``bytes_sent_total`` counts this worker's payload, ``ddp_equivalent_bytes``
DDP's for the same steps, ``comm_blocked_s`` the time spent waiting for the all_gather.

Memory: two extra fp32 copies of the model while a step runs (the selected coefficients and the
average), plus the momentum. In a ``--mixed-accelerators`` job (gloo group, accelerator parameters)
payloads travel through CPU memory; the update is computed on each worker's device, so replicas on
different kinds of device may differ in the last bit, which the state check reports.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from meshrun.core.presets import chunk_selection
from meshrun.errors import StateError, UsageError
from meshrun.train.compress import CODECS, dct_matrix, pack_bits, unpack_bits
from meshrun.train.snapshots import state_digest

VALUE_FORMATS = ("none", "bf16", "fp8", "fp4", "int2")
DEFAULT_CHUNK = 64
DEFAULT_DENSITY = 1 / 32


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x`` flattened into fp32 rows of ``chunk`` elements, zero-padded at the end."""
    rows = max(1, math.ceil(x.numel() / chunk))
    padded = torch.zeros(rows * chunk, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x.reshape(-1)
    return padded.view(rows, chunk)


def _check(name: str, ok: bool, value: Any, must: str, example: str) -> None:
    if not ok:
        raise UsageError(f"{name}={value!r} {must}", f"pass e.g. {name}={example}")


class _Values:
    """The values of the selected coefficients on the wire: raw fp32 / bf16 bytes, or a block codec."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.codec = CODECS.get(fmt)

    def payload_bytes(self, n: int) -> int:
        if self.codec is not None:
            return self.codec.payload_bytes(n)
        return n * (4 if self.fmt == "none" else 2)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.codec is not None:
            return self.codec.encode(x)
        wire = x.float() if self.fmt == "none" else x.to(torch.bfloat16)
        return wire.view(torch.uint8), wire.float()

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        if self.codec is not None:
            return self.codec.decode(payload, n)
        return payload.view(torch.float32 if self.fmt == "none" else torch.bfloat16).float()[:n]


class DeMo(torch.optim.Optimizer):
    """Optimizer that replaces DDP's all-reduce: local momentum, its top DCT components averaged over workers.

    Args:
        params: the parameters (or param groups, each may set ``lr`` and ``weight_decay``); the same
            tensors, in the same order, on every worker.
        lr: step size (> 0) of the signum update; also scales what enters the momentum.
        momentum_decay: beta in [0, 1) of ``m = beta * m + lr * grad`` (the paper uses 0.999).
        density: share of each chunk's DCT coefficients sent per step, in (0, 1].
        chunk: elements per DCT chunk, 2..256 (a chunk costs chunk^2 multiply-adds per step).
        compression: the values' format: "none" (fp32), "bf16", "fp8", "fp4" or "int2".
        sign: apply ``sign`` to the averaged update (DeMo's signum); False: use the average itself.
        weight_decay: decoupled weight decay (>= 0).
        process_group: the group to average over; default: the default group when torch.distributed
            is initialized, else none (world size 1: the same math, nothing sent).
        check_every: compare the parameters' digests over the group every this many steps (0: never).

    Construction and ``step()`` are collective: every worker of the group calls them alike. A
    parameter without a gradient contributes zeros (all workers must agree on the layout).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum_decay: float = 0.999,
        density: float = DEFAULT_DENSITY,
        chunk: int = DEFAULT_CHUNK,
        compression: str = "bf16",
        sign: bool = True,
        weight_decay: float = 0.0,
        process_group: Any = None,
        check_every: int = 100,
    ) -> None:
        num = (int, float)
        _check("lr", isinstance(lr, num) and math.isfinite(lr) and lr > 0, lr, "is not a positive number", "1e-3")
        _check(
            "momentum_decay",
            isinstance(momentum_decay, num) and 0 <= momentum_decay < 1,
            momentum_decay,
            "is outside [0, 1)",
            "0.999",
        )
        _check("density", isinstance(density, num) and 0 < density <= 1, density, "is outside (0, 1]", "0.03125")
        _check(
            "chunk",
            isinstance(chunk, int) and not isinstance(chunk, bool) and 2 <= chunk <= 256,
            chunk,
            "is not an integer in 2..256 (the DCT of a chunk costs chunk^2 per step)",
            "64",
        )
        _check(
            "compression",
            compression in VALUE_FORMATS,
            compression,
            "is not a value format",
            "'bf16' (or 'none', 'fp8', 'fp4', 'int2')",
        )
        _check("weight_decay", isinstance(weight_decay, num) and weight_decay >= 0, weight_decay, "is negative", "0.0")
        _check(
            "check_every",
            isinstance(check_every, int) and not isinstance(check_every, bool) and check_every >= 0,
            check_every,
            "is not an integer >= 0",
            "100",
        )
        super().__init__(params, {"lr": float(lr), "weight_decay": float(weight_decay)})
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "process_group was given but torch.distributed is not initialized",
                "call torch.distributed.init_process_group() first, or drop process_group",
            )
        self.momentum_decay = float(momentum_decay)
        self.density, self.chunk, self.compression = float(density), chunk, compression
        self.k, self._position_bits = chunk_selection(density, chunk)
        self.sign, self.check_every = bool(sign), check_every
        self.process_group = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self._distributed else 1
        self.rank = dist.get_rank(process_group) if self._distributed else 0
        self._values = _Values(compression)
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not self._params:
            raise UsageError("DeMo got no parameters that require grad", "pass model.parameters()")
        self._rows = [max(1, math.ceil(p.numel() / chunk)) for p in self._params]
        device = self._params[0].device
        self._dct = dct_matrix(chunk, device=device)
        # A gloo group cannot always take accelerator tensors: payloads then go through CPU memory.
        self._comm_device = device
        if self._distributed and device.type != "cpu" and dist.get_backend(process_group) == "gloo":
            self._comm_device = torch.device("cpu")
        self.step_count = 0
        self.bytes_sent_total = 0
        self.last_step_bytes = 0
        self.comm_blocked_s = 0.0
        for p in self._params:
            self.state[p]["delta"] = torch.zeros_like(p, dtype=torch.float32)
        if self.world_size > 1:
            self._align()

    # ------------------------------------------------------------------ counters
    @property
    def numel(self) -> int:
        """Number of parameter elements this optimizer updates."""
        return sum(p.numel() for p in self._params)

    @property
    def payload_bytes_per_step(self) -> int:
        """Bytes this worker contributes per step: encoded values plus packed positions."""
        sent = sum(self._rows) * self.k
        return self._values.payload_bytes(sent) + math.ceil(sent * self._position_bits / 8)

    @property
    def ddp_equivalent_bytes(self) -> int:
        """Bytes DDP would have contributed for the steps taken so far (fp32 gradients every step)."""
        return self.step_count * 4 * self.numel if self.world_size > 1 else 0

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def _select(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fold the gradients into the momentum, pick each chunk's top DCT coefficients, remove what is sent.

        Returns (positions uint8 (rows, k), payload of the values, decoded values (rows, k)).
        """
        rows = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                m = self.state[p]["delta"]
                m.mul_(self.momentum_decay)
                if p.grad is not None:
                    m.add_(p.grad.to(m.dtype), alpha=group["lr"])
                rows.append(_chunks(m, self.chunk))
        coeffs = torch.cat(rows) @ self._dct.T
        idx = coeffs.abs().topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
        payload, approx = self._values.encode(coeffs.gather(1, idx).reshape(-1))
        approx = approx.view_as(idx).to(coeffs.dtype)
        # What the receivers will decode leaves the local momentum; the rest waits for a later step.
        sent = torch.zeros_like(coeffs).scatter_(1, idx, approx) @ self._dct
        offset = 0
        for p, n_rows in zip(self._params, self._rows):
            m = self.state[p]["delta"]
            m.sub_(sent[offset : offset + n_rows].reshape(-1)[: m.numel()].view_as(m))
            offset += n_rows
        return idx.to(torch.uint8), payload, approx

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step (collective): momentum, compression, all_gather, the averaged update. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["weight_decay"]:
                for p in group["params"]:
                    if p.requires_grad:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
        idx, values, approx = self._select()
        total_rows = idx.shape[0]
        if self.world_size > 1:
            # Values first: their block scales stay aligned for the receiver's view as bf16 / fp32.
            mine = torch.cat([values, pack_bits(idx, self._position_bits)]).to(self._comm_device)
            gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
            work = dist.all_gather(gathered, mine, group=self.process_group, async_op=True)
            t = time.perf_counter()
            work.wait()
            self.comm_blocked_s += time.perf_counter() - t
            self.last_step_bytes = mine.numel()
            self.bytes_sent_total += mine.numel()
            sent = total_rows * self.k
            head = self._values.payload_bytes(sent)
            total = torch.zeros(total_rows, self.chunk, dtype=torch.float32, device=self._dct.device)
            for part in gathered:  # fixed rank order: the same sum on every worker
                part = part.to(self._dct.device)
                vals = self._values.decode(part[:head], sent).view(total_rows, self.k)
                pos = unpack_bits(part[head:], self._position_bits, sent).view(total_rows, self.k)
                total += torch.zeros_like(total).scatter_(1, pos, vals)
            average = total / self.world_size
        else:
            average = torch.zeros(total_rows, self.chunk, dtype=torch.float32, device=self._dct.device)
            average.scatter_(1, idx.long(), approx)
        update = average @ self._dct
        if self.sign:
            update = update.sign()
        offset = 0
        position = 0
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                n_rows = self._rows[position]
                u = update[offset : offset + n_rows].reshape(-1)[: p.numel()].view_as(p)
                p.add_(u.to(p.dtype), alpha=-group["lr"])
                offset += n_rows
                position += 1
        self.step_count += 1
        if self.check_every and self.world_size > 1 and self.step_count % self.check_every == 0:
            self.verify_state()
        return loss

    # ------------------------------------------------------------------ replicas
    def _gather_ints(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64, device=self._comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.process_group)
        return [t.tolist() for t in out]

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.process_group, group_rank) if self.process_group is not None else group_rank

    @torch.no_grad()
    def _align(self) -> None:
        """Start from one model: broadcast rank 0's parameters when the workers' digests differ."""
        digests = [row[0] for row in self._gather_ints([state_digest(self._params)])]
        if len(set(digests)) == 1:
            return
        for p in self._params:
            staged = p.data if p.device == self._comm_device else p.data.to(self._comm_device)
            dist.broadcast(staged, src=self._global_rank(0), group=self.process_group)
            if staged is not p.data:
                p.data.copy_(staged)
            if self.rank == 0:
                self.bytes_sent_total += p.numel() * p.element_size() * (self.world_size - 1)

    def verify_state(self) -> None:
        """Check now that every worker holds bit-identical parameters (collective); ``StateError`` if not."""
        if self.world_size == 1:
            return
        digests = [row[0] for row in self._gather_ints([state_digest(self._params)])]
        majority = max(digests, key=lambda d: (digests.count(d), -digests.index(d)))
        odd = [r for r, d in enumerate(digests) if d != majority]
        if odd:
            agree = [r for r, d in enumerate(digests) if d == majority]
            raise StateError(
                f"the DeMo replicas differ after step {self.step_count}: rank(s) {odd} disagree with rank(s) {agree}",
                "a worker diverged (different parameters at the start, a parameter changed outside the "
                "optimizer, or devices of different kinds); restart from a checkpoint",
            )
