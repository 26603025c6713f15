"""Offline demo checkpoints of LLaVA-NeXT (llava-v1.6, ``model_type`` "llava_next").

Tiny, deterministic from a seed, in the hub's on-disk layout (config.json, model.safetensors,
generation_config.json, tokenizer files, processor_config.json with a ``LlavaNextImageProcessor``
and the chat template), loaded by ``LlavaNextForConditionalGeneration.from_pretrained`` and
``AutoProcessor.from_pretrained`` exactly like llava-hf/llava-v1.6-*-hf:

- ``llava-next-tiny-vicuna``: the byte-level BPE and "USER: <image>\\n... ASSISTANT:" template of the
  demo LLaVA-1.5 (build_models.py), a Llama LM; 56 px tiles, grids 1x1 .. 3x1 tiles;
- ``llava-next-tiny-mistral``: Mistral-7B's SentencePiece tokenizer (build_text_models.mistral_tokenizer)
  plus an ``<image>`` special token appended to the vocabulary (id 32000, as in
  llava-v1.6-mistral-7b-hf), a Mistral LM without a sliding window (as Mistral-7B-Instruct-v0.2),
  the "[INST] <image>\\n... [/INST]" template; 84 px tiles and the real checkpoint's pinpoints scaled
  down by 4 (no 1x1 grid).

Both use a CLIP tower with patch 14, feature layer -2 and the "default" strategy (the CLS is dropped),
so one ``<image>`` expands to a count that depends on the image's size and aspect ratio
(session/families/anyres.py computes it).

Run: python -m model_store.build_llava_next [--only vicuna] [--out models]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
PATCH_SIZE = 14
# llava-v1.6-mistral's format: images first, each "<image>\n", then the text; BOS comes from the tokenizer.
MISTRAL_NEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set images = 0 %}{% set text = message['content'] %}"
    "{% else %}{% set images = message['content'] | selectattr('type', 'equalto', 'image') | list | length %}"
    "{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join(' ') %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + '<image>\n' * images + text + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ text + '</s>' }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class NextSpec:
    """One demo checkpoint. ``tile_size`` is the CLIP image size, the crop size and the processor's
    shortest edge; each pinpoint (height, width) is a multiple of it."""

    name: str
    language_model: str  # "llama" (vicuna) or "mistral"
    tile_size: int
    grid_pinpoints: tuple[tuple[int, int], ...]


SPECS = {
    "vicuna": NextSpec("vicuna", "llama", 56, ((56, 56), (56, 112), (112, 56), (112, 112), (168, 56), (56, 168))),
    "mistral": NextSpec("mistral", "mistral", 84, ((84, 168), (168, 84), (168, 168), (252, 84), (84, 252))),
}
VISION_HIDDEN, VISION_LAYERS, VISION_HEADS, VISION_INTERMEDIATE = 64, 2, 4, 128
TEXT_HIDDEN, TEXT_LAYERS, TEXT_HEADS, TEXT_KV_HEADS, TEXT_INTERMEDIATE, MAX_POSITIONS = 64, 2, 4, 2, 128, 2048


def checkpoint_name(variant: str) -> str:
    return f"llava-next-tiny-{variant}"


def build_tokenizer(spec: NextSpec):
    """The LM's tokenizer with ``<image>`` as a special token (``tokenizer.image_token``) and the chat template."""
    from model_store.build_models import CHAT_TEMPLATE, build_tokenizer as bpe_tokenizer
    from model_store.build_text_models import mistral_tokenizer

    if spec.language_model == "llama":
        tokenizer = bpe_tokenizer(2048)  # already carries <image> and the LLaVA-1.5 ("vicuna") template
        tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer
    tokenizer = mistral_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.image_token = IMAGE_TOKEN  # LlavaNextProcessor reads tokenizer.image_token / image_token_id
    tokenizer.chat_template = MISTRAL_NEXT_TEMPLATE
    return tokenizer


def build_config(spec: NextSpec, tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, MistralConfig

    vision = CLIPVisionConfig(hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE,
                              num_hidden_layers=VISION_LAYERS, num_attention_heads=VISION_HEADS,
                              image_size=spec.tile_size, patch_size=PATCH_SIZE, projection_dim=VISION_HIDDEN)
    common = dict(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=TEXT_INTERMEDIATE,
                  num_hidden_layers=TEXT_LAYERS, num_attention_heads=TEXT_HEADS, num_key_value_heads=TEXT_KV_HEADS,
                  max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if spec.language_model == "llama":
        text = LlamaConfig(**common, pad_token_id=tokenizer.pad_token_id)
    else:
        text = MistralConfig(**common, sliding_window=None, head_dim=TEXT_HIDDEN // TEXT_HEADS)
    return LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid_pinpoints=[list(p) for p in spec.grid_pinpoints], vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False,
    )


def build_model(spec: NextSpec, tokenizer, seed: int):
    from transformers import LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(build_config(spec, tokenizer)).eval()
    with torch.no_grad():  # larger logits than the default init: greedy decoding is not a tie-break game
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    return model


def build_processor(spec: NextSpec, tokenizer):
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    # Without torchvision transformers falls back to the PIL backend anyway; naming it avoids the warning.
    # processor_config.json still says "LlavaNextImageProcessor", as a hub checkpoint does.
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": spec.tile_size}, crop_size={"height": spec.tile_size, "width": spec.tile_size},
        image_grid_pinpoints=[list(p) for p in spec.grid_pinpoints], do_convert_rgb=True, do_pad=True,
    )
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                              vision_feature_select_strategy="default", chat_template=tokenizer.chat_template,
                              num_additional_image_tokens=1)


def build(variant: str, out: Path, seed: int = 0) -> Path:
    """Write <out>/llava-next-tiny-<variant> through a .tmp directory renamed at the end, so a crashed
    build never leaves a half checkpoint behind; an existing checkpoint is left as it is."""
    target = out / checkpoint_name(variant)
    if (target / "config.json").exists():
        return target
    spec = SPECS[variant]
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer, seed)
    processor = build_processor(spec, tokenizer)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / "resident_build.json").write_text(json.dumps({"spec": asdict(spec), "seed": seed}, indent=2))
    tmp.rename(target)
    return target


def ensure(variants=tuple(SPECS), out: Path = Path(__file__).resolve().parent.parent / "models") -> dict[str, Path]:
    """Build what is missing; returns variant -> checkpoint directory. Used by tests."""
    return {variant: build(variant, out) for variant in variants}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    for variant in args.only or sorted(SPECS):
        print(f"built {build(variant, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
