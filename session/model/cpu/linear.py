"""Linears on CPU by our kernel: oneDNN's bits, a decode batch's rows each as if alone. bfloat16 below;
float32 (``linear_f32``) takes the linears oneDNN would (256 KiB and up), in oneDNN's float32 order
(an FMA per input, in blocks of 512), probed the same way against oneDNN's own reordered weights.

torch runs a bfloat16 ``F.linear`` on CPU through oneDNN. For the few rows of a decode step, that
costs a fixed setup per call, about as much as streaming the weight. ``csrc/linear_bf16.cpp`` reads
weights packed once at load for VDPBF16PS (16 outputs by 2 inputs per 64-byte line) and costs a few
microseconds per call: faster for decode rows, a little slower for a long prefill
(``python -m benchmarks.cpu_linear``; docs/MEASUREMENTS.md, "Linears on CPU").

Same bits as oneDNN. Its kernel adds, per output, the products pair after pair in input order, in
blocks of inputs whose sums are then added; the block size is its choice, and on this project's CPU
(AMD, AVX512-BF16, no AMX) it depends on the number of rows: 512 inputs for one row, 1024 for more
(where K > 512). ``probe`` finds those sizes at start-up with inputs whose sum cancels (any other
order of additions changes many outputs: tests/unit/model/cpu/test_cpu_linear.py) and ours takes them:

- a decode step ([B, 1, K]: one new token per sequence) uses the one-row size for every row, so
  each row computes exactly what transformers' batch-of-one decode does, whatever else is in the
  batch (oneDNN would switch sizes at two rows: a session's bits changed with the batch);
- several tokens of a sequence ([B, T, K], T > 1: prefill, extend, verify) use the several-row size,
  as transformers' prefill does.

Where the probe finds no size that reproduces torch (for products under about 16^3 multiply-adds torch
takes its own kernel), those linears stay on oneDNN's packed weights (session/model/cpu/packed_linear.py), and
where the kernel cannot be built (session/model/cpu/kernels.py) all do, with the reason logged: slower, same tokens.

On a CPU with AMX (``bf16_products_use_amx``: an Intel Xeon since Sapphire Rapids) oneDNN multiplies
bfloat16 in AMX tiles, another order of additions that no block size reproduces, and the probe matches
nothing. oneDNN's bits there also depend on the batch: past about 32 rows (K >= 512) a row's bits are
no longer those it gets alone, so with oneDNN a session's logits changed with the batch, and a 50-row
extend (a verify) no longer gave its decode steps' bits. So there the shapes the probe does not match
take ours anyway (``amx_blockings``), with the sizes oneDNN's AVX512-BF16 kernel takes on that CPU
(``avx512_bf16_blocking``; the probe finds them there with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``):
every row as if alone, the C++ layer's steps (session/model/cpu/fused_layer.py), and bits that differ from
oneDNN's AMX ones by rounding (1 bfloat16 ulp in about 1 output in 1,000 on random rows). The price: a
long prefill's linears run several times slower than AMX's (one thread, 512 rows: 5-7x);
``RESIDENT_CPU_KERNELS=0`` keeps oneDNN for all.

Who calls this: ``ModelRunner`` at load (probe, pack), then its forward passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from session.model.cpu.kernels import (
    AVX2,
    AVX2_F16C,
    AVX512,
    AVX512_BF16,
    AVX512_VNNI,
    CppKernel,
    bf16_products_use_amx,
)
from session.model.cpu.packed_linear import swap_weight, worth_packing

logger = logging.getLogger(__name__)

KERNELS = {
    torch.bfloat16: CppKernel("bfloat16 linear", "linear_bf16.cpp", (AVX512_BF16,)),
    torch.float32: CppKernel("float32 linear", "linear_f32.cpp", (AVX512, AVX2)),
}
KERNEL = KERNELS[torch.bfloat16]
INT8_KERNEL = CppKernel("int8 linear", "linear_i8.cpp", (AVX512, AVX2))  # float32 rows, int8 weights
INT4_KERNEL = CppKernel("int4 linear", "linear_i4.cpp", (AVX512, AVX2))  # float32 rows, int4 weights in groups
# int8 or int4 weights times int8-quantized rows (RESIDENT_ACTIVATIONS=int8): integer dot products
Q8_KERNEL = CppKernel("int8-activation linear", "linear_q8.cpp", (AVX512_VNNI, AVX2_F16C))
OPERATORS = {torch.bfloat16: "linear_bf16", torch.float32: "linear_f32", torch.int8: "linear_i8",
             torch.uint8: "linear_i4", torch.int16: "linear_q8"}  # by packed dtype
INT4_GROUP_LINES = 16  # per group, after a block's K lines of 8 bytes: 16 float32 scales and 16 offsets
INT8_SCALE_LINES = 4  # after a block's K lines of 16 int8, per group: its 16 float32 scales (csrc/linear_i8.cpp)
LANES = 16  # outputs per packed block: one float32 lane each
INPUTS = {torch.bfloat16: 2, torch.float32: 1}  # inputs per packed line of 16 outputs (64 bytes)
CANDIDATE_BLOCKS = (512, 1024, 256, 2048, 4096)  # input block sizes the probe tries, in this order
PROBE_ROWS = (2, 9, 64)  # row counts whose block size must agree for the several-row size
PROBE_WEIGHTS = 3  # cancelling weights per shape, each of which must agree
PROBE_OUTPUTS = 1024  # at most this many outputs per probe product (see probe)
# Narrower weights stay on oneDNN: too few outputs for the probe to tell orders apart, and oneDNN splits
# their inputs over threads (another order); none of a real model's linears is that narrow.
MIN_OUTPUTS = 64


def load(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Make ``torch.ops.resident.linear_bf16`` (or ``linear_f32``) available (building it if needed);
    False, with the reason logged, where it cannot be."""
    return KERNELS[dtype].load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [n, K] -> per block of 16 outputs, its lines of 64 bytes: bfloat16 [ceil(n / 16), ceil(K / 2),
    32], per pair of inputs the 32 weights one VDPBF16PS takes (W[o, 2p], W[o, 2p+1] for o in the
    block); float32 [ceil(n / 16), K, 16], per input the block's 16 weights. Zero past n and K."""
    n, k = weight.shape
    inputs = INPUTS[weight.dtype]
    blocks, steps = -(-n // LANES), -(-k // inputs)
    padded = weight.new_zeros(blocks * LANES, steps * inputs)
    padded[:n, :k] = weight
    return padded.view(blocks, LANES, steps, inputs).permute(0, 2, 1, 3).contiguous().view(blocks, steps, inputs * LANES)


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q int8 [n, K] and scales [n] (per output) or [n, K / G] (per output and group of G inputs) ->
    int8 [ceil(n / 16), K + 4 K / G, 16] (csrc/linear_i8.cpp): per block of 16 outputs, its K lines of 16
    weights, then per group its 16 scales in float32 (G = K: one group). Zero past n."""
    n, k = q.shape
    per_group = scales.float().reshape(n, -1)  # [n, groups]
    groups = per_group.shape[1]
    blocks = -(-n // LANES)
    lines = q.new_zeros(blocks * LANES, k)
    lines[:n] = q
    lines = lines.view(blocks, LANES, k).transpose(1, 2)  # [NB, K, 16]
    padded = torch.zeros(blocks * LANES, groups, dtype=torch.float32)
    padded[:n] = per_group
    trailer = padded.view(blocks, LANES, groups).transpose(1, 2).contiguous()  # [NB, groups, 16]
    trailer = trailer.view(torch.int8).view(blocks, groups * INT8_SCALE_LINES, LANES)
    return torch.cat([lines, trailer], dim=1).contiguous()


def int4_offsets(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Per group, the offset our int4 kernel adds: zero - 8 scale in float32 (session/model/quantize.py's
    weight (q - 8) scale + zero is then q scale + offset)."""
    return zeros.float() - 8 * scales.float()


def int4_weight_offsets(scales: torch.Tensor, zeros: torch.Tensor | None, offsets: torch.Tensor | None) -> torch.Tensor:
    """Per group, the offset our int4 kernel adds, float32: ``offsets`` as given (GGUF's Q4_0 and Q4_1),
    else from the zero points (``int4_offsets``)."""
    if offsets is not None:
        return offsets.float()
    if zeros is None:
        raise ValueError("int4 weights need zero points or offsets")
    return int4_offsets(scales, zeros)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The weights our int4 kernel's sums stand for, in float64: q scale + offset (exact in float64),
    with the offset in float32 (``int4_offsets``). The kernel never forms them: per group it sums x q
    and x, then scales (csrc/linear_tiles.h's Int4Lines)."""
    out_features, in_features = q.shape
    groups = scales.shape[1]
    offsets = int4_offsets(scales, zeros).double()[..., None]
    exact = q.double().view(out_features, groups, -1) * scales.float().double()[..., None] + offsets
    return exact.view(out_features, in_features)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              offsets: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, K] in 0..15, scales and zeros [n, K / G] -> uint8 [ceil(n / 16), K + 16 K / G, 8]
    (csrc/linear_i4.cpp): per block of 16 outputs, its K lines of 16 nibbles (byte j: output j low,
    j + 8 high), then per group its 16 scales and 16 offsets (``int4_offsets``) in float32. Zero past n.
    ``offsets`` instead of ``zeros``: each weight q scale + offset as given (GGUF's Q4_1: its mins)."""
    n, k = q.shape
    groups = scales.shape[1]
    blocks = -(-n // LANES)
    padded = q.new_zeros(blocks * LANES, k)
    padded[:n] = q
    lines = padded.view(blocks, 2, LANES // 2, k).to(torch.uint8)  # [NB, low/high, 8, K]
    nibbles = (lines[:, 0] | (lines[:, 1] << 4)).transpose(1, 2)  # [NB, K, 8]
    per_group = torch.zeros(blocks * LANES, groups, 2, dtype=torch.float32)
    per_group[:n, :, 0] = scales.float()
    per_group[:n, :, 1] = int4_weight_offsets(scales, zeros, offsets)
    trailer = per_group.view(blocks, LANES, groups, 2).permute(0, 2, 3, 1).contiguous()  # [NB, G, 2, 16]
    trailer = trailer.view(torch.uint8).view(blocks, groups * INT4_GROUP_LINES, LANES // 2)
    return torch.cat([nibbles, trailer], dim=1).contiguous()


Q8_GROUP = 32  # inputs per group of the int8-activation format (csrc/linear_q8.h)
Q8_ZERO = {8: 128, 4: 0}  # bits -> the zero its unsigned weights are stored from


def pack_q8(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Weights for csrc/linear_q8.h: q [n, K] (8 bits: int8, the weight s q, stored as q + 128; 4 bits:
    0..15, the weight s q + o), scales and offsets [n, K / G] for groups of G (scales [n]: G = K)
    inputs, G a multiple of 32 (each repeated over its groups of 32; offsets None: zero) -> int16 [ceil(n /
    16), K / 32, group bytes / 2]: per block of 16 outputs and group of 32 inputs, L lines of 64 bytes of
    unsigned weights (8 bits: L = 8, line j byte 4l + b = u[l][4j + b]; 4 bits: L = 4, line j byte 4l + b
    = u[l][8j + b] | u[l][8j + 4 + b] << 4), then the 16 scales, then the 16 offsets, in float16 where
    every one is a float16 exactly (GGUF's), else float32; zero past n."""
    n, k = q.shape
    groups, blocks = k // Q8_GROUP, -(-n // LANES)
    scales = scales.reshape(n, -1)  # [n] (one group of K) or [n, K / G]
    per_group = k // scales.shape[1] // Q8_GROUP  # groups of 32 per given group
    unsigned = torch.zeros(blocks * LANES, k, dtype=torch.uint8)
    unsigned[:n] = (q.to(torch.int16) + 128).to(torch.uint8) if bits == 8 else q.to(torch.uint8)
    trailer = torch.zeros(blocks * LANES, groups, 2, dtype=torch.float32)
    trailer[:n, :, 0] = scales.float().repeat_interleave(per_group, dim=1)
    if offsets is not None:
        trailer[:n, :, 1] = offsets.float().repeat_interleave(per_group, dim=1)
    if torch.equal(trailer.half().float(), trailer):
        trailer = trailer.half()
    by_group = unsigned.view(blocks, LANES, groups, Q8_GROUP).permute(0, 2, 1, 3)  # [NB, G, 16, 32]
    if bits == 8:
        lines = by_group.reshape(blocks, groups, LANES, 8, 4).permute(0, 1, 3, 2, 4)  # [NB, G, 8, 16, 4]
    else:
        halves = by_group.reshape(blocks, groups, LANES, 4, 2, 4)  # j, first or second 4 inputs, b
        lines = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 1, 3, 2, 4)  # [NB, G, 4, 16, 4]
    floats = trailer.view(blocks, LANES, groups, 2).permute(0, 2, 3, 1).contiguous()  # [NB, G, 2, 16]
    packed = torch.cat([lines.reshape(blocks, groups, -1), floats.view(torch.uint8).view(blocks, groups, -1)], dim=2)
    return packed.contiguous().view(torch.int16)


def dequantize_q8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weights [n, K] in float64 that ``pack_q8``'s layout holds (tests; the start-up check)."""
    blocks, groups = packed.shape[:2]
    raw = packed.view(torch.uint8)
    size = raw.shape[2]  # 8 or 4 lines of 64 bytes, then 2 lines (float32) or 1 (float16)
    bits = 8 if size in (10 * 64, 9 * 64) else 4
    trailer_bytes = size - (8 if bits == 8 else 4) * 64
    float_type = torch.float32 if trailer_bytes == 128 else torch.float16
    lines = raw[..., : size - trailer_bytes]
    floats = raw[..., size - trailer_bytes:].contiguous().view(float_type).view(blocks, groups, 2, LANES)
    if bits == 8:
        u = lines.reshape(blocks, groups, 8, LANES, 4).permute(0, 3, 1, 2, 4)  # [NB, 16, G, 8, 4]
    else:
        nibbles = lines.reshape(blocks, groups, 4, LANES, 4)
        u = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4).permute(0, 3, 1, 2, 4, 5)  # [NB, 16, G, 4, 2, 4]
    weights = (u.reshape(blocks * LANES, groups, Q8_GROUP).double() - Q8_ZERO[bits])
    scales, offsets = (floats[:, :, i].permute(0, 2, 1).reshape(blocks * LANES, groups).double() for i in (0, 1))
    return (weights * scales[..., None] + offsets[..., None]).view(blocks * LANES, k)[:n]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k_block: int,
           several_from: int | None = None, several_block: int = 0) -> torch.Tensor:
    """x [..., K] -> [..., n] by the kernel, inputs summed in blocks of ``k_block``; ``packed``'s dtype
    names the format (bfloat16 pairs, float32 lines, int8 lines with their groups' scales: ``pack_int8``,
    int4 lines with their groups' scales and offsets: ``pack_int4``; on both ``k_block`` is the group).
    ``several_from`` (bfloat16 and float32): the rows of x's flattened [M, K] from it on sum in blocks of
    ``several_block`` instead."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    op = getattr(torch.ops.resident, OPERATORS[packed.dtype])
    if several_from is None:
        return op(rows, packed, bias, n, k_block).view(*x.shape[:-1], n)
    return op(rows, packed, bias, n, k_block, several_from, several_block).view(*x.shape[:-1], n)


def reference(dtype: torch.dtype):
    """The product ours reproduces, (x, W) -> x W^T: torch's ``F.linear`` in bfloat16 (oneDNN), and in
    float32 oneDNN on its own reordered weight (session/model/cpu/packed_linear.py: what float32 ran on before)."""
    if dtype == torch.bfloat16:
        return F.linear

    def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
    return onednn


def cancelling(rows: int, n: int, k: int, generator: torch.Generator,
               dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K], W [n, K] (of ``dtype``, values exact in bfloat16) whose products cancel: per output, K/8 large weights (2^20 to
    2^27) and their negatives among small ones; row r of x is 2^(r mod 8) everywhere, so a row's sums
    are row 0's scaled exactly (a row mixed up shows). The exact sum is small, and how much of it
    survives depends on the order of additions: another order changes most outputs."""
    x = torch.exp2(torch.arange(rows) % 8).float()[:, None].expand(rows, k).to(dtype)
    w = torch.randn(n, k, generator=generator)
    count = max(1, k // 8)
    order = torch.rand(n, k, generator=generator).argsort(dim=1)
    big = torch.exp2(torch.randint(20, 27, (n, count), generator=generator).float())
    big = big * (1 + torch.randint(0, 127, (n, count), generator=generator).float() / 128)
    w.scatter_(1, order[:, :count], big)
    w.scatter_(1, order[:, count: 2 * count], -big)
    return x, w.to(torch.bfloat16).to(dtype)


@dataclass(frozen=True)
class Blocking:
    """The input block sizes oneDNN sums in for one row and for several, for one weight shape."""

    one_row: int
    rows: int


def avx512_bf16_blocking(k: int) -> Blocking:
    """The sizes oneDNN's AVX512-BF16 kernel sums a K-input product in on an AMX CPU: 512 for one row;
    for several, 512 up to K = 1024 and 1024 past it (what ``probe`` found there for every shape tried, K
    from 77 to 11008, with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``; tests/unit/model/cpu/test_cpu_linear.py
    checks it; the AMD CPU's sizes agree past K = 1024). Taken where the probe matches none (AMX)."""
    return Blocking(512, 512 if k <= 1024 else 1024)


def amx_blockings(shapes: set[tuple[int, int]], dtype: torch.dtype = torch.bfloat16) -> dict[tuple[int, int], Blocking]:
    """The block sizes ours takes for ``shapes`` the probe did not match: on a CPU whose bfloat16
    products take AMX tiles (no size reproduces AMX's order), ``avx512_bf16_blocking``; elsewhere none
    (they stay on oneDNN)."""
    if dtype != torch.bfloat16 or not bf16_products_use_amx():
        return {}
    return {(n, k): avx512_bf16_blocking(k) for n, k in shapes}


def blockings(shapes: set[tuple[int, int]], dtype: torch.dtype = torch.bfloat16) -> dict[tuple[int, int], Blocking]:
    """Per weight shape (n, K), the block sizes ours takes (``pack_linears``): those ``probe`` finds, and
    ``amx_blockings`` for the rest. Shapes left out stay on oneDNN."""
    found = probe(shapes, dtype=dtype)
    return found | amx_blockings(shapes - set(found), dtype)


def probe_shape(n: int, k: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> Blocking | None:
    """The block sizes with which ours equals ``reference(dtype)`` bit for bit for an [n, K] weight,
    on PROBE_WEIGHTS cancelling weights: for one row, and for each of PROBE_ROWS rows at once; None
    where no candidate does (torch takes another kernel for small products, and oneDNN splits the
    inputs of a product too narrow to split its outputs over threads)."""
    single, several = list(CANDIDATE_BLOCKS), list(CANDIDATE_BLOCKS)
    product = reference(dtype)
    for _ in range(PROBE_WEIGHTS):
        x, w = cancelling(max(PROBE_ROWS), n, k, generator, dtype)
        packed = pack(w)

        def matches(block: int, rows: torch.Tensor, packed=packed, w=w) -> bool:
            return torch.equal(linear(rows, packed, None, n, block), product(rows, w))

        single = [block for block in single if matches(block, x[:1])]
        several = [block for block in several if all(matches(block, x[:count]) for count in PROBE_ROWS)]
    return Blocking(single[0], several[0]) if single and several else None


def probe(shapes: set[tuple[int, int]], seed: int = 0,
          dtype: torch.dtype = torch.bfloat16) -> dict[tuple[int, int], Blocking]:
    """Per weight shape (n, K): the sizes ``probe_shape`` finds, at min(n, PROBE_OUTPUTS) outputs
    (wider products always took oneDNN's kernel); shapes none reproduces are left out."""
    generator = torch.Generator().manual_seed(seed)
    probed: dict[tuple[int, int], Blocking | None] = {}  # per probed (capped) shape, once
    with torch.inference_mode():
        for n, k in sorted(shapes):
            capped = (min(n, PROBE_OUTPUTS), k)
            if capped not in probed:
                probed[capped] = probe_shape(*capped, generator, dtype)
    found = {(n, k): probed[(min(n, PROBE_OUTPUTS), k)] for n, k in shapes}
    return {shape: blocking for shape, blocking in found.items() if blocking is not None}


# A packed step's rows ([N, 1, K]: one token each) from this index on are a prefill's tokens, which sum
# in the several-row blocks; the rows before are decode rows (``several_rows_from``). None: by shape.
SEVERAL_ROWS_FROM: ContextVar[int | None] = ContextVar("SEVERAL_ROWS_FROM", default=None)


@contextmanager
def several_rows_from(first: int) -> Iterator[None]:
    """Within this block, a KernelLinear's one-token rows from ``first`` on sum as a prefill's tokens do
    (the several-row blocks), those before as decode rows: a step that packs decode rows and prefill
    chunks into one pass gives each row the bits its own pass would (session/model/packed_step.py)."""
    token = SEVERAL_ROWS_FROM.set(first)
    try:
        yield
    finally:
        SEVERAL_ROWS_FROM.reset(token)


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose bfloat16 weight is packed for our kernel (``packed``). Only forward works.
    One token per sequence (x [..., 1, K]) sums in the one-row blocks, several in the several-row ones;
    in a packed step (``several_rows_from``) the rows from its index on in the several-row ones."""

    packed: torch.Tensor
    one_row_block: int
    rows_block: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one = x.dim() < 2 or x.shape[-2] == 1
        first = SEVERAL_ROWS_FROM.get()
        if one and first is not None and self.one_row_block != self.rows_block:
            return linear(x, self.packed, self.bias, self.out_features, self.one_row_block, first, self.rows_block)
        return linear(x, self.packed, self.bias, self.out_features, self.one_row_block if one else self.rows_block)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", packed=resident (blocks {self.one_row_block}/{self.rows_block})"


def kernel_linears(modules: list[nn.Module], dtype: torch.dtype = torch.bfloat16) -> list[nn.Linear]:
    """The plain ``nn.Linear`` modules of ``dtype`` inside ``modules`` with at least MIN_OUTPUTS outputs
    that oneDNN would take (session/model/cpu/packed_linear.py: float32 weights of MIN_FLOAT32_BYTES and up; the
    smaller ones run MKL's product, transformers' own bits), each once."""
    found: dict[int, nn.Linear] = {}
    for root in modules:
        for module in root.modules():
            if (worth_packing(module) and module.weight.dtype == dtype
                    and module.out_features >= MIN_OUTPUTS):
                found[id(module)] = module
    return list(found.values())


def pack_linears(modules: list[nn.Module], dtype: torch.dtype = torch.bfloat16) -> tuple[int, str]:
    """Turn the linears of ``dtype`` inside ``modules`` whose shape the probe matched into KernelLinears,
    in place (the dense weight is dropped): (how many, why the others were not, or "")."""
    linears = kernel_linears(modules, dtype)
    if not linears:
        return 0, f"no {dtype} linears oneDNN would take"
    if not load(dtype):
        return 0, "the kernel could not be built (see the log)"
    shapes = {(module.out_features, module.in_features) for module in linears}
    blocking = probe(shapes, dtype=dtype)
    amx = amx_blockings(shapes - set(blocking), dtype)
    if amx:
        logger.info("%s linears %s: no block size reproduces oneDNN's AMX product; ours takes them with "
                    "AVX512-BF16's sizes (its bits differ from torch's here by rounding)", dtype, sorted(amx))
        blocking |= amx
    for module in linears:
        shape = (module.out_features, module.in_features)
        if shape in blocking:
            kernel_linear = swap_weight(module, KernelLinear, pack(module.weight.detach()))
            kernel_linear.one_row_block = blocking[shape].one_row
            kernel_linear.rows_block = blocking[shape].rows
    unmatched = sorted(shapes - set(blocking))
    why = f"no input block size reproduces torch's product for [out, in] = {unmatched}" if unmatched else ""
    return sum(type(module) is KernelLinear for module in linears), why
