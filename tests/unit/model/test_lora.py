"""session/model/lora.py: what ``load_adapter`` refuses (a 400 naming the problem, never a 500), and
a mixed batch whose masked-out columns are not finite (each row's delta is its own adapter's alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from session.errors import InvalidAdapter
from session.model.lora import AdapterWeights, LoraBank, LoRALinear, load_adapter

SHAPES = {(0, "q_proj"): (8, 8), (0, "v_proj"): (8, 4)}  # (layer, target) -> (in, out)
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


def key(target: str, which: str) -> str:
    return f"base_model.model.model.layers.0.self_attn.{target}.lora_{which}.weight"


def weights(rank: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for (_, target), (fan_in, fan_out) in SHAPES.items():
        out[key(target, "A")] = torch.randn(rank, fan_in, generator=generator)
        out[key(target, "B")] = torch.randn(fan_out, rank, generator=generator)
    return out


def write(directory: Path, config=CONFIG, tensors=None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, (str, bytes)) else json.dumps(config)
    (directory / "adapter_config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    save_file(weights() if tensors is None else tensors, str(directory / "adapter_model.safetensors"))
    return directory


def refused(path: Path, dtype: torch.dtype = torch.float32) -> str:
    with pytest.raises(InvalidAdapter) as caught:
        load_adapter("ad", path, SHAPES, max_rank=8, dtype=dtype)
    assert caught.value.status == 400
    return caught.value.message


def test_a_good_adapter_loads_with_b_scaled(tmp_path):
    loaded = load_adapter("ad", write(tmp_path / "ad"), SHAPES, max_rank=8)
    a, b = loaded.weights[(0, "q_proj")]
    assert loaded.rank == 2 and torch.equal(a, weights()[key("q_proj", "A")])
    assert torch.equal(b, weights()[key("q_proj", "B")] * 2.0)  # lora_alpha / r


@pytest.mark.parametrize("which", ["A", "B"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_by_name(tmp_path, which, value):
    tensors = weights()
    tensors[key("v_proj", which)][1, 0] = value
    message = refused(write(tmp_path / "ad", tensors=tensors))
    assert key("v_proj", which) in message and "NaN or infinite" in message


def test_weights_that_overflow_the_bank_dtype_are_refused(tmp_path):
    tensors = weights()
    tensors[key("q_proj", "B")][0, 0] = 1e5  # finite in float32, Inf in float16
    path = write(tmp_path / "ad", tensors=tensors)
    load_adapter("ad", path, SHAPES, max_rank=8, dtype=torch.float32)
    assert "too large for float32 or torch.float16" in refused(path, torch.float16)


def test_a_scale_that_overflows_is_refused(tmp_path):
    message = refused(write(tmp_path / "ad", config={**CONFIG, "lora_alpha": 1e308}))
    assert "scaled by lora_alpha / r" in message


def test_integer_weights_are_refused(tmp_path):
    tensors = weights()
    tensors[key("q_proj", "A")] = torch.ones(2, 8, dtype=torch.int32)
    assert "floating point" in refused(write(tmp_path / "ad", tensors=tensors))


@pytest.mark.parametrize("text,reason", [
    ("[]", "must hold a JSON object, not an array"),
    ("3", "must hold a JSON object, not a number"),
    ('"x"', "must hold a JSON object, not a string"),
    ("null", "must hold a JSON object, not null"),
    ("{not json", "is not UTF-8 JSON"),
    (b'{"r": 2, "x": "\xff\xfe"}', "is not UTF-8 JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not UTF-8 JSON"),  # nesting past the parser's recursion limit
    (" " * (2 << 20) + "{}", "is over"),
])
def test_a_config_that_is_not_a_json_object_is_refused(tmp_path, text, reason):
    assert reason in refused(write(tmp_path / "ad", config=text))


@pytest.mark.parametrize("field,value,reason", [
    ("r", "2", "supported ranks are 1..8"),
    ("r", 2.0, "supported ranks are 1..8"),
    ("r", True, "supported ranks are 1..8"),
    ("r", None, "supported ranks are 1..8"),
    ("lora_alpha", "4", "lora_alpha '4'"),
    ("lora_alpha", None, "lora_alpha None"),
    ("lora_alpha", float("nan"), "lora_alpha nan"),  # json.dumps writes NaN, json.loads reads it back
    ("lora_alpha", float("inf"), "lora_alpha inf"),
    ("lora_alpha", 10 ** 400, "must be a finite number"),
    ("lora_alpha", [4], "must be a finite number"),
    ("use_rslora", "yes", "use_rslora 'yes'"),
    ("target_modules", 3, "target_modules 3"),
    ("target_modules", {"q_proj": 1}, "target_modules"),
    ("target_modules", ["q_proj", 1], "target_modules"),
    ("peft_type", ["LORA"], "only LORA is supported"),
])
def test_fields_of_the_wrong_type_are_refused(tmp_path, field, value, reason):
    assert reason in refused(write(tmp_path / "ad", config={**CONFIG, field: value}))


def test_target_modules_may_be_a_peft_regex(tmp_path):
    config = {**CONFIG, "target_modules": ".*(q_proj|v_proj)"}
    assert load_adapter("ad", write(tmp_path / "ad", config=config), SHAPES, max_rank=8).rank == 2


# ---------------------------------------------------------------- a mixed batch


def mixed_linear(kernel=None) -> tuple[nn.Linear, LoraBank, LoRALinear]:
    """A 16 -> 12 linear with slot 1 a finite adapter and slot 2 one whose A is NaN (loaded past
    ``load_adapter``, as a stand-in for columns that overflow)."""
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    bank = LoraBank({(0, "q_proj"): (16, 12)}, num_slots=2, max_rank=4, dtype=torch.float32,
                    device=torch.device("cpu"))
    bank.kernel = kernel
    good = (torch.randn(3, 16), torch.randn(12, 3))
    bad = (torch.full((4, 16), float("nan")), torch.randn(12, 4))
    bank.load(1, AdapterWeights(name="good", rank=3, weights={(0, "q_proj"): good}))
    bank.load(2, AdapterWeights(name="bad", rank=4, weights={(0, "q_proj"): bad}))
    return base, bank, LoRALinear(base, bank, (0, "q_proj"))


def rows_alone(layer: LoRALinear, bank: LoraBank, x: torch.Tensor, slots: list[int]) -> list[torch.Tensor]:
    out = []
    for row, slot in enumerate(slots):
        bank.set_rows([slot])
        out.append(layer(x[row: row + 1]))
    return out


def lora_kernel():
    from session.model.cpu import fused_layer

    if not fused_layer.load(torch.float32):
        pytest.skip("the kernel cannot be built here")
    return fused_layer.op("lora_add", torch.float32)


@pytest.mark.parametrize("path", ["aten", "kernel"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_non_finite_columns_of_another_adapter_reach_no_other_row(path, tokens):
    """Rows with the base model and with a finite adapter, batched with a row whose adapter's
    columns are NaN, get what they get alone (base rows: the base linear's bits); only the NaN
    adapter's own row is NaN."""
    base, bank, layer = mixed_linear(lora_kernel() if path == "kernel" else None)
    slots = [0, 1, 2, 1, 0]
    x = torch.randn(len(slots), tokens, 16)
    with torch.no_grad():
        alone = rows_alone(layer, bank, x, slots)
        bank.set_rows(slots)
        batched = layer(x)
        plain = base(x)
    for row, slot in enumerate(slots):
        if slot == 2:
            assert torch.isnan(batched[row]).all()
        else:
            assert torch.isfinite(batched[row]).all(), row
            assert torch.allclose(batched[row], alone[row][0], rtol=1e-6, atol=1e-6), row
    assert torch.equal(batched[0], plain[0]) and torch.equal(batched[4], plain[4])  # base rows: the base's bits
