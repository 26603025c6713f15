"""Our LoRA delta kernel for decode rows (csrc/lora.h; session/model/lora.py's LoRALinear and the C++
decode layer call it): y + ((x A^T) * mask) B^T, against float64, for a slot's slice of the bank (rows
with a stride), ranks and widths that are not whole vectors, a mix's mask, and bad shapes refused."""

import pytest
import torch

from session.model.cpu import fused_layer
from session.model.runner import cpu_has_bf16


def available(dtype: torch.dtype) -> bool:
    return (dtype == torch.float32 or cpu_has_bf16()) and fused_layer.load(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,fan_in,rank,fan_out", [(1, 512, 8, 512), (5, 100, 5, 37), (16, 1376, 40, 512)])
@pytest.mark.parametrize("masked", [False, True])
def test_delta_equals_float64(dtype, rows, fan_in, rank, fan_out, masked):
    if not available(dtype):
        pytest.skip("the kernel cannot be built here")
    generator = torch.Generator().manual_seed(rows + rank)
    bank_a = torch.randn(3, fan_in, 64, generator=generator).to(dtype)  # [slots, in, r_max]: a slot's slice strides
    bank_b = torch.randn(3, 64, fan_out, generator=generator).to(dtype)
    a, b = bank_a[1, :, :rank], bank_b[1, :rank]
    x = torch.randn(rows, fan_in, generator=generator).to(dtype)
    y = torch.randn(rows, fan_out, generator=generator).to(dtype)
    mask = (torch.rand(rows, rank, generator=generator) > 0.5).to(dtype) if masked else None
    h = x.double() @ a.double()
    if masked:
        h = h * mask.double()
    expected = y.double() + h @ b.double()
    got = y.clone()
    fused_layer.op("lora_add", dtype)(got, x, a, b, mask)
    scale = expected.abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7  # float32 sums; bfloat16: one rounding of y
    assert (got.double() - expected).abs().max().item() <= tolerance * scale
    assert not torch.equal(got, y)


def test_bad_shapes_are_refused():
    if not available(torch.float32):
        pytest.skip("the kernel cannot be built here")
    y, x = torch.zeros(2, 8), torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match="lora"):
        fused_layer.op("lora_add", torch.float32)(y, x, torch.zeros(5, 3), torch.zeros(3, 8), None)
    with pytest.raises(RuntimeError, match="mask"):
        fused_layer.op("lora_add", torch.float32)(y, x, torch.zeros(4, 3), torch.zeros(3, 8), torch.zeros(2, 2))
