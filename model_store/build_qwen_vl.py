"""Offline demo checkpoints of Qwen2-VL and Qwen2.5-VL (``model_type`` "qwen2_vl", "qwen2_5_vl").

Tiny, deterministic from a seed, in the hub's on-disk layout as transformers 5 writes it (config.json,
model.safetensors, generation_config.json, tokenizer files, chat_template.jinja with Qwen-VL-Instruct's
template, processor_config.json naming ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` and holding the
``Qwen2VLImageProcessor`` settings with min/max pixels; no video processor, which needs torchvision):

- ``qwen2-vl-tiny``: a 2-block ViT (full attention over each image) in front of a 2-layer Qwen2 LM;
- ``qwen2.5-vl-tiny``: a 4-block ViT whose blocks 0 and 2 attend inside 56 px windows (2 x 2 merged
  tokens) and 1 and 3 over the whole image (``fullatt_block_indexes``), RMS norms and a gated MLP,
  as Qwen2.5-VL's tower.

Both keep the real geometry: patch 14, spatial merge 2 (one image token per 28 x 28 pixels),
temporal patch 2, so a 56 x 56 image is 4 tokens and 84 x 140 is 15. The tokenizer is the demo
byte-level BPE (build_models.py) with ChatML and the Qwen-VL special tokens added; the LM's head dim
is 16, so ``mrope_section`` is (2, 3, 3) (8 rotary frequencies split temporal / height / width, as
(16, 24, 24) splits Qwen's 64).

Run: python -m model_store.build_qwen_vl [--only qwen2_vl] [--out models]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL-Instruct's template, verbatim (Qwen2.5-VL-Instruct ships the same one).
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = {"qwen2_vl": "qwen2-vl-tiny", "qwen2_5_vl": "qwen2.5-vl-tiny"}
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64  # 4 .. 64 image tokens per image
VISION_DIM, VISION_HEADS = 32, 2
TEXT_HIDDEN, TEXT_LAYERS, TEXT_HEADS, TEXT_KV_HEADS, TEXT_INTERMEDIATE, MAX_POSITIONS = 64, 2, 4, 2, 128, 2048
MROPE_SECTION = [2, 3, 3]  # sums to head_dim / 2 = 8
# Qwen's 1e6 would leave the height and width rows (the 6 slowest of 8 frequencies) turning by under
# a hundredth of a radian per position: a wrong grid position would then change no token. At 100 the
# slowest turns 0.018 rad per position, so the tests see the 3-D positions.
ROPE_THETA = 100.0
QK_SCALE = 8.0


def build_tokenizer():
    """The demo BPE with ChatML and the Qwen-VL vision tokens as special tokens, and the Qwen-VL template."""
    from model_store.build_text_models import bpe_tokenizer

    tokenizer = bpe_tokenizer(chatml=True)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.image_token, tokenizer.video_token = "<|image_pad|>", "<|video_pad|>"  # the demo BPE's is <image>
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    return tokenizer


def build_config(family: str, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    text = dict(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=TEXT_INTERMEDIATE,
                num_hidden_layers=TEXT_LAYERS, num_attention_heads=TEXT_HEADS, num_key_value_heads=TEXT_KV_HEADS,
                max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": MROPE_SECTION})
    geometry = dict(patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
                    num_heads=VISION_HEADS)
    if family == "qwen2_vl":
        vision = dict(geometry, depth=2, embed_dim=VISION_DIM, hidden_size=TEXT_HIDDEN, mlp_ratio=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False)
    vision = dict(geometry, depth=4, hidden_size=VISION_DIM, intermediate_size=2 * VISION_DIM,
                  out_hidden_size=TEXT_HIDDEN, window_size=2 * PATCH_SIZE * MERGE_SIZE, fullatt_block_indexes=[1, 3])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False)


def build_model(family: str, tokenizer, seed: int):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(build_config(family, tokenizer)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # larger logits than the default init: greedy is not a tie-break game
        for layer in model.model.language_model.layers:
            # At the default init every attention score is near 0, so attention is a plain average and
            # neither positions nor the image's place in the prompt would change a token.
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model


def build_processor(family: str, tokenizer):
    """The processor a hub checkpoint has, less the video processor (it needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from session.families.qwen_vl import build_processor as image_only_processor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                               merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE)
    return image_only_processor(family, image_processor, tokenizer)


def name_processor_class(directory: Path, family: str) -> None:
    """Record the hub's processor class (not the images-only subclass that saved it), as a hub
    checkpoint's processor_config.json and tokenizer_config.json do."""
    name = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[family]
    for file in ("processor_config.json", "tokenizer_config.json"):
        config = json.loads((directory / file).read_text())
        config["processor_class"] = name
        (directory / file).write_text(json.dumps(config, indent=2) + "\n")


def build(family: str, out: Path, seed: int = 0) -> Path:
    """Write <out>/<name> through a .tmp directory renamed at the end, so a crashed build never leaves
    a half checkpoint behind; an existing checkpoint is left as it is."""
    target = out / FAMILIES[family]
    if (target / "config.json").exists():
        return target
    tokenizer = build_tokenizer()
    model = build_model(family, tokenizer, seed)
    processor = build_processor(family, tokenizer)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    name_processor_class(tmp, family)
    (tmp / "resident_build.json").write_text(json.dumps({"family": family, "seed": seed}, indent=2))
    tmp.rename(target)
    return target


def ensure(families=tuple(FAMILIES), out: Path = Path(__file__).resolve().parent.parent / "models") -> dict[str, Path]:
    """Build what is missing; returns family -> checkpoint directory. Used by tests."""
    return {family: build(family, out) for family in families}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(FAMILIES))
    parser.add_argument("--out", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    for family in args.only or sorted(FAMILIES):
        print(f"built {build(family, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
