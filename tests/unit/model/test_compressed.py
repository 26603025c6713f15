"""compressed-tensors checkpoints kept packed (session/model/compressed.py), on the demo Llama.

Each scheme is made in memory by the library itself (model_store/build_compressed.py's ``compress``:
the parameters a loaded checkpoint holds), then ``keep_packed`` replaces the decoder linears. Its
internal check (our weights == the library's ``dequantize``, element for element) decides what is
kept, so the counts below fail if a layout is read wrong; the forward is compared with the same
model decompressed by the library."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_store.build_compressed import compress
from session.model import compressed, gguf
from session.model.quantize import QuantizedLinear

LINEARS = 7 * 3  # q, k, v, o, gate, up, down in each of 3 layers


@pytest.fixture(autouse=True, scope="module")
def kernels():
    """Our int8/int4 kernels, loaded as the runner loads them before ``keep_packed``."""
    cpu = torch.device("cpu")
    assert gguf.can_keep(cpu, torch.float32, True) == "" and gguf.can_keep(cpu, torch.float32, True, True) == ""


def compressed_llama(scheme: str):
    from transformers import AutoModelForCausalLM

    from model_store.build_text_models import ensure

    model = AutoModelForCausalLM.from_pretrained(ensure(["llama"])["llama"], dtype=torch.float32).eval()
    compress(model, scheme)
    return model


def decompressed(model):
    """The same model as the library serves it: every quantized module decompressed to float."""
    from compressed_tensors.compressors.base import decompress_module

    for _, module in compressed.quantized_modules(model):
        decompress_module(module, leave_decompressed=False)
    return model


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("scheme, kind", [("w4a16", {"int4 (per channel)": 18, "int4 (groups of 64)": 3}),  # 64 inputs: one group
                                          ("w4a16-asym", {"int4 (groups of 32)": LINEARS}),
                                          ("w8a16", {"int8 (per channel)": LINEARS}),
                                          ("w4a16-channel", {"int4 (per channel)": LINEARS})])
def test_each_scheme_is_kept_packed_and_computes_the_librarys_weights(scheme, kind):
    model, reference = compressed_llama(scheme), decompressed(compressed_llama(scheme))
    assert compressed.is_compressed(model) is False  # built in memory: no quantization_config in its config
    report = compressed.keep_packed(model, list(model.model.layers), "")
    assert (report.kept, report.dequantized) == (kind, {})
    assert all(isinstance(linear, QuantizedLinear) and linear.ours for linear in
               (model.model.layers[0].self_attn.q_proj, model.model.layers[2].mlp.down_proj))
    assert type(model.lm_head) is nn.Linear and compressed.quantized_modules(model) == []
    ids = [5, 9, 17, 33, 2, 64, 7]
    ours, theirs = logits(model, ids), logits(reference, ids)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.argmax(dim=-1), theirs.argmax(dim=-1))


def test_asymmetric_int8_and_why_float_are_decompressed_with_the_reason():
    model = compressed_llama("w8a16-asym")
    report = compressed.keep_packed(model, list(model.model.layers), "")
    assert report.kept == {} and report.dequantized == {"asymmetric int8 (our int8 kernel has no zero points)": LINEARS}
    assert "decompressed to float by compressed-tensors: 21 asymmetric int8" in report.describe()
    model = compressed_llama("w4a16")
    report = compressed.keep_packed(model, list(model.model.layers), "RESIDENT_QUANTIZATION=none")
    assert report.kept == {} and report.dequantized == {"RESIDENT_QUANTIZATION=none": LINEARS}
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.Linear and q_proj.weight.dtype == torch.float32 and not hasattr(q_proj, "weight_packed")
    assert getattr(q_proj, "quantization_scheme", None) is None
    ids = [5, 9, 17]
    assert torch.equal(logits(model, ids), logits(decompressed(compressed_llama("w4a16")), ids))


def test_int8_rows_take_the_kept_integers():
    model, reference = compressed_llama("w4a16"), decompressed(compressed_llama("w4a16"))
    report = compressed.keep_packed(model, list(model.model.layers), "", int8_rows=True)
    assert report.int8_rows and report.num_kept == LINEARS and "inputs quantized to int8 per 32" in report.describe()
    assert model.model.layers[0].mlp.up_proj.int8_rows
    ids = [5, 9, 17, 33]
    assert torch.equal(logits(model, ids).argmax(dim=-1), logits(reference, ids).argmax(dim=-1))
