"""oneDNN-prepacked linears (session/model/cpu/packed_linear.py): what they compute, and what packing changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from session.model.cpu.packed_linear import (
    MIN_FLOAT32_BYTES,
    PackedLinear,
    can_pack,
    pack_linear,
    pack_linears,
    worth_packing,
)
from session.model.runner import ModelRunner, cpu_has_bf16

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN")
needs_bf16 = pytest.mark.skipif(not (can_pack(torch.device("cpu"), torch.bfloat16) and cpu_has_bf16()),
                                reason="no bfloat16 on this CPU (oneDNN's, or the runner's: it falls back to float32)")


def dense_and_packed(dtype: torch.dtype, bias: bool) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    dense = nn.Linear(96, 80, bias=bias).to(dtype)
    packed = nn.Linear(96, 80, bias=bias).to(dtype)
    packed.load_state_dict(dense.state_dict())
    return dense, pack_linear(packed)


@needs_bf16
@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 3, 96)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_is_bit_identical_to_dense(shape, bias):
    """F.linear runs bfloat16 on oneDNN already: packing once changes the speed, not one bit."""
    dense, packed = dense_and_packed(torch.bfloat16, bias)
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), dense(x))


@pytest.mark.parametrize("shape", [(1, 96), (16, 96), (2, 3, 96)], ids=str)
def test_float32_matches_dense_to_rounding(shape):
    dense, packed = dense_and_packed(torch.float32, bias=True)
    x = torch.randn(shape)
    with torch.inference_mode():
        out = packed(x)
        assert out.shape == (*shape[:-1], 80)
        torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-5)


@needs_bf16
def test_packing_replaces_the_dense_weight_in_place():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False))).to(torch.bfloat16)
    first = model[0]
    assert pack_linears([model]) == 2
    assert model[0] is first and type(first) is PackedLinear and isinstance(first, nn.Linear)
    assert (first.in_features, first.out_features) == (8, 16)
    assert "weight" not in dict(first.named_parameters()) and first.packed.is_mkldnn
    assert type(model[2][0]) is PackedLinear and model[2][0].bias is None
    assert pack_linears([model]) == 0  # already packed: nothing left to pack


def test_small_float32_weights_stay_dense():
    """Below MIN_FLOAT32_BYTES a float32 product runs faster on MKL than through oneDNN's set-up."""
    small, large = nn.Linear(128, 384), nn.Linear(512, 512)  # 192 KiB, 1 MiB
    assert MIN_FLOAT32_BYTES == 256 << 10
    assert pack_linears([nn.Sequential(small, large)]) == 1
    assert type(small) is nn.Linear and type(large) is PackedLinear
    # bfloat16: packed at any size, where oneDNN has bfloat16 here
    assert worth_packing(nn.Linear(128, 384).to(torch.bfloat16)) == can_pack(torch.device("cpu"), torch.bfloat16)


@needs_bf16
def test_runner_packs_the_language_model_only_on_request(llama_path):
    packed = ModelRunner(llama_path, device="cpu", dtype="bfloat16", cpu_kernels=False)  # ours: test_cpu_linear
    dense = ModelRunner(llama_path, device="cpu", dtype="bfloat16", pack_weights=False)
    num_layers = packed.info.num_layers
    assert packed.packed_linears == 7 * num_layers + 1  # q, k, v, o, gate, up, down per layer; the head
    assert dense.packed_linears == 0 and type(dense.layers[0].mlp.up_proj) is nn.Linear
    assert type(packed.lm_head) is PackedLinear
    assert packed.lm.embed_tokens.weight.shape == (packed.info.vocab_size, packed.info.hidden_size)
    ids = list(range(3, 40))
    kv_packed = packed.new_kv_cache(block_tokens=16, max_tokens=128)
    kv_dense = dense.new_kv_cache(block_tokens=16, max_tokens=128)
    logits = [r.prefill(kv, r.embed(ids, [])) for r, kv in ((packed, kv_packed), (dense, kv_dense))]
    assert torch.equal(logits[0], logits[1])  # bfloat16: the same bits end to end
    steps = [r.decode([kv], [7]) for r, kv in ((packed, kv_packed), (dense, kv_dense))]
    assert torch.equal(steps[0], steps[1])


def test_float16_and_accelerators_are_not_packed():
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)
    assert can_pack(torch.device("cpu"), torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_dense_reference_is_unchanged_by_packing():
    """A linear packed next to a dense one leaves the dense one's weight untouched."""
    dense, packed = dense_and_packed(torch.float32, bias=False)
    before = dense.weight.clone()
    x = torch.randn(4, 96)
    with torch.inference_mode():
        packed(x)
    assert torch.equal(dense.weight, before)
    assert torch.equal(F.linear(x, dense.weight), dense(x))
