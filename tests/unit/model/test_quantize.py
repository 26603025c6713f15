"""session/model/quantize.py: weight-only int8 and int4 on ATen's CPU kernels against a float64 product
of the dequantized weights, the quantization round trip, which of the tiny demo model's linears are
replaced (and what stays float), and the CUDA kernel choice with a mocked torchao.

Tolerance of the kernels (float32 activations): |y - x W^T| <= PRODUCT_TOLERANCE * (|x| |W|^T + |b|)
per output, W the dequantized weight in float64. Measured on these shapes and 576x1536: at most
2.5e-7 (about two float32 roundings of the sum), for both kernels; 1e-6 leaves 4x."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from session.config import EngineConfig
from session.errors import ConfigError
from session.model.cpu import fused_layer, linear as cpu_linear
from session.model.lora import LoraBank, LoRALinear, install_lora, target_shapes
from session.model.quantize import (
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    int4_group,
    quantize_int4,
    quantize_int8,
    quantize_language_model,
    quantize_linear,
)
from tests.conftest import REPO

PRODUCT_TOLERANCE = 1e-6
ROUNDING_SLACK = 1e-5  # w / scale is divided in float32: a weight within half a level, to this many levels
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = [(96, 200), (64, 64), (48, 256), (32, 96)]  # (out, in); no int4 group divides 200: int8 only


def weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=generator) * 0.05
    w[0, :] = 0  # a constant row (and groups): its scale must not be 0
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(3, 5, in_features, generator=generator)  # [B, T, in]
    return w, bias, x


def assert_product(y: torch.Tensor, x: torch.Tensor, dequantized: torch.Tensor, bias: torch.Tensor) -> None:
    reference = x.double() @ dequantized.T + bias.double()
    magnitude = x.double().abs() @ dequantized.abs().T + bias.double().abs()
    assert y.shape == reference.shape and y.dtype == x.dtype
    assert ((y.double() - reference).abs() <= PRODUCT_TOLERANCE * magnitude).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_linear_is_the_product_of_its_dequantized_weight(shape):
    w, bias, x = weights(*shape)
    q, scales = quantize_int8(w, torch.float32)
    linear = QuantizedLinear.from_int8(q, scales, bias)
    assert (linear.in_features, linear.out_features) == (shape[1], shape[0])
    assert_product(linear(x), x, dequantize_int8(q, scales), bias)
    assert_product(linear(x[:, :1]), x[:, :1], dequantize_int8(q, scales), bias)  # a decode step's [B, 1, in]


@pytest.mark.parametrize("shape", [s for s in SHAPES if int4_group(*s)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_int4_linear_is_the_product_of_its_dequantized_weight(shape):
    w, bias, x = weights(*shape)
    q, scales, zeros = quantize_int4(w, int4_group(*shape), torch.float32)
    linear = QuantizedLinear.from_int4(q, scales, zeros, bias)
    assert linear.group_size == int4_group(*shape)
    assert_product(linear(x), x, dequantize_int4(q, scales, zeros), bias)
    assert_product(linear(x[:, :1]), x[:, :1], dequantize_int4(q, scales, zeros), bias)


def test_int4_groups_are_the_largest_allowed_that_divides_the_inputs():
    assert [int4_group(64, k, 128) for k in (256, 576, 96, 200)] == [128, 64, 32, None]
    assert [int4_group(64, k, 64) for k in (256, 576, 96, 200)] == [64, 64, 32, None]
    assert [int4_group(64, k) for k in (256, 576, 96, 200)] == [32, 32, 32, None]  # RESIDENT_INT4_GROUP's default
    assert int4_group(20, 256) is None  # ATen packs out_features in multiples of 16


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_row_is_computed_as_if_alone(method):
    """The kernels' bits for a row do not depend on the other rows: a decode batch, or a session's
    delta prefill, gives what a batch-of-one forward over the same row gives (the engine's tests rely on it)."""
    _, _, x = weights(64, 256)
    linear = quantize_linear(nn.Linear(256, 64).requires_grad_(False), method)
    rows = x.reshape(-1, 256)
    alone = torch.cat([linear(rows[i: i + 1]) for i in range(len(rows))])
    for count in (2, 3, 5, 8, 15):
        assert torch.equal(linear(rows[:count]), alone[:count])


def test_int8_round_trip_within_half_a_scale():
    w, _, _ = weights(96, 200)
    q, scales = quantize_int8(w, torch.float32)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert (q[1:].abs().amax(dim=1) == 127).all()  # every non-constant row uses its whole range
    assert scales[0] == 1 and (q[0] == 0).all()  # the zero row
    error = (w.double() - dequantize_int8(q, scales)).abs()
    assert (error <= scales.double()[:, None] * (0.5 + ROUNDING_SLACK)).all()


def test_int4_round_trip_within_half_a_scale():
    w, _, _ = weights(48, 256)
    q, scales, zeros = quantize_int4(w, 128, torch.float32)
    assert q.min() >= 0 and q.max() <= 15 and scales.shape == zeros.shape == (48, 2)
    error = (w.double() - dequantize_int4(q, scales, zeros)).abs()
    assert (error <= scales.double().repeat_interleave(128, dim=1) * (0.5 + ROUNDING_SLACK)).all()


def test_bfloat16_scales_are_rounded_up_so_nothing_clamps():
    w, _, _ = weights(96, 208)
    q, scales = quantize_int8(w, torch.bfloat16)
    assert scales.dtype == torch.bfloat16
    assert (scales.float() * 127 >= w.abs().amax(dim=1)).all()
    error = (w.double() - dequantize_int8(q, scales)).abs()
    assert (error <= scales.double()[:, None] * (0.5 + ROUNDING_SLACK)).all()
    x = torch.randn(2, 208).bfloat16()
    assert QuantizedLinear.from_int8(q, scales)(x).dtype == torch.bfloat16


def test_bfloat16_int8_takes_inputs_in_multiples_of_16_only():
    """ATen's bfloat16 int8 kernel crashed on 200 inputs: such a linear stays float."""
    assert quantize_linear(nn.Linear(200, 96).bfloat16(), "int8") is None
    assert quantize_linear(nn.Linear(200, 96), "int8") is not None  # float32 takes any width


# ------------------------------------------------------------------ the tiny demo model


@pytest.fixture()
def tiny(tiny_model_path):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_model_path).eval().requires_grad_(False)


def decoder_layers(model) -> list[nn.Module]:
    return list(model.model.language_model.layers)


def float_linears(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight.clone() for name, m in module.named_modules() if type(m) is nn.Linear}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_decoder_layers_linears_are_replaced_and_nothing_else(tiny, method):
    untouched = {"vision": float_linears(tiny.model.vision_tower), "projector": float_linears(tiny.model.multi_modal_projector)}
    head = tiny.lm_head.weight.clone()
    shapes = {(i, name): getattr(layer.self_attn if name in LINEARS[:4] else layer.mlp, name).weight.shape
              for i, layer in enumerate(decoder_layers(tiny)) for name in LINEARS}
    tied = tiny.lm_head.weight.data_ptr() == tiny.get_input_embeddings().weight.data_ptr()
    embeddings = tiny.get_input_embeddings().weight.clone()
    report = quantize_language_model(tiny, decoder_layers(tiny), method, torch.device("cpu"), int4_largest=128)
    # our kernels run both here (float32), and take the head too, in int8
    assert (report.method, report.num_linears, report.num_float, report.head) == (method, 14, 0, True)
    for i, layer in enumerate(decoder_layers(tiny)):
        for name in LINEARS:
            module = getattr(layer.self_attn if name in LINEARS[:4] else layer.mlp, name)
            assert type(module) is QuantizedLinear and module.method == method
            assert (module.out_features, module.in_features) == shapes[(i, name)]
            assert module.group_size == (0 if method == "int8" else (128 if name == "down_proj" else 64))
    assert not any(isinstance(m, QuantizedLinear) for m in tiny.model.vision_tower.modules())
    for part, module in (("vision", tiny.model.vision_tower), ("projector", tiny.model.multi_modal_projector)):
        after = float_linears(module)
        assert after.keys() == untouched[part].keys() and all(torch.equal(after[k], untouched[part][k]) for k in after)
    # bytes: each float32 [out, in] weight became int8 [out, in] + float32 scales [out] (in whole blocks of
    # 16 outputs), or int4 [out, in / 2] + a float32 scale and zero per group of every row
    def int8_bytes(o: int, i: int) -> int:
        return -(-o // 16) * 16 * (i + 4)
    if method == "int8":
        saved = sum(4 * o * i - int8_bytes(o, i) for o, i in shapes.values())
    else:
        saved = sum(4 * o * i - (o * i // 2 + 8 * o * (i // (128 if i % 128 == 0 else 64))) for o, i in shapes.values())
    assert type(tiny.lm_head) is QuantizedLinear and tiny.lm_head.ours and tiny.lm_head.method == "int8"
    assert torch.equal(tiny.get_input_embeddings().weight, embeddings)  # the lookup's float table is untouched
    o, i = head.shape
    saved += (0 if tied else 4 * o * i) - int8_bytes(o, i)  # a tied head's float storage stays, the embeddings'

    assert report.model_bytes_before - report.model_bytes_after == saved
    assert report.group_sizes == (() if method == "int8" else (128, 64))
    assert f"{14} linears" in report.describe() and report.kernel in report.describe()


def test_a_shape_the_int4_kernel_does_not_take_stays_float():
    layer = nn.Module()
    layer.wide, layer.odd = nn.Linear(64, 32), nn.Linear(64, 20)  # 20 outputs: not a multiple of 16
    report = quantize_language_model(layer, [layer], "int4", torch.device("cpu"))
    assert (report.num_linears, report.num_float) == (1, 1)
    assert type(layer.wide) is QuantizedLinear and type(layer.odd) is nn.Linear
    assert "1 left float" in report.describe()


def test_lora_wraps_quantized_linears(tiny):
    layers = decoder_layers(tiny)
    float_shapes = target_shapes(layers)
    quantize_language_model(tiny, layers, "int8", torch.device("cpu"))
    assert target_shapes(layers) == float_shapes and len(float_shapes) == 14
    bank = LoraBank(float_shapes, num_slots=1, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    install_lora(layers, bank)
    q_proj = layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoRALinear) and isinstance(q_proj.base, QuantizedLinear)
    x = torch.randn(2, 3, 64)
    assert torch.equal(q_proj(x), q_proj.base(x))  # no adapter rows: the base product alone


def test_the_fused_decode_layer_is_off_for_linears_on_atens_kernels(tiny, caplog):
    layers = decoder_layers(tiny)
    quantize_language_model(tiny, layers, "int4", torch.device("cpu"), cpu_kernels=False)
    with caplog.at_level(logging.INFO, logger=fused_layer.__name__):
        assert fused_layer.plan(layers, 4, 2, 16) is None
    assert "linears quantized for ATen's kernels" in caplog.text


@pytest.mark.parametrize("method,operator,fmt", [("int8", "linear_i8", torch.int8), ("int4", "linear_i4", torch.uint8)])
def test_float32_takes_our_kernel_and_the_fused_decode_layer(tiny, method, operator, fmt):
    layers = decoder_layers(tiny)
    report = quantize_language_model(tiny, layers, method, torch.device("cpu"))
    assert report.kernel.startswith(f"resident::{operator} (CPU, ") and report.kernel in report.describe()
    q_proj = layers[0].self_attn.q_proj
    assert q_proj.ours and q_proj.packed.dtype == fmt and q_proj.scales is None
    arguments = fused_layer.plan(layers, 4, 2, 16)
    assert arguments is not None and fused_layer.weight_format(arguments) == fmt
    assert [len(weights) for weights, *_ in arguments] == [9] * len(layers)


# A fresh process: no kernel loaded before this quantization
INT4_ALONE = r"""
import sys, torch
from transformers import LlavaForConditionalGeneration
from session.model.quantize import QuantizedLinear, quantize_language_model
model = LlavaForConditionalGeneration.from_pretrained(sys.argv[1]).eval()
report = quantize_language_model(model, list(model.model.language_model.layers), "int4", torch.device("cpu"))
assert report.head and type(model.lm_head) is QuantizedLinear and model.lm_head.method == "int8"
print(tuple(model.lm_head(torch.randn(2, model.lm_head.in_features)).shape))
"""


def test_int4_alone_loads_the_int8_kernel_its_head_runs_on(tiny_model_path):
    """An int4 deployment's head is int8: quantizing it loads the int8 kernel (it once ran only where an
    int8 model had loaded it before, and raised otherwise)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", INT4_ALONE, str(tiny_model_path)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "(2, 2048)"


def test_the_head_stays_float_where_the_int8_kernel_cannot_be_had(tiny, monkeypatch):
    monkeypatch.setattr(cpu_linear.INT8_KERNEL, "load", lambda: False)
    report = quantize_language_model(tiny, decoder_layers(tiny), "int4", torch.device("cpu"))
    assert report.kernel.startswith("resident::linear_i4") and not report.head
    assert type(tiny.lm_head) is nn.Linear and "and the head" not in report.describe()


def test_with_cpu_kernels_off_int8_stays_on_atens(tiny):
    layers = decoder_layers(tiny)
    report = quantize_language_model(tiny, layers, "int8", torch.device("cpu"), cpu_kernels=False)
    assert report.kernel == "aten._weight_int8pack_mm (CPU)"
    assert not layers[0].self_attn.q_proj.ours


# ------------------------------------------------------------------ the CUDA choice (torchao mocked)


class FakeTorchao:
    """torchao.quantization's three names, recording which modules each ``quantize_`` call's filter took."""

    def __init__(self):
        self.calls: list[tuple[object, list[str]]] = []  # (config, names of the modules its filter took)

    def module(self) -> types.ModuleType:
        module = types.ModuleType("torchao.quantization")
        module.Int8WeightOnlyConfig = lambda: ("int8",)
        module.Int4WeightOnlyConfig = lambda group_size=128: ("int4", group_size)
        module.quantize_ = self.quantize_
        return module

    def quantize_(self, model, config, filter_fn=None):
        self.calls.append((config, [name for name, m in model.named_modules() if filter_fn(m, name)]))


@pytest.fixture()
def torchao(monkeypatch):
    fake = FakeTorchao()
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", fake.module())
    return fake


def decoder_linear_names(model) -> list[str]:
    return [name for name, m in model.named_modules() if ".language_model.layers." in name and type(m) is nn.Linear]


def test_cuda_int8_runs_torchao_on_exactly_the_decoder_linears(tiny, torchao):
    report = quantize_language_model(tiny, decoder_layers(tiny), "int8", torch.device("cuda"))
    assert torchao.calls == [(("int8",), decoder_linear_names(tiny))] and len(torchao.calls[0][1]) == 14
    assert (report.kernel, report.num_linears) == ("torchao Int8WeightOnlyConfig (CUDA)", 14)
    assert not any(isinstance(m, QuantizedLinear) for m in tiny.modules())  # ATen's CPU modules are not used


def test_cuda_int4_runs_torchao_once_per_group_size(tiny, torchao):
    tiny.to(torch.bfloat16)
    report = quantize_language_model(tiny, decoder_layers(tiny), "int4", torch.device("cuda"), int4_largest=128)
    names = decoder_linear_names(tiny)
    assert torchao.calls == [(("int4", 128), [n for n in names if n.endswith("down_proj")]),
                             (("int4", 64), [n for n in names if not n.endswith("down_proj")])]
    assert (report.num_linears, report.group_sizes) == (14, (128, 64))


def test_cuda_int4_takes_groups_of_32_by_default(tiny, torchao):
    tiny.to(torch.bfloat16)
    report = quantize_language_model(tiny, decoder_layers(tiny), "int4", torch.device("cuda"))
    assert torchao.calls == [(("int4", 32), decoder_linear_names(tiny))]
    assert (report.num_linears, report.group_sizes) == (14, (32,))
    assert "groups of 32 inputs" in report.describe()


def test_cuda_int4_needs_bfloat16(tiny, torchao):
    with pytest.raises(ConfigError, match="bfloat16"):
        quantize_language_model(tiny, decoder_layers(tiny), "int4", torch.device("cuda"))
    assert torchao.calls == []


def test_cuda_without_torchao_is_refused_at_start_up(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(ConfigError, match="torchao"):
        quantize_language_model(tiny, decoder_layers(tiny), "int8", torch.device("cuda"))
    assert quantize_language_model(tiny, decoder_layers(tiny), "int8", torch.device("cpu")).num_linears == 14


def test_other_devices_and_methods_are_refused(tiny):
    with pytest.raises(ConfigError, match="CPU .* or CUDA"):
        quantize_language_model(tiny, decoder_layers(tiny), "int8", torch.device("mps"))
    with pytest.raises(ConfigError, match="RESIDENT_QUANTIZATION"):
        quantize_language_model(tiny, decoder_layers(tiny), "int3", torch.device("cpu"))


def test_config_names_the_variable(tiny_model_path):
    environ = {"RESIDENT_MODEL_PATH": str(tiny_model_path)}
    assert EngineConfig.from_sources(environ=environ).quantization == "auto"  # float here: a GGUF's own
    assert EngineConfig.from_sources(environ=environ | {"RESIDENT_QUANTIZATION": "int4"}).quantization == "int4"
    with pytest.raises(ConfigError, match="RESIDENT_QUANTIZATION must be auto, none, int8 or int4"):
        EngineConfig.from_sources(environ=environ | {"RESIDENT_QUANTIZATION": "fp8"})
    assert EngineConfig.from_sources(environ=environ).activations == "float"
    assert EngineConfig.from_sources(environ=environ | {"RESIDENT_ACTIVATIONS": "int8"}).activations == "int8"
    with pytest.raises(ConfigError, match="RESIDENT_ACTIVATIONS must be float or int8, got 'int4'"):
        EngineConfig.from_sources(environ=environ | {"RESIDENT_ACTIVATIONS": "int4"})
    assert EngineConfig.from_sources(environ=environ).int4_group == 32
    assert EngineConfig.from_sources(environ=environ | {"RESIDENT_INT4_GROUP": "128"}).int4_group == 128
    with pytest.raises(ConfigError, match="RESIDENT_INT4_GROUP must be 32, 64 or 128, got 96"):
        EngineConfig.from_sources(environ=environ | {"RESIDENT_INT4_GROUP": "96"})


def test_the_runner_takes_the_configured_int4_group(tiny_model_path):
    """RESIDENT_INT4_GROUP reaches the linears: 128 where a width allows it, 32 by default."""
    from session.model.runner import ModelRunner

    default = ModelRunner(str(tiny_model_path), device="cpu", quantization="int4")
    wide = ModelRunner(str(tiny_model_path), device="cpu", quantization="int4", int4_group=128)
    assert default.quantization.group_sizes == (32,)
    assert wide.quantization.group_sizes == (128, 64)
