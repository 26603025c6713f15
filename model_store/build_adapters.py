"""Build demo LoRA adapters (PEFT format) for a demo base model, offline and deterministic.

PEFT initialises B to zero (an adapter that changes nothing); ours get seeded random A and B
so each adapter's output differs from the base and from the others. A few shapes on purpose:
different ranks, attention-only and all-linear targets, and one rsLoRA adapter.

Usage: python -m model_store.build_adapters [--base models/llava-tiny] [--out models/adapters-tiny] [--count 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rslora)
VARIANTS = [
    ("tone", 4, 8, ["q_proj", "v_proj"], False),
    ("domain", 8, 16, ALL_LINEAR, False),
    ("customer", 16, 16, ATTENTION, False),
    ("terse", 4, 4, ALL_LINEAR, True),
]


def build_adapter(base_path: Path, out: Path, name: str, rank: int, alpha: int, targets: list[str], rslora: bool,
                  seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, LlavaForConditionalGeneration

    target = out / name
    if (target / "adapter_config.json").exists():
        return target
    is_llava = AutoConfig.from_pretrained(base_path).model_type == "llava"
    cls = LlavaForConditionalGeneration if is_llava else AutoModelForCausalLM
    model = cls.from_pretrained(base_path)
    # Only the language model's linears: the vision tower and projector stay shared.
    pattern = (r".*language_model.*\." if is_llava else r".*layers\.\d+\..*\.") + f"({'|'.join(targets)})$"
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=pattern, lora_dropout=0.0, use_rslora=rslora)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in peft_model.named_parameters():
            if "lora_" in key:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 / rank ** 0.5))
    peft_model.save_pretrained(target)
    return target


def build_all(base_path: Path, out: Path, count: int, seed: int = 7) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        name, rank, alpha, targets, rslora = VARIANTS[index % len(VARIANTS)]
        if index >= len(VARIANTS):
            name = f"{name}-{index}"
        paths.append(build_adapter(base_path, out, name, rank, alpha, targets, rslora, seed + index))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=Path("models/llava-tiny"))
    parser.add_argument("--out", type=Path, default=Path("models/adapters-tiny"))
    parser.add_argument("--count", type=int, default=4)
    args = parser.parse_args(argv)
    for path in build_all(args.base, args.out, args.count):
        print(f"adapter {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
