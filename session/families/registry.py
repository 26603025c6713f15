"""One entry per ``model_type``: what the engine needs to know of a model family.

Adding a family starts here: its entry names the Hugging Face class the runner loads, how its
processor is built, how many tokens an image becomes, and its position scheme. The checks of what
the engine implements for a family live in ``support`` (run on config.json before any weight is
read); the image geometry a scheme needs lives beside this file (``anyres``, ``qwen_vl``, ``mrope``).

Who reads this: ``ModelRunner`` (class, positions, how images are encoded), ``support`` (what is
admitted), the engine's assembly (the processor) and ``vision`` (image token counts).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    hf_class: str  # the transformers class ``from_pretrained`` loads
    image_tokens: str  # "none" (text only), "fixed" (one count per image), "anyres" (by size), "grid" (by patches)
    positions: str = "rope"  # "rope", or "mrope": three position ids per token (session/families/mrope.py)
    processor: str = "tokenizer"  # "tokenizer", "auto" (AutoProcessor), "qwen_vl" (without its video processor)
    name: str = ""  # what people call it

    @property
    def multimodal(self) -> bool:
        return self.image_tokens != "none"

    @property
    def mrope(self) -> bool:
        return self.positions == "mrope"


_TEXT = "AutoModelForCausalLM"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llava", "LlavaForConditionalGeneration", "fixed", processor="auto", name="LLaVA-1.5"),
    Family("llava_next", "LlavaNextForConditionalGeneration", "anyres", processor="auto", name="LLaVA-NeXT"),
    Family("qwen2_vl", "Qwen2VLForConditionalGeneration", "grid", "mrope", "qwen_vl", name="Qwen2-VL"),
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "grid", "mrope", "qwen_vl", name="Qwen2.5-VL"),
    Family("llama", _TEXT, "none", name="Llama"),
    Family("mistral", _TEXT, "none", name="Mistral"),
    Family("qwen2", _TEXT, "none", name="Qwen2"),
    Family("qwen3", _TEXT, "none", name="Qwen3"),
)}


def family_of(model_type: str) -> Family | None:
    """The registry's entry for a ``model_type``, or None (``support`` says why it is refused)."""
    return FAMILIES.get(model_type)


def model_types(*, multimodal: bool) -> tuple[str, ...]:
    return tuple(t for t, f in FAMILIES.items() if f.multimodal == multimodal)
