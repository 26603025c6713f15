"""Our int4 weight-only linear (csrc/linear_i4.cpp, ``resident::linear_i4``) against the float64
product of its dequantized weights (session/model/cpu/linear.py's ``dequantize_int4``: each weight
q scale + offset, the offset zero - 8 scale in float32):

- bit for bit where every float32 operation is exact (inputs, scales, offsets and bias chosen so that
  each weight, product and partial sum is a float32), so a wrong nibble, scale, offset or group shows;
- within float32 rounding of the sum on random weights, with every weight within half a level of the
  float weight it came from;
- each row as if alone (any row count, one thread or two), part-full blocks, the packed layout.

The AVX2 build's bits equal the AVX-512 build's: tests/unit/model/cpu/test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from session.model.cpu import linear as cpu_linear
from session.model.quantize import QuantizedLinear, quantize_int4

pytestmark = pytest.mark.skipif(not cpu_linear.INT4_KERNEL.load(), reason="kernel not buildable here (no compiler, no AVX2)")

SHAPES = [(64, 128, 32), (100, 256, 128), (20, 64, 64), (576, 576, 64), (576, 1536, 128),
          (100, 45, 15)]  # (out, in, group); an odd group: its lines two at a time, then one
PRODUCT_TOLERANCE = 1e-6  # |y - x W^T| per output, over |x| |W|^T + |b| (tests/unit/model/test_quantize.py)


def exact_case(n: int, k: int, group: int, rows: int, seed: int):
    """x in multiples of 1/8 up to 2, q in 0..15, scales powers of two from 2^-6 to 2^-3 and zeros
    multiples of 2^-6 below 1: each weight q scale + zero - 8 scale is a multiple of 2^-6 below 2^5,
    each product a multiple of 2^-9, each partial sum below 2^6 k: float32 throughout (k <= 2^12)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    x = torch.randint(-16, 17, (rows, k), generator=g).float() / 8
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.exp2(torch.randint(-6, -2, (n, groups), generator=g).float())
    zeros = torch.randint(-64, 64, (n, groups), generator=g).float() / 64
    bias = torch.randint(-8, 9, (n,), generator=g).float() / 4
    return x, q, scales, zeros, bias


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_bit_for_bit_the_float64_product_where_float32_is_exact(shape):
    n, k, group = shape
    x, q, scales, zeros, bias = exact_case(n, k, group, 7, seed=n + k)
    packed = cpu_linear.pack_int4(q, scales, zeros)
    dequantized = cpu_linear.dequantize_int4(q, scales, zeros)
    exact = q.double().view(n, k // group, group) * scales.double()[..., None] + (zeros.double() - 8 * scales.double())[..., None]
    assert torch.equal(dequantized, exact.view(n, k))  # the weights are exact float32 values here
    want = x.double() @ dequantized.T + bias.double()
    assert torch.equal(want.float().double(), want)
    assert torch.equal(cpu_linear.linear(x, packed, bias, n, group), want.float())
    assert torch.equal(cpu_linear.linear(x[:1], packed, bias, n, group), want[:1].float())  # one row: its own tile


def test_a_wrong_nibble_scale_or_offset_would_show():
    n, k, group = 32, 64, 32
    x, q, scales, zeros, bias = exact_case(n, k, group, 2, seed=5)
    x[:, 40] = 1
    good = cpu_linear.linear(x, cpu_linear.pack_int4(q, scales, zeros), bias, n, group)
    nibble = q.clone()
    nibble[21, 40] = (nibble[21, 40] + 1) % 16  # output 21: a high nibble of its block's second half
    scale = scales.clone()
    scale[3, 1] *= 2
    zero = zeros.clone()
    zero[30, 0] += 0.5
    for (qq, ss, zz), output in (((nibble, scales, zeros), 21), ((q, scale, zeros), 3), ((q, scales, zero), 30)):
        other = cpu_linear.linear(x, cpu_linear.pack_int4(qq, ss, zz), bias, n, group)
        assert not torch.equal(other[:, output], good[:, output])
        keep = [o for o in range(n) if o != output]
        assert torch.equal(other[:, keep], good[:, keep])  # and nothing else moved


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_random_weights_within_rounding_of_the_float64_product(shape):
    n, k, group = shape
    g = torch.Generator().manual_seed(k)
    w, x, bias = torch.randn(n, k, generator=g) * 0.05, torch.randn(9, k, generator=g), torch.randn(n, generator=g)
    q, scales, zeros = quantize_int4(w, group, torch.float32)
    dequantized = cpu_linear.dequantize_int4(q, scales, zeros)
    levels = scales.double().repeat_interleave(group, dim=1)
    assert ((w.double() - dequantized).abs() <= levels * (0.5 + 1e-5)).all()  # within half a level of w
    linear = QuantizedLinear.from_int4(q, scales, zeros, bias, ours=True)
    reference = x.double() @ dequantized.T + bias.double()
    magnitude = x.double().abs() @ dequantized.abs().T + bias.double().abs()
    y = linear(x[None])[0]
    assert y.dtype == torch.float32 and y.shape == (9, n)
    assert ((y.double() - reference).abs() <= PRODUCT_TOLERANCE * magnitude).all()


def test_each_row_as_if_alone_whatever_the_rows_and_threads():
    n, k, group = 1536, 576, 64
    g = torch.Generator().manual_seed(3)
    packed = cpu_linear.pack_int4(*quantize_int4(torch.randn(n, k, generator=g), group, torch.float32))
    x = torch.randn(40, k, generator=g)
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], packed, None, n, group) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 5, 6, 7, 13, 40):
                assert torch.equal(cpu_linear.linear(x[:rows], packed, None, n, group), alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_the_packed_layout():
    n, k = 20, 4  # groups of 2 inputs
    q = (torch.arange(n * k) % 16).view(n, k).int()
    scales = torch.arange(1, 2 * n + 1).float().view(n, 2) / 4
    zeros = -torch.arange(2 * n).float().view(n, 2)
    packed = cpu_linear.pack_int4(q, scales, zeros)
    assert packed.shape == (2, k + 2 * 16, 8) and packed.dtype == torch.uint8
    assert torch.equal(packed[0, :k].int() & 15, q[:8].T) and torch.equal(packed[0, :k].int() >> 4, q[8:16].T)
    assert torch.equal(packed[1, :k, :4].int() & 15, q[16:20].T) and (packed[1, :k, 4:] & 15 == 0).all()
    trailer = packed[:, k:].reshape(2, 2, 2, 64).view(torch.float32)  # [NB, group, scales/offsets, 16]
    assert torch.equal(trailer[0, 1, 0], scales[:16, 1])
    assert torch.equal(trailer[0, 0, 1], zeros[:16, 0] - 8 * scales[:16, 0])
    assert (trailer[1, :, :, 4:] == 0).all()  # past n
