"""Integer checkpoints kept packed (session/model/compressed.py), on the demo Llama.

Each compressed-tensors scheme is written by the library itself (model_store/build_compressed.py:
``apply_quantization_config``, ``ModelCompressor``), loaded dequantized by transformers, then
``keep_packed`` rebuilds the decoder linears from the file's integers. Its check (our weights == the
library's dense ones) decides what is kept, so the counts below fail if a layout is read wrong; the
forward is compared with the dense model. An AutoAWQ checkpoint goes through the library's
AutoAWQConverter first, and is compared with the weights it was written from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_store.build_compressed import awq_quantize, awq_weights, build, build_awq
from session.model import compressed, gguf
from session.model.quantize import QuantizedLinear

LINEARS = 7 * 3  # q, k, v, o, gate, up, down in each of 3 layers


@pytest.fixture(autouse=True, scope="module")
def kernels():
    """Our int8/int4 kernels, loaded as the runner loads them before ``keep_packed``."""
    cpu = torch.device("cpu")
    assert gguf.can_keep(cpu, torch.float32, True) == "" and gguf.can_keep(cpu, torch.float32, True, True) == ""


@pytest.fixture(scope="module")
def source() -> Path:
    from model_store.build_text_models import ensure

    return Path(ensure(["llama"])["llama"])


@pytest.fixture(scope="module")
def checkpoints(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    return lambda scheme: build(source, scheme, root / scheme)


def dense(folder: Path):
    """transformers' model of the checkpoint, dequantized by compressed-tensors."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                **compressed.load_kwargs("compressed-tensors")).eval()


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("scheme, kind", [("w4a16", {"int4 (per channel)": 18, "int4 (groups of 64)": 3}),  # 64 inputs
                                          ("w4a16-asym", {"int4 (groups of 32)": LINEARS}),
                                          ("w8a16", {"int8 (per channel)": LINEARS}),
                                          ("w4a16-channel", {"int4 (per channel)": LINEARS})])
def test_each_scheme_is_kept_packed_and_computes_the_librarys_weights(checkpoints, scheme, kind):
    folder = checkpoints(scheme)
    model, reference = dense(folder), dense(folder)
    report = compressed.keep_packed(model, list(model.model.layers), str(folder), "compressed-tensors", "")
    assert (report.kept, report.dequantized) == (kind, {})
    assert all(isinstance(linear, QuantizedLinear) and linear.ours for linear in
               (model.model.layers[0].self_attn.q_proj, model.model.layers[2].mlp.down_proj))
    ids = [5, 9, 17, 33, 2, 64, 7]
    ours, theirs = logits(model, ids), logits(reference, ids)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.argmax(dim=-1), theirs.argmax(dim=-1))


def test_asymmetric_int8_and_why_float_stay_dequantized_with_the_reason(checkpoints):
    folder = checkpoints("w8a16-asym")
    model = dense(folder)
    report = compressed.keep_packed(model, list(model.model.layers), str(folder), "compressed-tensors", "")
    assert report.kept == {} and report.dequantized == {"asymmetric int8 (our int8 kernel has no zero points)": LINEARS}
    assert "left as compressed-tensors dequantized them: 21 asymmetric int8" in report.describe()
    folder = checkpoints("w4a16")
    model = dense(folder)
    report = compressed.keep_packed(model, list(model.model.layers), str(folder), "compressed-tensors",
                                    "RESIDENT_QUANTIZATION=none")
    assert report.kept == {} and report.dequantized == {"RESIDENT_QUANTIZATION=none": LINEARS}
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_int8_rows_take_the_kept_integers(checkpoints):
    folder = checkpoints("w4a16-asym")
    model, reference = dense(folder), dense(folder)
    report = compressed.keep_packed(model, list(model.model.layers), str(folder), "compressed-tensors", "", True)
    assert report.int8_rows and report.num_kept == LINEARS and "inputs quantized to int8 per 32" in report.describe()
    assert model.model.layers[0].mlp.up_proj.int8_rows
    ids = [5, 9, 17, 33]
    assert torch.equal(logits(model, ids).argmax(dim=-1), logits(reference, ids).argmax(dim=-1))


def test_an_autoawq_checkpoint_is_converted_once_and_served_from_its_integers(source, tmp_path, monkeypatch):
    """AutoAWQ's GEMM layout -> compressed-tensors (the library's converter, cached) -> our int4 kernel;
    the linears compute the weights the checkpoint was written from, (q - zero) scale."""
    from transformers import AutoModelForCausalLM

    from session.model.runner import ModelRunner

    monkeypatch.setenv(compressed.CACHE_ENV, str(tmp_path / "converted"))
    folder = build_awq(source, tmp_path / "awq", group=32)
    runner = ModelRunner(str(folder), device="cpu")
    assert (runner.compressed.method, runner.compressed.kept, runner.compressed.dequantized) == (
        "awq", {"int4 (groups of 32)": LINEARS}, {})
    [converted] = (tmp_path / "converted").iterdir()
    assert runner.weights_folder == str(converted)
    assert ModelRunner(str(folder), device="cpu").weights_folder == str(converted)  # converted once
    written = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for layer in written.model.layers:  # the float model with the weights the AWQ file stands for
        for module in layer.modules():
            if type(module) is torch.nn.Linear:
                module.weight.data = awq_weights(*awq_quantize(module.weight.data, 32)).float()
    ids = [5, 9, 17, 33, 2]
    kv = runner.new_kv_cache(block_tokens=16, max_tokens=64)
    ours = runner.prefill(kv, runner.embed(ids, []))
    theirs = logits(written, ids)[-1]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4) and ours.argmax() == theirs.argmax()


def test_a_gptq_checkpoint_is_refused_naming_gpt_qmodel(source, tmp_path):
    import json
    import shutil

    from session.errors import ConfigError
    from session.model.runner import ModelRunner

    folder = tmp_path / "gptq"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="GPTQ checkpoints .* load through GPT-QModel"):
        ModelRunner(str(folder), device="cpu")
