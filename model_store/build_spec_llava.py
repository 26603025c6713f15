"""Build models/llava-spec: a LLaVA whose language model is the trained speculative pair's target.

Speculative decoding on LLaVA sessions needs a target whose text a draft can predict: the demo
LLaVAs have random language models (0% acceptance). This wraps the trained target
(model_store/pair/target) with a seeded random CLIP-style vision tower and projector, so a session
has real image placeholder tokens and image embeddings in front of a trained LM, and the pair's
text-only draft (model_store/pair/draft) can serve it. Built on demand (seconds), git-ignored.

Usage: python -m model_store.build_spec_llava [--out models/llava-spec]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from model_store.build_models import CHAT_TEMPLATE, ModelSpec, build_model
from model_store.train_pair import PAIR_DIR

REPO = Path(__file__).resolve().parent.parent
SPEC_LLAVA_DIR = REPO / "models" / "llava-spec"
# 112 px / patch 14 -> 64 image tokens: a turn (image + prompt + 128-token answer) stays within the 256
# tokens the target was trained on (rotary attention does not extrapolate far beyond its training span).
IMAGE_SIZE, PATCH_SIZE = 112, 14


def spec_for(text_config) -> ModelSpec:
    return ModelSpec(
        "spec", IMAGE_SIZE, PATCH_SIZE, vision_hidden=64, vision_layers=2, vision_heads=4, vision_intermediate=128,
        text_hidden=text_config.hidden_size, text_layers=text_config.num_hidden_layers,
        text_heads=text_config.num_attention_heads, text_kv_heads=text_config.num_key_value_heads,
        text_intermediate=text_config.intermediate_size, max_positions=text_config.max_position_embeddings,
        vocab_size=text_config.vocab_size,
    )


@torch.no_grad()
def match_image_embedding_scale(model) -> None:
    """Scale the projector's output to the RMS of the token embeddings.

    The tower and projector are random: unscaled, image embeddings would be orders of magnitude off the
    trained LM's input scale and swamp its attention. Measured on a fixed grey image (deterministic).
    """
    config = model.config.vision_config
    pixels = torch.full((1, 3, config.image_size, config.image_size), 0.5)
    features = model.model.get_image_features(
        pixel_values=pixels, vision_feature_layer=model.config.vision_feature_layer,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
    ).pooler_output[0]
    token_rms = model.model.language_model.embed_tokens.weight.pow(2).mean().sqrt()
    scale = token_rms / features.pow(2).mean().sqrt()
    projector = model.model.multi_modal_projector.linear_2
    projector.weight.mul_(scale)
    projector.bias.mul_(scale)


def build_spec_llava(out: Path = SPEC_LLAVA_DIR, pair_target: Path = PAIR_DIR / "target", seed: int = 1234) -> Path:
    """Build once; later calls return the existing directory. Who calls this: tests, benchmarks, users."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlamaForCausalLM, LlavaProcessor

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(pair_target)  # the pair's own: the draft must share it
    lm = LlamaForCausalLM.from_pretrained(pair_target, dtype=torch.float32)
    spec = spec_for(lm.config)
    model = build_model(spec, tokenizer, seed)  # random tower, projector and LM; the LM is replaced next
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    match_image_embedding_scale(model)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1,
    )
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / "resident_build.json").write_text(json.dumps(
        {"spec": spec.__dict__, "seed": seed, "language_model": str(pair_target)}, indent=2) + "\n")
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SPEC_LLAVA_DIR)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    print(f"built {build_spec_llava(args.out, seed=args.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
