"""Our int8 weight-only linear (csrc/linear_i8.cpp, ``resident::linear_i8``) against the float64
product of the dequantized weights (session/model/quantize.py's ``dequantize_int8``):

- bit for bit where every float32 operation is exact (inputs, weights, scales and bias chosen so that
  each product and partial sum is a float32), so a lane that added a wrong weight, a wrong scale, or
  dropped or doubled a term shows as an unequal bit;
- within two float32 roundings of the sum on random weights (the measure test_quantize.py takes for
  ATen's kernels);
- each row as if alone (any row count, one thread or two), shapes that leave a block of 16 outputs
  part full, and the packed layout itself (``pack_int8``);
- the same with a scale per group of 32 inputs (GGUF's Q8_0, session/model/gguf.py).

The AVX2 build's bits equal the AVX-512 build's: tests/unit/model/cpu/test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from session.model.cpu import linear as cpu_linear
from session.model.quantize import QuantizedLinear, dequantize_int8, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_linear.INT8_KERNEL.load(), reason="kernel not buildable here (no compiler, no AVX2)")

SHAPES = [(64, 64), (100, 1030), (17, 5), (576, 576), (1536, 576)]  # (out, in): part-full blocks, odd widths
PRODUCT_TOLERANCE = 1e-6  # |y - x W^T| per output, over |x| |W|^T + |b| (tests/unit/model/test_quantize.py)


def exact_case(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x in multiples of 1/8 up to 2, q in -127..127, scales and bias powers of two: each product x q is
    a multiple of 1/8 below 2^8, each partial sum below 2^8 k, a float32 (k <= 2^12), so the kernel's
    float32 arithmetic is exact and equals the float64 product bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (rows, k), generator=g).float() / 8
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.exp2(torch.randint(-12, -2, (n,), generator=g).float())
    bias = torch.exp2(torch.randint(-4, 4, (n,), generator=g).float()) * torch.randint(-1, 2, (n,), generator=g)
    return x, q, scales, bias


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bit_for_bit_the_float64_product_where_float32_is_exact(shape):
    n, k = shape
    x, q, scales, bias = exact_case(n, k, 7, seed=n + k)
    packed = cpu_linear.pack_int8(q, scales)
    want = x.double() @ dequantize_int8(q, scales).T + bias.double()
    assert torch.equal(want.float().double(), want)  # the case is exact in float32 indeed
    assert torch.equal(cpu_linear.linear(x, packed, bias, n, k), want.float())
    assert torch.equal(cpu_linear.linear(x, packed, None, n, k), (want - bias.double()).float())
    assert torch.equal(cpu_linear.linear(x[:1], packed, bias, n, k), want[:1].float())  # one row: its own tile


GROUPED = [(64, 64), (100, 1024), (17, 96), (576, 576), (1536, 576)]  # (out, in), groups of 32 inputs


def grouped_scales(n: int, k: int, seed: int) -> torch.Tensor:
    """Powers of two from 2^-4 to 2^-2 per output and group of 32 inputs: each group's part x q scale is
    a multiple of 2^-7 and every sum of parts below 2^6 k, a float32 for k <= 2^11."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-4, -1, (n, k // 32), generator=g).float())


@pytest.mark.parametrize("shape", GROUPED, ids=lambda s: f"{s[0]}x{s[1]}")
def test_groups_bit_for_bit_the_float64_product_where_float32_is_exact(shape):
    n, k = shape
    x, q, _, bias = exact_case(n, k, 7, seed=n + k)
    scales = grouped_scales(n, k, seed=k)
    want = x.double() @ dequantize_int8(q, scales).T + bias.double()
    assert torch.equal(want.float().double(), want)
    linear = QuantizedLinear.from_int8(q, scales, bias, ours=True)
    assert linear.group_size == 32 and linear.block == 32
    assert torch.equal(linear(x), want.float())
    assert torch.equal(linear(x[:1]), want[:1].float())  # one row: its own tile


def test_a_wrong_group_scale_would_show():
    n, k = 64, 96
    x, q, _, bias = exact_case(n, k, 3, seed=2)
    scales = grouped_scales(n, k, seed=3)
    good = cpu_linear.linear(x, cpu_linear.pack_int8(q, scales), bias, n, 32)
    doubled = scales.clone()
    doubled[9, 1] *= 2  # output 9, inputs 32..63
    other = cpu_linear.linear(x, cpu_linear.pack_int8(q, doubled), bias, n, 32)
    assert not torch.equal(other[:, 9], good[:, 9])
    assert torch.equal(other[:, :9], good[:, :9]) and torch.equal(other[:, 10:], good[:, 10:])


def test_a_wrong_weight_or_scale_would_show():
    """The exact case tells one weight or one scale off from the right one (the test above could fail)."""
    n, k = 64, 64
    x, q, scales, bias = exact_case(n, k, 3, seed=1)
    good = cpu_linear.linear(x, cpu_linear.pack_int8(q, scales), bias, n, k)
    nudged = q.clone()
    nudged[5, 7] += 1 if nudged[5, 7] < 127 else -1
    x[:, 7] = 1  # so that weight's change reaches every row
    assert not torch.equal(cpu_linear.linear(x, cpu_linear.pack_int8(nudged, scales), bias, n, k)[:, 5],
                           cpu_linear.linear(x, cpu_linear.pack_int8(q, scales), bias, n, k)[:, 5])
    doubled = scales.clone()
    doubled[9] *= 2
    other = cpu_linear.linear(x, cpu_linear.pack_int8(q, doubled), bias, n, k)
    assert not torch.equal(other[:, 9], cpu_linear.linear(x, cpu_linear.pack_int8(q, scales), bias, n, k)[:, 9])
    assert good.shape == (3, n)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_random_weights_within_two_roundings_of_the_float64_product(shape):
    n, k = shape
    g = torch.Generator().manual_seed(k)
    w, x, bias = torch.randn(n, k, generator=g) * 0.05, torch.randn(9, k, generator=g), torch.randn(n, generator=g)
    q, scales = quantize_int8(w, torch.float32)
    linear = QuantizedLinear.from_int8(q, scales, bias, ours=True)
    dequantized = dequantize_int8(q, scales)
    reference = x.double() @ dequantized.T + bias.double()
    magnitude = x.double().abs() @ dequantized.abs().T + bias.double().abs()
    y = linear(x[None])[0]  # [1, 9, in]: any leading shape
    assert y.dtype == torch.float32 and y.shape == (9, n)
    assert ((y.double() - reference).abs() <= PRODUCT_TOLERANCE * magnitude).all()


def test_each_row_as_if_alone_whatever_the_rows_and_threads():
    n, k = 1536, 576
    g = torch.Generator().manual_seed(3)
    q, scales = quantize_int8(torch.randn(n, k, generator=g), torch.float32)
    packed, x = cpu_linear.pack_int8(q, scales), torch.randn(40, k, generator=g)
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], packed, None, n, k) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 5, 6, 7, 13, 40):  # below, at and past the 6-row tile
                assert torch.equal(cpu_linear.linear(x[:rows], packed, None, n, k), alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_the_packed_layout():
    n, k = 20, 3
    q = torch.arange(n * k, dtype=torch.int8).view(n, k)
    scales = torch.arange(1, n + 1).float() / 4
    packed = cpu_linear.pack_int8(q, scales)
    assert packed.shape == (2, k + 4, 16) and packed.dtype == torch.int8
    assert torch.equal(packed[0, :k], q[:16].T) and torch.equal(packed[1, :k, :4], q[16:].T)
    assert (packed[1, :k, 4:] == 0).all()  # past n
    trailer = packed[:, k:].reshape(2, 64).view(torch.float32)  # [2, 16]
    assert torch.equal(trailer.flatten()[:n], scales) and (trailer.flatten()[n:] == 0).all()


def test_the_packed_layout_with_groups():
    n, k = 20, 64
    q = (torch.arange(n * k) % 200 - 100).to(torch.int8).view(n, k)
    scales = torch.arange(1, 2 * n + 1).float().view(n, 2) / 4  # [n, 2 groups of 32]
    packed = cpu_linear.pack_int8(q, scales)
    assert packed.shape == (2, k + 2 * 4, 16)
    assert torch.equal(packed[0, :k], q[:16].T)
    trailer = packed[:, k:].reshape(2, 2, 64).view(torch.float32)  # [NB, group, 16]
    assert torch.equal(trailer[0, 1], scales[:16, 1]) and torch.equal(trailer[1, 0, :4], scales[16:, 0])
    assert (trailer[1, :, 4:] == 0).all()
