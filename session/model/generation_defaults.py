"""The model's ``generation_config.json`` defaults that this engine does not apply, reported at start-up.

transformers' ``generate`` applies a checkpoint's generation defaults to every call that does not
override them; the engine decodes as its requests say (greedy unless a request sets a temperature,
no penalties) and honours only the config's extra EOS ids (``model_info`` in session/model/loader.py). So a checkpoint
whose defaults would change what ``generate`` produces (a repetition penalty, banned or forced
tokens, a minimum length, beams, or sampling by default) answers differently from ``generate``
run with those defaults, and says so once, in a start-up log line naming each setting.

Who calls this: ``ModelRunner`` after loading the model.
"""

from __future__ import annotations

# Each setting that changes greedy decoding, and its value that changes nothing.
GREEDY_CHANGING = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": 0,
    "num_beams": 1, "exponential_decay_length_penalty": None,
}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p")


def unapplied_generation_defaults(generation_config) -> dict:
    """Name -> value of each default in ``generation_config`` that would change ``generate``'s output and
    that the engine does not apply; empty when it would decode the same."""
    unapplied = {}
    for name, neutral in GREEDY_CHANGING.items():
        value = getattr(generation_config, name, None)
        if value is not None and value != neutral and value != []:
            unapplied[name] = value
    if getattr(generation_config, "do_sample", None):
        unapplied["do_sample"] = True
        unapplied.update({name: getattr(generation_config, name) for name in SAMPLING
                          if getattr(generation_config, name, None) is not None})
    return unapplied


def describe(unapplied: dict) -> str:
    """The start-up warning for ``unapplied`` (non-empty)."""
    settings = ", ".join(f"{name}={value!r}" for name, value in unapplied.items())
    return (f"the model's generation_config.json sets {settings}, which transformers' generate() applies by "
            "default and this engine does not: a request decodes greedily unless it sets temperature/top_p, "
            "with no penalties or forced tokens, so answers differ from generate() run with those defaults")
