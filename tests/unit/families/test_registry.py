"""The family registry is the one table of model types: support admits exactly its entries, and
each entry names a class transformers has."""

from __future__ import annotations

import transformers

from session.families import support
from session.families.registry import FAMILIES, family_of, model_types


def test_support_admits_exactly_the_registry():
    assert set(support.SUPPORTED_VLMS) | set(support.SUPPORTED_TEXT_MODELS) == set(FAMILIES)
    assert set(support.MROPE_VLMS) == {"qwen2_vl", "qwen2_5_vl"}
    assert not set(support.KNOWN_UNSUPPORTED) & set(FAMILIES)


def test_each_entry_names_a_transformers_class_and_a_consistent_scheme():
    for family in FAMILIES.values():
        assert hasattr(transformers, family.hf_class), family.hf_class
        assert family.image_tokens in ("none", "fixed", "anyres", "grid")
        assert family.mrope == (family.image_tokens == "grid")  # Qwen-VL: grids lay out the M-RoPE positions
        assert (family.processor == "tokenizer") == (not family.multimodal)


def test_lookups():
    assert family_of("llava_next").image_tokens == "anyres"
    assert family_of("gemma") is None
    assert model_types(multimodal=False) == ("llama", "mistral", "qwen2", "qwen3")
