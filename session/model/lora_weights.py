"""One LoRA adapter's weights: reading a PEFT adapter directory and checking it against the base.

``load_adapter`` reads adapter_config.json + adapter_model.safetensors and checks them: the
config's fields and their types, targets, ranks and shapes against the base model, finite weights;
anything wrong is a 400 (``InvalidAdapter``). Plain PEFT key names work for LLaVA and plain causal LMs.

Who calls this: ``AdapterRegistry`` (session/model/lora.py) on the engine loop thread, when an
adapter is registered or first used after its host copy was dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from session.errors import InvalidAdapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY_RE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class AdapterWeights:
    """One adapter's weights in host memory. B is pre-multiplied by the LoRA scale."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A [r, in], B [out, r])

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; more is not one
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def load_adapter(name: str, path: str | Path, shapes: dict[tuple[int, str], tuple[int, int]],
                 max_rank: int, dtype: torch.dtype = torch.float32) -> AdapterWeights:
    """Read and validate a PEFT LoRA adapter; ``shapes`` maps (layer, target) -> (in, out) of the base.
    Every weight must be finite, also once scaled and in ``dtype`` (the bank's): one NaN or Inf in a
    mixed batch's shared products would reach other rows (``LoRALinear``)."""
    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise InvalidAdapter(f"{path} is not a PEFT adapter directory (needs adapter_config.json and "
                             "adapter_model.safetensors)")
    rank, scale = lora_scale(name, read_config(name, config_path), max_rank)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_path))
    except Exception as exc:
        raise InvalidAdapter(f"adapter {name!r} cannot be read: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.search(key)
        if match is None:
            raise InvalidAdapter(f"adapter {name!r} has weight {key!r} for a module we cannot adapt; "
                                 f"supported targets: {list(TARGETS)}")
        layer, target, which = int(match.group(1)), match.group(2), match.group(3)
        if (layer, target) not in shapes:
            raise InvalidAdapter(f"adapter {name!r} targets {target} of layer {layer}, which the base model "
                                 "does not have")
        pair = pairs.setdefault((layer, target), {})
        if which in pair:
            raise InvalidAdapter(f"adapter {name!r} has two lora_{which} weights for {(layer, target)}")
        pair[which] = _finite(name, f"weight {key!r}", tensor, dtype)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for site, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise InvalidAdapter(f"adapter {name!r} lacks lora_{'B' if 'A' in pair else 'A'} for {site}")
        fan_in, fan_out = shapes[site]
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise InvalidAdapter(f"adapter {name!r} {site}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the "
                                 f"base ({fan_out} x {fan_in}) at rank {rank}")
        scaled = _finite(name, f"lora_B of {site} scaled by lora_alpha / r = {scale:g}", b * scale, dtype)
        weights[site] = (a.contiguous(), scaled.contiguous())
    if not weights:
        raise InvalidAdapter(f"adapter {name!r} has no LoRA weights")
    return AdapterWeights(name=name, rank=rank, weights=weights)


def read_config(name: str, config_path: Path) -> dict:
    """adapter_config.json as a dict; anything else (too big, not UTF-8, not JSON, not an object) is a 400."""
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise InvalidAdapter(f"adapter {name!r}: adapter_config.json is over {MAX_CONFIG_BYTES} bytes")
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InvalidAdapter(f"adapter {name!r}: adapter_config.json is not UTF-8 JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"adapter {name!r}: adapter_config.json must hold a JSON object, not "
                             f"{_JSON_TYPES.get(type(config), type(config).__name__)}")
    return config


def lora_scale(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale of B) from a PEFT LoRA config, every field we read checked for its type and range."""
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"adapter {name!r} is {config.get('peft_type')!r}, only LORA is supported")
    rank = config.get("r")
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise InvalidAdapter(f"adapter {name!r} has rank {rank!r}; supported ranks are 1..{max_rank} "
                             "(an integer 'r')")
    alpha = config.get("lora_alpha", rank)
    if not _finite_number(alpha):
        raise InvalidAdapter(f"adapter {name!r} has lora_alpha {alpha!r}; it must be a finite number")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise InvalidAdapter(f"adapter {name!r} has use_rslora {rslora!r}; it must be true or false")
    targets = config.get("target_modules")  # PEFT: a list of names, or one regular expression
    if not (targets is None or isinstance(targets, str) or
            (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise InvalidAdapter(f"adapter {name!r} has target_modules {targets!r}; it must be a list of module "
                             "names (or a string)")
    return rank, alpha / (rank ** 0.5 if rslora else rank)


def _finite_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _finite(name: str, what: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in float32, if it is a floating-point weight whose values are finite in ``dtype`` too."""
    if not tensor.is_floating_point():
        raise InvalidAdapter(f"adapter {name!r}: {what} is {tensor.dtype}; LoRA weights are floating point")
    if not torch.isfinite(tensor).all():
        raise InvalidAdapter(f"adapter {name!r}: {what} has NaN or infinite values")
    weight = tensor.float()
    if not (torch.isfinite(weight).all() and torch.isfinite(weight.to(dtype)).all()):
        raise InvalidAdapter(f"adapter {name!r}: {what} has values too large for float32 or {dtype} "
                             "(RESIDENT_DTYPE)")
    return weight
