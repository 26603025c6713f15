"""The int8-activation linear (csrc/linear_q8.h, ``resident::linear_q8``; RESIDENT_ACTIVATIONS=int8):

- the rows' quantization (``quantize_rows_q8``) against a NumPy reference: per group of 32, scale =
  max |x| / 127, q = x / scale rounded to nearest even, the sum of q;
- the product against the float64 product of the quantized rows and the packed weights
  (``dequantize_q8``): within float32 rounding of the group parts, int8 and int4, part-full blocks,
  every row as if alone; bit for bit where every float step is exact;
- the packed layout (``pack_q8``) reading back the weights given, and a wrong weight or scale showing;
- against the float32-input product: off by the rows' rounding only (a bound from the scales).

The AVX2 build's bits equal the AVX512-VNNI build's: tests/unit/model/cpu/test_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from session.model.cpu import linear as cpu_linear
from session.model.quantize import QuantizedLinear

pytestmark = pytest.mark.skipif(not cpu_linear.Q8_KERNEL.load(), reason="kernel not buildable here")

SHAPES = [(64, 64), (100, 576), (192, 576), (576, 1536), (17, 32)]  # (out, in)
TOLERANCE = 1e-6  # |y - reference| over the reference on |x| and |W|


def weights(bits: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q, offsets = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8), None
    else:
        q, offsets = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32), -torch.rand(n, k // 32, generator=g) / 16
    return q, torch.rand(n, k // 32, generator=g) / 64, offsets


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own quantization of x: (q [M, K] float64, scales [M, K / 32], sums [M, K / 32])."""
    raw = torch.ops.resident.quantize_rows_q8(x)
    k, groups = x.shape[1], x.shape[1] // 32
    return (raw[:, :k].double(), raw[:, k:k + 4 * groups].contiguous().view(torch.float32),
            raw[:, k + 4 * groups:].contiguous().view(torch.int32))


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, scales, _ = quantized_rows(x)
    rows, k = x.shape
    return (q.view(rows, -1, 32) * scales.double()[..., None]).view(rows, k) @ w.T


def test_rows_are_quantized_per_32_as_llama_cpps_q8():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[2, 32:64] = 0  # an all-zero group: scale 0, q 0
    q, scales, sums = quantized_rows(x)
    groups = x.double().numpy().reshape(5, 3, 32)
    scale = (np.abs(groups).max(axis=2) / 127).astype(np.float32)
    inverse = np.where(scale > 0, 1 / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    want = np.clip(np.rint(groups.astype(np.float32) * inverse[..., None]), -127, 127)
    assert torch.equal(scales, torch.from_numpy(scale))
    assert torch.equal(q, torch.from_numpy(want.reshape(5, 96)).double())
    assert torch.equal(sums, torch.from_numpy(want.sum(axis=2).astype(np.int32)))
    assert scales[2, 1] == 0 and (q[2, 32:64] == 0).all() and int(q.abs().max()) == 127


@pytest.mark.parametrize("bits", [8, 4])
def test_the_layout_holds_the_weights_given(bits):
    n, k = 20, 64
    q, scales, offsets = weights(bits, n, k, seed=1)
    packed = cpu_linear.pack_q8(q, scales, offsets, bits)
    assert packed.dtype == torch.int16 and packed.shape == (2, 2, (10 if bits == 8 else 6) * 32)
    want = q.double().view(n, 2, 32) * scales.double()[..., None]
    if offsets is not None:
        want += offsets.double()[..., None]
    assert torch.equal(cpu_linear.dequantize_q8(packed, n, k), want.view(n, k))
    raw = packed.view(torch.uint8)
    if bits == 8:  # line j, byte 4l + b: output l's input 4j + b, stored + 128
        assert int(raw[0, 1, 2 * 64 + 4 * 3 + 1]) == int(q[3, 32 + 4 * 2 + 1]) + 128
    else:  # line j, byte 4l + b: output l's inputs 8j + b (low nibble) and 8j + 4 + b (high)
        byte = int(raw[1, 0, 1 * 64 + 4 * 2 + 3])
        assert (byte & 15, byte >> 4) == (int(q[18, 8 + 3]), int(q[18, 8 + 4 + 3]))
    assert (raw[1, :, : raw.shape[2] - 128].reshape(-1, 16, 4)[:, 4:] == 0).all()  # past n: zero, as its scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_within_rounding_of_the_float64_product_of_the_quantized_rows(bits, shape):
    n, k = shape
    q, scales, offsets = weights(bits, n, k, seed=n + k)
    packed = cpu_linear.pack_q8(q, scales, offsets, bits)
    w = cpu_linear.dequantize_q8(packed, n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    y = cpu_linear.linear(x, packed, bias, n, 32)
    want = reference(x, w) + bias.double()
    magnitude = reference(x.abs(), w.abs()) + bias.double().abs()
    assert ((y.double() - want).abs() <= TOLERANCE * magnitude).all()
    # every row as if alone, whatever the batch
    for row in (0, 4, 8):
        assert torch.equal(cpu_linear.linear(x[row:row + 1], packed, bias, n, 32), y[row:row + 1])
    # against float32 rows: off by at most half a step of each group's scale per input
    step = quantized_rows(x)[1].double().repeat_interleave(32, dim=1) / 2
    assert ((y.double() - (x.double() @ w.T + bias.double())).abs() <= step @ w.abs().T * (1 + 1e-6) + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_bit_for_bit_where_every_float_step_is_exact(bits):
    """Rows whose groups quantize exactly (max |x| = 127 * 2^-7: x = q 2^-7), power-of-two scales and
    offsets in multiples of 2^-7: every part and sum is a float32."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-127, 128, (3, k), generator=g).float() / 128
    x[:, ::32] = 127 / 128  # each group's max: its scale is 2^-7 exactly
    q, _, _ = weights(bits, n, k, seed=12)
    scales = torch.exp2(torch.randint(-6, -3, (n, k // 32), generator=g).float())
    offsets = None if bits == 8 else torch.randint(-16, 16, (n, k // 32), generator=g).float() / 128
    packed = cpu_linear.pack_q8(q, scales, offsets, bits)
    assert packed.shape[2] == (9 if bits == 8 else 5) * 32  # every scale and offset a float16: stored so
    want = x.double() @ cpu_linear.dequantize_q8(packed, n, k).T
    assert torch.equal(quantized_rows(x)[0] / 128, x.double())  # the rows quantize exactly
    assert torch.equal(want.float().double(), want)
    assert torch.equal(cpu_linear.linear(x, packed, None, n, 32), want.float())
    assert torch.equal(cpu_linear.linear(x[:1], packed, None, n, 32), want[:1].float())  # one row: its own tile
    changed = q.clone()
    changed[7, 70] = changed[7, 70] + (1 if int(changed[7, 70]) < (127 if bits == 8 else 15) else -1)
    other = cpu_linear.linear(x, cpu_linear.pack_q8(changed, scales, offsets, bits), None, n, 32)
    assert not torch.equal(other[:, 7], want.float()[:, 7]) and torch.equal(other[:, 8:], want.float()[:, 8:])


def test_quantized_linears_take_the_layout_and_keep_their_weights():
    n, k = 64, 256
    g = torch.Generator().manual_seed(5)
    q8, scales8 = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8), torch.rand(n, generator=g) / 64
    linear = QuantizedLinear.from_int8(q8, scales8, None, ours=True, int8_rows=True)
    assert linear.int8_rows and linear.block == 32
    assert torch.equal(cpu_linear.dequantize_q8(linear.packed, n, k), q8.double() * scales8.double()[:, None])
    q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales4, zeros = torch.rand(n, 2, generator=g) / 64, torch.rand(n, 2, generator=g) - 0.5  # groups of 128
    linear = QuantizedLinear.from_int4(q4, scales4, zeros, None, ours=True, int8_rows=True)
    assert linear.int8_rows and linear.method == "int4"
    assert torch.equal(cpu_linear.dequantize_q8(linear.packed, n, k), cpu_linear.dequantize_int4(q4, scales4, zeros))
