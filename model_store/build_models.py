"""Build the offline demo models in Hugging Face format.

No model hub is reachable on the build machines, so the project makes its own
small LLaVA models: a CLIP-style vision tower, a projector and a Llama-style
language model, plus a byte-level BPE tokenizer trained on the Python standard
library's sources, a CLIP image processor and a LLaVA-1.5-style chat template.
Everything is deterministic from the seed, and each model loads with
``from_pretrained`` exactly like a real checkpoint (llava-hf/llava-1.5-7b-hf).

Usage: python -m model_store.build_models [--out models] [--only tiny|bench]
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]

# LLaVA-1.5 conversation format ("USER: <image>\n... ASSISTANT: ...</s>").
# Content may be a string or a list of {"type": "image"|"text"} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') }}\n"
    "{% elif message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %} "
    "{% elif message['role'] == 'assistant' %}ASSISTANT: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one demo model. ``image_size // patch_size`` squared is the image token count."""

    name: str
    image_size: int
    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    max_positions: int
    vocab_size: int


SPECS = {
    # For tests and `make serve`: 56 px / patch 14 -> 16 image tokens, loads in well under a second.
    "tiny": ModelSpec("tiny", 56, 14, 64, 2, 4, 128, 64, 2, 4, 2, 128, 1024, 2048),
    # LLaVA-shaped benchmark: 336 px / patch 14 -> 576 image tokens; a ViT-B-sized tower in front of
    # a ~30M-parameter Llama so that image encoding + prefill dominate the first request, as in LLaVA-1.5.
    "bench": ModelSpec("bench", 336, 14, 768, 12, 12, 3072, 512, 8, 8, 8, 1376, 4096, 8192),
}


def corpus_files() -> list[Path]:
    """A fixed, sorted list of standard-library sources: present on every machine with Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["textwrap.py", "argparse.py", "json/encoder.py", "json/decoder.py", "collections/__init__.py",
             "functools.py", "pathlib.py", "string.py", "calendar.py", "difflib.py", "heapq.py", "shlex.py"]
    return [stdlib / n for n in names if (stdlib / n).exists()]


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [p.read_text(encoding="utf-8") for p in corpus_files()]
    tok.train_from_iterator(texts, trainer=trainer)
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN}, model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(spec: ModelSpec, tokenizer, seed: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size, projection_dim=spec.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )
    model = LlavaForConditionalGeneration(config).eval()
    # Random init is std 0.02 everywhere, which gives near-uniform logits. Scale the output head so greedy
    # choices have clear margins: equal-token tests then compare behaviour, not float32 rounding noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build(spec: ModelSpec, out: Path, seed: int) -> Path:
    from transformers import CLIPImageProcessor, LlavaProcessor

    target = out / f"llava-{spec.name}"
    if (target / "config.json").exists():
        print(f"{target} exists; skipping")
        return target
    tokenizer = build_tokenizer(spec.vocab_size)
    model = build_model(spec, tokenizer, seed)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size}, crop_size={"height": spec.image_size, "width": spec.image_size},
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=spec.patch_size,
        vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1,
    )
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / "resident_build.json").write_text(json.dumps({"spec": spec.__dict__, "seed": seed}, indent=2))
    tmp.rename(target)
    print(f"built {target} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--only", choices=sorted(SPECS), action="append")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or sorted(SPECS):
        build(SPECS[name], args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
