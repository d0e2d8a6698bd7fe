"""Wire formats for DiLoCo's pseudo-gradients that are averaged by ``all_gather``: int8, FP8, FP4, int2,
and sparse top-k; and the orthonormal DCT that DeMo (meshrun.train.demo) compresses momentum in.

Each format turns a 1-D float tensor into one ``uint8`` payload (block scales first, then the
packed codes) and back. A worker ``all_gather``s its payload, decodes every worker's contribution
and averages them locally in rank order, so the sum never overflows a narrow integer type and
every worker gets bit-identical results (see ``meshrun.train.diloco``, which adds error feedback).

- ``int8``: one fp32 scale per ``INT8_CHUNK`` (2048) elements, ``scale = absmax / 127``, round to
  nearest: ``n + 4 * ceil(n / 2048)`` bytes, error at most ``scale / 2`` per element.
- ``fp8``: FP8 E4M3 (``torch.float8_e4m3fn``: 1 sign, 4 exponent, 3 mantissa bits, largest 448; what
  torchft sends its outer gradients in), one bf16 scale per ``FP8_BLOCK`` (128) elements,
  ``scale = absmax / 448``: ``n + 2 * ceil(n / 128)`` bytes (1.016 per element), relative error
  at most 2^-4 per element above the block's subnormal range. torchft keeps one fp32 scale per row
  and no error feedback (a reduce-scatter in fp8); here the block is fixed (rows of a pseudo-gradient
  can be 10^5 long, one outlier would flatten the rest) and the residual is fed back.
- ``fp4``: FP4 E2M1 (the element type of the OCP MX and NVIDIA NVFP4 formats: 1 sign, 2 exponent,
  1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes per byte, one bf16 scale per
  ``FP4_BLOCK`` (128) elements, ``scale = absmax / 6``, round to the nearest grid value:
  ``ceil(n / 2) + 2 * ceil(n / 128)`` bytes (0.516 per element). Why E2M1 rather than int4
  (levels -7..7 with the same block scale): pseudo-gradients are heavy-tailed, and a float grid
  spends its levels near zero where most elements are. Relative squared error measured on 2^20
  samples, 128-element blocks: Gaussian int4 1.38 % vs E2M1 1.19 %, Laplace 2.58 % vs 1.47 %,
  Student-t(3) 4.80 % vs 2.17 %. (Streaming DiLoCo, arXiv 2501.18512, sent E3M0, 4-bit floats
  without mantissa: 3.70 % on the Gaussian.)
- ``int2``: four levels -1.5, -0.5, 0.5, 1.5 times the block's RMS (the uniform 4-level
  quantizer that is optimal for Gaussian data: 11.7 % relative squared error; absmax scaling
  would give 30 %), values beyond clamp to +-1.5 RMS, four codes per byte, one bf16 scale per
  ``INT2_BLOCK`` (128): ``ceil(n / 4) + 2 * ceil(n / 128)`` bytes (0.266 per element). Usable
  only with error feedback, which carries what the clamp and the coarse grid leave out to the
  next sync (as MuLoCo, arXiv 2505.23725, and SparseLoCo, arXiv 2508.15706, do with 2 bits).
- ``sparse-int2`` / ``sparse-fp4`` (SparseLoCo, arXiv 2508.15706): the input is cut into chunks and
  only the ``k = round(density * chunk)`` largest magnitudes of each chunk are sent: their values in
  int2 or fp4 (blocks of 128 values, as above), then their positions in the chunk, packed in
  ``log2(chunk)`` bits each. The chunk is ``sparse_chunk(density)``: the power of two nearest
  ``1 / density``, at least ``SPARSE_CHUNK_MIN`` (64), so that at the default density 1/64 each run of 64
  elements sends its largest one, with a 6-bit position: 8.125 bits per value sent with int2 (its
  bf16 scale per 128 values included), 0.0159 bytes per element, 17x less than dense int2. (Four of
  every 256 with one-byte positions cost 10.125 bits per value: 25 % more, for a freer choice; on
  benchmarks/diloco_wan.py, 600 steps at H = 20, the held-out loss was the same within 0.2 %.)
  Everything not sent stays in the error feedback. SparseLoCo tiles 2-D tensors in 64x64 and packs
  12-bit indices; here the flattened bucket is cut in runs.

An all-zero block decodes to zeros. Non-finite input reaches the scale, so the
receiver's finite check catches a diverged worker instead of averaging garbage.

One format is summed instead of gathered, so that what a worker receives does not grow with the workers:

- ``sparse-shared`` (``SharedSparse``): the positions are chosen by *one* worker per sync, in turn (the
  leader: ScaleCom's cyclic local top-k, Chen et al., NeurIPS 2020, arXiv 2104.11125), from its own
  error-fed pseudo-gradient, with the same top-k per chunk as ``sparse-int2``; the leader broadcasts them
  with one bf16 scale per 128 selected values (its block's largest magnitude times ``SHARED_CLIP``); every
  worker then quantizes *its* values at those positions on that shared grid to int8 codes of at most
  ``127 // world_size`` levels, and the codes are ``all_reduce``d: their sum cannot overflow, and it is exact,
  so every worker decodes the same average (int16 codes beyond 18 workers, where int8 would leave each fewer
  than 7 levels a side). Per sync a worker sends ``k`` bytes through a ring all-reduce
  (``2 (n - 1) / n`` on the wire) and the leader the header once: about 0.031 bytes per element at density
  1/64 for any number of workers, where ``sparse-int2``'s gather puts ``(n - 1) * 0.0159`` on every worker's
  link (0.11 at 8 workers). What a worker does not send, because the leader did not pick it or the grid
  clipped or rounded it, stays in its error feedback and is sent when another leader picks it. Vectors
  (biases, norm scales) are summed the same way, dense.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from meshrun.core.presets import SPARSE_CHUNK_MAX, chunk_selection, sparse_chunk

INT8_CHUNK = 2048  # elements per int8 scale: 4 bytes of scale per 2048 bytes of payload (0.2 %)
FP4_BLOCK = 128  # elements per fp4 scale: 2 bytes of scale per 64 bytes of codes (3 %)
INT2_BLOCK = 128  # elements per int2 scale: 2 bytes of scale per 32 bytes of codes (6 %)
FP8_BLOCK = 128  # elements per fp8 scale: 2 bytes of scale per 128 bytes of codes (1.6 %)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_DENSITY = 1 / 64  # sparse formats: share of each chunk sent (k = 1 of 64)
_E2M1 = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_GRID = torch.tensor([-v for v in reversed(_E2M1)] + [0.0] + list(_E2M1))  # 15 values, codes 0..14
INT2_GRID = torch.tensor([-1.5, -0.5, 0.5, 1.5])


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (any shape) as fp32 rows of ``block`` elements, zero-padded at the end."""
    n = x.numel()
    rows = max(1, math.ceil(n / block))
    padded = torch.zeros(rows * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    return padded.view(rows, block)


def quantize_int8(x: torch.Tensor, chunk: int = INT8_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor to int8 with one fp32 scale per ``chunk`` elements.

    Returns ``(q, scales)``: ``q`` has ``x``'s length, ``scales`` has ``ceil(len / chunk)`` entries.
    ``dequantize_int8(q, scales)`` differs from ``x`` by at most ``scale / 2`` per element (round to
    nearest; ``scale = absmax / 127`` of the chunk, or 1 for an all-zero chunk).
    """
    rows = _blocks(x, chunk)
    absmax = rows.abs().amax(dim=1)
    scales = torch.where(absmax == 0, torch.ones_like(absmax), absmax / 127.0)
    q = torch.round(rows / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[: x.numel()], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, chunk: int = INT8_CHUNK) -> torch.Tensor:
    """Invert ``quantize_int8``: fp32 tensor of ``q``'s length."""
    return (_blocks(q, chunk) * scales[:, None]).view(-1)[: q.numel()]


def quantize_grid(x: torch.Tensor, grid: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Round ``x / scale`` (one scale per ``block`` elements) to the nearest value of the sorted ``grid``.

    Returns the grid indices, ``8 // bits`` per byte (element ``i`` in bits ``bits * (i % per_byte)``
    of byte ``i // per_byte``), as uint8 of ``ceil(len / per_byte)`` bytes. A zero scale (an
    all-zero block) decodes to zeros whatever its codes.
    """
    rows = _blocks(x, block)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    midpoints = (grid[1:] + grid[:-1]) / 2
    # Beyond the grid's ends values clamp to them (bucketize's first and last bucket).
    codes = torch.bucketize(rows / safe[:, None], midpoints.to(x.device)).to(torch.uint8).view(-1)
    per_byte = 8 // bits
    n = x.numel()
    codes = codes[: math.ceil(n / per_byte) * per_byte].view(-1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)
    return (codes << shifts).sum(dim=1, dtype=torch.uint8) if per_byte > 1 else codes.view(-1)


def dequantize_grid(
    packed: torch.Tensor, scales: torch.Tensor, n: int, grid: torch.Tensor, bits: int, block: int
) -> torch.Tensor:
    """Invert ``quantize_grid``: fp32 tensor of ``n`` elements."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = ((packed[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:n]
    values = grid.to(packed.device)[codes.long()]
    return (_blocks(values, block) * scales.float()[:, None]).view(-1)[:n]


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers below ``2 ** bits`` (1..16 bits) into uint8, least significant bit first.

    Value ``i`` takes bits ``bits * i`` .. ``bits * (i + 1) - 1`` of the stream: ``ceil(len * bits / 8)`` bytes.
    """
    shifts = torch.arange(bits, dtype=torch.int32, device=values.device)
    stream = ((values.to(torch.int32).view(-1, 1) >> shifts) & 1).view(-1)
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8)).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.int32, device=values.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Invert ``pack_bits``: the first ``n`` values, as int64."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    stream = ((packed.to(torch.int32).view(-1, 1) >> shifts) & 1).view(-1)[: n * bits].view(n, bits)
    return (stream << torch.arange(bits, dtype=torch.int32, device=packed.device)).sum(dim=1).long()


def quantize_fp4(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor to FP4 E2M1 codes, two per byte, one bf16 scale per ``block``.

    Returns ``(packed, scales)``: ``packed`` is uint8 of ``ceil(len / 2)`` bytes, ``scales`` bf16
    of ``ceil(len / block)`` entries (``absmax / 6``). Every element is within half a grid step of
    ``dequantize_fp4``'s result: at most ``scale`` for the largest magnitudes (grid 4..6),
    ``scale / 4`` below 2.
    """
    scales = (_blocks(x, block).abs().amax(dim=1) / FP4_GRID[-1]).to(torch.bfloat16)
    return quantize_grid(x, FP4_GRID, scales, 4, block), scales


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = FP4_BLOCK) -> torch.Tensor:
    """Invert ``quantize_fp4``: fp32 tensor of ``n`` elements."""
    return dequantize_grid(packed, scales, n, FP4_GRID, 4, block)


def quantize_int2(x: torch.Tensor, block: int = INT2_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor to 2-bit codes (grid -1.5, -0.5, 0.5, 1.5 times the block's RMS).

    Returns ``(packed, scales)``: uint8 of ``ceil(len / 4)`` bytes and bf16 scales, one per ``block``.
    """
    rows = _blocks(x, block)
    counts = (x.numel() - block * torch.arange(rows.shape[0], device=x.device)).clamp(max=block)  # last one: padded
    scales = (rows.pow(2).sum(dim=1) / counts).sqrt().to(torch.bfloat16)
    return quantize_grid(x, INT2_GRID, scales, 2, block), scales


def dequantize_int2(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = INT2_BLOCK) -> torch.Tensor:
    """Invert ``quantize_int2``: fp32 tensor of ``n`` elements."""
    return dequantize_grid(packed, scales, n, INT2_GRID, 2, block)


def quantize_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor to FP8 E4M3 (``torch.float8_e4m3fn``) with one bf16 scale per ``block``.

    Returns ``(codes, scales)``: float8 codes of ``x``'s length and bf16 scales (``absmax / 448``).
    Each element is within 2^-4 of its magnitude of ``dequantize_fp8``'s result (round to nearest
    even on the 3-bit mantissa), or within ``scale * 2^-10`` in the block's subnormal range.
    """
    rows = _blocks(x, block)
    scales = (rows.abs().amax(dim=1) / FP8_MAX).to(torch.bfloat16)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    # The bf16 scale can round below absmax / 448: clamp so the block's largest element stays finite
    # (some torch builds do not saturate the cast: beyond 448 it gives NaN).
    codes = (rows / safe[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(-1)[: x.numel()], scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, n: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """Invert ``quantize_fp8``: fp32 tensor of ``n`` elements."""
    return (_blocks(codes.float(), block) * scales.float()[:, None]).view(-1)[:n]


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` (n x n): coefficients ``c = D @ x``, and back ``x = D.T @ c``.

    ``D[k, i] = s_k cos(pi (2i + 1) k / 2n)`` with ``s_0 = sqrt(1/n)``, ``s_k = sqrt(2/n)``: scipy's
    ``dct(type=2, norm="ortho")``. Built in float64, then cast, so every process gets the same bits.
    """
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(dtype=dtype, device=device)


class GatherCodec:
    """A pseudo-gradient format averaged by ``all_gather``: one uint8 payload per worker.

    ``encode(x)`` returns ``(payload, approx)``: the bytes this worker sends and what they decode
    to (the error-feedback residual is ``x - approx``). ``decode(payload, n)`` reads any worker's
    payload back. ``payload_bytes(n)`` is the payload's length for ``n`` elements.
    """

    def __init__(
        self,
        quantize: Callable,
        dequantize: Callable,
        block: int,
        scale_dtype: torch.dtype,
        bits: int,
        code_dtype: torch.dtype = torch.uint8,
    ) -> None:
        self.quantize, self.dequantize = quantize, dequantize
        self.block, self.scale_dtype, self.bits, self.code_dtype = block, scale_dtype, bits, code_dtype
        self.scale_size = torch.tensor([], dtype=scale_dtype).element_size()

    def _head(self, n: int) -> int:
        return self.scale_size * max(1, math.ceil(n / self.block))

    def payload_bytes(self, n: int) -> int:
        return self._head(n) + math.ceil(n * self.bits / 8)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = self.quantize(x, self.block)
        # Scales go first so the receiver's view of them starts at an aligned offset.
        payload = torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)])
        return payload, self.decode(payload, x.numel())

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        head = self._head(n)
        codes = payload[head:].view(self.code_dtype)
        return self.dequantize(codes, payload[:head].view(self.scale_dtype), n, self.block)


class SparseCodec:
    """Top-k per chunk (SparseLoCo's sparsifier), values in a ``GatherCodec``: one uint8 payload per worker.

    Same interface as ``GatherCodec``. The payload is the values' payload (its scales first, so they stay
    aligned) followed by the positions, chunk by chunk in ascending order, packed in ``position_bits``
    bits each. ``chunk`` defaults to ``sparse_chunk(density)``; ``k = round(density * chunk)``, at least 1.
    """

    def __init__(self, values: GatherCodec, density: float, chunk: int | None = None) -> None:
        chunk = sparse_chunk(density) if chunk is None else chunk
        if not 2 <= chunk <= SPARSE_CHUNK_MAX:
            raise ValueError(f"chunk {chunk} is outside 2..{SPARSE_CHUNK_MAX} (positions up to 16 bits)")
        self.values, self.chunk, self.density = values, chunk, density
        self.k, self.position_bits = chunk_selection(density, chunk)

    def _rows(self, n: int) -> int:
        return max(1, math.ceil(n / self.chunk))

    def payload_bytes(self, n: int) -> int:
        sent = self._rows(n) * self.k
        return self.values.payload_bytes(sent) + math.ceil(sent * self.position_bits / 8)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _blocks(x, self.chunk)
        # Sorted positions: the payload is canonical (the same selection always gives the same bytes).
        idx = rows.abs().topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
        payload, approx = self.values.encode(rows.gather(1, idx).reshape(-1))
        dense = torch.zeros_like(rows).scatter_(1, idx, approx.view_as(idx).to(rows.dtype))
        return torch.cat([payload, pack_bits(idx, self.position_bits)]), dense.view(-1)[: x.numel()]

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        m = self._rows(n)
        sent = m * self.k
        head = self.values.payload_bytes(sent)
        values = self.values.decode(payload[:head], sent).view(m, self.k)
        idx = unpack_bits(payload[head:], self.position_bits, sent).view(m, self.k)
        dense = torch.zeros(m, self.chunk, dtype=torch.float32, device=payload.device)
        return dense.scatter_(1, idx, values).view(-1)[:n]


CODECS = {
    "int8": GatherCodec(
        quantize_int8,
        lambda q, s, n, block: dequantize_int8(q, s, block),
        INT8_CHUNK,
        torch.float32,
        8,
        code_dtype=torch.int8,
    ),
    "fp8": GatherCodec(quantize_fp8, dequantize_fp8, FP8_BLOCK, torch.bfloat16, 8, code_dtype=torch.float8_e4m3fn),
    "fp4": GatherCodec(quantize_fp4, dequantize_fp4, FP4_BLOCK, torch.bfloat16, 4),
    "int2": GatherCodec(quantize_int2, dequantize_int2, INT2_BLOCK, torch.bfloat16, 2),
}
SPARSE = {"sparse-fp4": "fp4", "sparse-int2": "int2"}  # sparse format -> the format of its values
SHARED_BLOCK = 128  # selected values per bf16 scale in sparse-shared's header
SHARED_CLIP = 2.0  # sparse-shared's grid spans the leader's block maximum times this (others' values may be larger)
SHARED_MIN_LEVELS = 7  # sparse-shared: fewer levels per worker than this in int8, and the codes go int16


class SharedSparse:
    """``sparse-shared``: top-k per chunk chosen by one worker, every worker's values summed as int8 codes.

    A sync: the leader calls ``header(matrices, vectors)`` (positions and scales, uint8, ``header_bytes`` long)
    and broadcasts it; every worker calls ``contribution(header, matrices, vectors, world)`` for its int8 codes
    and what they decode to (its error-feedback residual is the input minus that), all-reduces the codes
    (SUM), and ``average(header, summed, n_matrices, world)`` gives the matrices' and the vectors' mean, the
    same bits on every worker.
    """

    def __init__(self, density: float, chunk: int | None = None) -> None:
        chunk = sparse_chunk(density) if chunk is None else chunk
        if not 2 <= chunk <= SPARSE_CHUNK_MAX:
            raise ValueError(f"chunk {chunk} is outside 2..{SPARSE_CHUNK_MAX} (positions up to 16 bits)")
        self.chunk, self.density = chunk, density
        self.k, self.position_bits = chunk_selection(density, chunk)

    @staticmethod
    def code_dtype(world: int) -> torch.dtype:
        """int8 while it leaves every worker at least SHARED_MIN_LEVELS levels each side (up to 18 workers), else
        int16 (2 bytes a value, up to 4681 workers)."""
        return torch.int8 if 127 // max(1, world) >= SHARED_MIN_LEVELS else torch.int16

    @staticmethod
    def levels(world: int) -> int:
        """Largest code magnitude per worker: ``world`` of them sum within the code type."""
        top = 127 if SharedSparse.code_dtype(world) == torch.int8 else 32767
        return max(1, top // max(1, world))

    def _rows(self, n: int) -> int:
        return max(1, math.ceil(n / self.chunk))

    def values(self, n_matrices: int, n_vectors: int) -> int:
        """How many values a worker sends: k per chunk of the matrices, every vector element."""
        return self._rows(n_matrices) * self.k + n_vectors

    def header_bytes(self, n_matrices: int, n_vectors: int) -> int:
        return 2 * math.ceil(self.values(n_matrices, n_vectors) / SHARED_BLOCK) + math.ceil(
            self._rows(n_matrices) * self.k * self.position_bits / 8
        )

    def header(self, matrices: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """The leader's choice: bf16 scales (then packed positions, chunk by chunk, ascending), as uint8."""
        rows = _blocks(matrices, self.chunk)
        idx = rows.abs().topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
        chosen = torch.cat([rows.gather(1, idx).reshape(-1), vectors.reshape(-1).float()])
        scales = (_blocks(chosen, SHARED_BLOCK).abs().amax(dim=1) * SHARED_CLIP).to(torch.bfloat16)
        return torch.cat([scales.view(torch.uint8), pack_bits(idx, self.position_bits)])

    def _read(self, header: torch.Tensor, n_matrices: int, n_vectors: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions as (rows, k) int64, one fp32 scale per value)."""
        total = self.values(n_matrices, n_vectors)
        head = 2 * math.ceil(total / SHARED_BLOCK)
        scales = header[:head].view(torch.bfloat16).float().repeat_interleave(SHARED_BLOCK)[:total]
        m = self._rows(n_matrices)
        idx = unpack_bits(header[head:], self.position_bits, m * self.k).view(m, self.k)
        return idx, scales

    def contribution(
        self, header: torch.Tensor, matrices: torch.Tensor, vectors: torch.Tensor, world: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This worker's int8 codes on the leader's grid, and what they decode to: (codes, matrices', vectors')."""
        idx, scales = self._read(header, matrices.numel(), vectors.numel())
        rows = _blocks(matrices, self.chunk)
        chosen = torch.cat([rows.gather(1, idx).reshape(-1), vectors.reshape(-1).float()])
        levels = self.levels(world)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.where(scales > 0, torch.round(chosen / safe * levels).clamp(-levels, levels), 0)
        codes = codes.to(self.code_dtype(world))
        mine = self._dense(idx, codes.float() * scales / levels, matrices.numel())
        return codes, mine[: matrices.numel()], mine[matrices.numel() :]

    def average(self, header: torch.Tensor, summed: torch.Tensor, n_matrices: int, world: int) -> torch.Tensor:
        """The mean of every worker's contribution from the summed codes: matrices, then vectors, fp32."""
        n_vectors = summed.numel() - self._rows(n_matrices) * self.k
        idx, scales = self._read(header, n_matrices, n_vectors)
        return self._dense(idx, summed.float() * scales / (self.levels(world) * world), n_matrices)

    def _dense(self, idx: torch.Tensor, values: torch.Tensor, n_matrices: int) -> torch.Tensor:
        """Selected values back into the matrices' positions (zeros elsewhere), then the vectors."""
        sent = idx.numel()
        dense = torch.zeros(idx.shape[0], self.chunk, dtype=torch.float32, device=values.device)
        dense.scatter_(1, idx, values[:sent].view_as(idx))
        return torch.cat([dense.view(-1)[:n_matrices], values[sent:]])


def make_codec(name: str, density: float = DEFAULT_DENSITY) -> GatherCodec | SparseCodec | SharedSparse | None:
    """The codec of format ``name`` (``density``: the sparse formats' share); None for the formats that are
    all-reduced as floats ("none", "fp16", "bf16")."""
    if name == "sparse-shared":
        return SharedSparse(density)
    if name in SPARSE:
        return SparseCodec(CODECS[SPARSE[name]], density)
    return CODECS.get(name)
