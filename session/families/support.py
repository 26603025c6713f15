"""What the engine can serve, decided from a checkpoint's config.json alone (no weights loaded).

Who calls this: ``ModelRunner`` before it loads weights, and the launchers (``make serve``,
``make cluster``) before they start TorchServe, so that a checkpoint with a feature the engine does
not implement is refused at once with a message naming the feature, never served wrongly and never
left to a worker crash loop.
"""

from __future__ import annotations

from session.checkpoints import locate
from session.errors import ConfigError
from session.families.registry import FAMILIES, model_types

# LLaVA-1.5: a CLIP tower (CLS token), a projector, a decoder-only LM; LLaVA-NeXT (llava-v1.6): the same
# with anyres tiling and image_newline (session/families/anyres.py, session/families/vision.py).
# Qwen2-VL / Qwen2.5-VL: a dynamic-resolution tower and a Qwen2 LM with M-RoPE (session/families/mrope.py).
SUPPORTED_VLMS = model_types(multimodal=True)
MROPE_VLMS = tuple(t for t in SUPPORTED_VLMS if FAMILIES[t].mrope)
SUPPORTED_TEXT_MODELS = model_types(multimodal=False)
LAYER_TYPES = {"full_attention", "sliding_attention"}
SUPPORTED_VISION_TOWERS = ("clip_vision_model",)

# Model types people try, and what about them the engine does not implement yet.
KNOWN_UNSUPPORTED = {
    "llava_onevision": "LLaVA-OneVision: anyres tiling",
    "mllama": "Llama 3.2 Vision: cross-attention to the image, not image tokens in the prompt",
    "idefics2": "Idefics2: a perceiver resampler",
    "idefics3": "Idefics3: image splitting",
    "paligemma": "PaliGemma: a Gemma decoder with prefix attention",
    "gemma": "Gemma", "gemma2": "Gemma 2: sliding-window layers and logit soft-capping",
}


class UnsupportedModel(ConfigError):
    pass


def check_supported(hf_config) -> None:
    """Raise UnsupportedModel naming the first feature of ``hf_config`` the engine does not implement."""
    model_type = hf_config.model_type
    if model_type in KNOWN_UNSUPPORTED:
        raise UnsupportedModel(f"model type {model_type!r} is not supported yet ({KNOWN_UNSUPPORTED[model_type]}); "
                               f"{_supported()}")
    if model_type in MROPE_VLMS:
        _check_mrope_text(hf_config.text_config)
    elif model_type in SUPPORTED_VLMS:
        _check_vision(hf_config)
        _check_text(hf_config.text_config, where="its language model ")
    elif model_type in SUPPORTED_TEXT_MODELS:
        _check_text(hf_config, where="")
    else:
        raise UnsupportedModel(f"model type {model_type!r} is not supported; {_supported()}")


def _check_vision(hf_config) -> None:
    tower = hf_config.vision_config.model_type
    if tower not in SUPPORTED_VISION_TOWERS:
        raise UnsupportedModel(f"vision tower {tower!r} is not supported (the image-token count assumes a CLIP "
                               f"tower with a CLS token); supported: {SUPPORTED_VISION_TOWERS}")
    if not isinstance(hf_config.vision_feature_layer, int):
        raise UnsupportedModel(f"vision_feature_layer {hf_config.vision_feature_layer!r}: features from several "
                               "layers are not supported, only one layer")
    strategies = ("default",) if hf_config.model_type == "llava_next" else ("default", "full")
    if hf_config.vision_feature_select_strategy not in strategies:
        # LLaVA-NeXT with "full": transformers' pack_image_features cannot fold the CLS into the tile grid
        raise UnsupportedModel(f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r} "
                               f"is not supported for {hf_config.model_type} ({' or '.join(strategies)})")


def _check_text(text_config, where: str) -> None:
    model_type = text_config.model_type
    if model_type not in SUPPORTED_TEXT_MODELS:
        reason = KNOWN_UNSUPPORTED.get(model_type, "")
        raise UnsupportedModel(f"{where}type {model_type!r} is not supported{f' ({reason})' if reason else ''}; "
                               f"{_supported()}")
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if not layer_types <= LAYER_TYPES:
        raise UnsupportedModel(f"{where}has attention layer types {sorted(layer_types - LAYER_TYPES)}; "
                               f"implemented: {sorted(LAYER_TYPES)}")


def _check_mrope_text(text_config) -> None:
    """Qwen-VL's language model: full attention and default RoPE folded by mrope_section."""
    rope_type = (getattr(text_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModel(f"its language model's rope_type {rope_type!r} is not supported with M-RoPE (default)")
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if getattr(text_config, "use_sliding_window", False) or layer_types != {"full_attention"}:
        raise UnsupportedModel("its language model has sliding-window layers: not implemented with M-RoPE yet")


def _supported() -> str:
    return (f"supported: {', '.join(SUPPORTED_VLMS)} (LLaVA-1.5 and LLaVA-NeXT with a CLIP tower; Qwen-VL images, "
            f"not videos) and the text-only "
            f"{', '.join(SUPPORTED_TEXT_MODELS)} (full or sliding-window attention)")


def check_checkpoint(model_dir) -> None:
    """The launchers' check: read the config only (config.json or a GGUF's header). Raises UnsupportedModel
    or ConfigError."""
    from pathlib import Path

    from transformers import AutoConfig

    checkpoint = locate(model_dir)
    if checkpoint is None:
        raise ConfigError(f"MODEL={model_dir} is neither a Hugging Face checkpoint directory (no config.json) "
                          "nor a GGUF file")
    try:
        hf_config = AutoConfig.from_pretrained(checkpoint.folder, **checkpoint.kwargs)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModel(f"cannot read {checkpoint.gguf_path or Path(model_dir) / 'config.json'}: {exc}") from None
    check_supported(hf_config)
