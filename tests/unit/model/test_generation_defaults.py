"""session/model/generation_defaults.py: which of a checkpoint's generation defaults the engine reports."""

from __future__ import annotations

from transformers import GenerationConfig

from session.model.generation_defaults import describe, unapplied_generation_defaults


def test_defaults_that_change_nothing_are_not_reported():
    assert unapplied_generation_defaults(GenerationConfig()) == {}
    neutral = GenerationConfig(repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1, do_sample=False,
                               temperature=0.7, eos_token_id=[2, 3], bos_token_id=1, max_new_tokens=50)
    assert unapplied_generation_defaults(neutral) == {}  # sampling settings without do_sample: unused by generate


def test_defaults_that_change_greedy_output_are_reported_by_name():
    config = GenerationConfig(repetition_penalty=1.1, no_repeat_ngram_size=3, suppress_tokens=[5], min_new_tokens=2)
    assert unapplied_generation_defaults(config) == {"repetition_penalty": 1.1, "no_repeat_ngram_size": 3,
                                                     "suppress_tokens": [5], "min_new_tokens": 2}


def test_sampling_by_default_is_reported_with_its_settings():
    config = GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9)
    unapplied = unapplied_generation_defaults(config)
    assert unapplied == {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    assert describe(unapplied).startswith("the model's generation_config.json sets do_sample=True, temperature=0.2, "
                                          "top_p=0.9, which transformers' generate() applies by default")
