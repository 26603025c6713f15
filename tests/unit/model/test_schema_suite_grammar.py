"""The structured-output schema suite (tests/schema_suite.py) under llguidance with SmolLM2's tokenizer.

Every schema compiles with llguidance's default options; one answer per schema, drawn from seeded
random logits under the mask, is JSON that validates against its schema, and the default grammar
(flexible whitespace) accepts it and then EOS. Every UNSUPPORTED schema gives an error matcher that
names its keyword. The last tests pin how a grammar ends and how a padded vocabulary is masked,
which the engine's sampler relies on.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import transformers

from tests.schema_suite import SCHEMAS, UNSUPPORTED, SampledAnswer, format_checker, sample_answer

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "smollm2-135m-instruct"
SCHEMA_BY_NAME = dict(SCHEMAS)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def num_vocab() -> int:
    """The model's vocabulary (rows of the logits), which the bitmask covers."""
    return json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer, num_vocab) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=num_vocab)


@pytest.fixture(scope="module")
def answers(tokenizer) -> dict[str, SampledAnswer]:
    return {name: sample_answer(tokenizer, name, schema) for name, schema in SCHEMAS}


def compile_default(tokenizer: llguidance.LLTokenizer, schema: dict) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)


def allowed_ids(matcher: llguidance.LLMatcher, num_vocab: int) -> list[int]:
    bitmask = llg_numpy.allocate_token_bitmask(1, num_vocab)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask)
    return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:num_vocab]).tolist()


def test_the_suite_names_at_least_sixty_distinct_schemas():
    names = [name for name, _ in SCHEMAS]
    assert len(names) >= 60
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", list(SCHEMA_BY_NAME))
def test_schema_compiles_with_default_options(tokenizer, name):
    matcher = compile_default(tokenizer, SCHEMA_BY_NAME[name])
    assert not matcher.is_error(), matcher.get_error()


@pytest.mark.parametrize("name", list(SCHEMA_BY_NAME))
def test_sampled_answer_validates_against_its_schema(hf_tokenizer, answers, name):
    answer = answers[name]
    assert answer.stop_reason in ("NoExtension", "EndOfSentence"), f"{name}: no end in {len(answer.token_ids)} tokens"
    value = json.loads(hf_tokenizer.decode(answer.token_ids))
    jsonschema.validate(value, SCHEMA_BY_NAME[name], format_checker=format_checker())


@pytest.mark.parametrize("name", list(SCHEMA_BY_NAME))
def test_default_grammar_accepts_the_answer_then_eos(tokenizer, answers, num_vocab, name):
    matcher = compile_default(tokenizer, SCHEMA_BY_NAME[name])
    assert matcher.consume_tokens(answers[name].token_ids), matcher.get_error()
    assert matcher.is_accepting()
    assert tokenizer.eos_token in allowed_ids(matcher, num_vocab)
    assert matcher.consume_token(tokenizer.eos_token)
    assert matcher.is_stopped() and not matcher.is_error()


@pytest.mark.parametrize(("name", "schema", "keyword"), UNSUPPORTED, ids=[name for name, _, _ in UNSUPPORTED])
def test_unsupported_schema_gives_an_error_matcher_naming_the_keyword(tokenizer, name, schema, keyword):
    matcher = compile_default(tokenizer, schema)
    assert matcher.is_error()
    assert keyword in matcher.get_error()


def test_a_closed_grammar_stops_and_then_allows_only_eos(tokenizer, hf_tokenizer, num_vocab):
    """After the last '}' nothing can extend the answer: the matcher is stopped (NoExtension) before
    any EOS, its mask holds EOS alone, and consuming EOS there is not an error."""
    matcher = compile_default(tokenizer, SCHEMA_BY_NAME["ref_legacy_definitions"])
    assert matcher.consume_tokens(hf_tokenizer.encode('{"amount":12,"currency":"EUR"}', add_special_tokens=False))
    assert matcher.is_stopped() and matcher.is_accepting()
    assert matcher.stop_reason() == "NoExtension"
    assert allowed_ids(matcher, num_vocab) == [tokenizer.eos_token]
    assert matcher.consume_token(tokenizer.eos_token) and not matcher.is_error()


def test_an_open_grammar_allows_eos_beside_more_digits(tokenizer, hf_tokenizer, num_vocab):
    """'8' may become '80' or end: accepting but not stopped, EOS allowed with the digits; EOS ends it."""
    matcher = compile_default(tokenizer, SCHEMA_BY_NAME["integer"])
    assert matcher.consume_tokens(hf_tokenizer.encode("8", add_special_tokens=False))
    assert matcher.is_accepting() and not matcher.is_stopped()
    allowed = allowed_ids(matcher, num_vocab)
    assert tokenizer.eos_token in allowed and len(allowed) > 1
    assert matcher.consume_token(tokenizer.eos_token)
    assert matcher.stop_reason() == "EndOfSentence"


def test_eos_is_masked_until_the_grammar_accepts(tokenizer, hf_tokenizer, num_vocab):
    matcher = compile_default(tokenizer, SCHEMA_BY_NAME["flat_object"])
    assert matcher.consume_tokens(hf_tokenizer.encode('{"name":"a"', add_special_tokens=False))
    assert not matcher.is_accepting()
    assert tokenizer.eos_token not in allowed_ids(matcher, num_vocab)


def test_vocabulary_padding_beyond_the_tokenizer_is_never_allowed(hf_tokenizer):
    """A model whose logits have more rows than the tokenizer has tokens: the padding ids are masked
    and consuming one puts the matcher in error."""
    padded = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer) + 128)
    matcher = compile_default(padded, {"type": "boolean"})
    allowed = allowed_ids(matcher, padded.vocab_size)
    assert allowed and max(allowed) < len(hf_tokenizer)
    assert not matcher.consume_token(len(hf_tokenizer) + 5)
    assert matcher.is_error()
