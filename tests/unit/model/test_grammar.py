"""Constrained decoding's pieces on their own: the compiler's cache and errors, the step's bitmasks,
and the per-row logits processors (penalties, bias, EOS bans) in the order the sampler applies them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from session.errors import BadRequest
from session.model.grammar import GrammarCompiler, apply_masks, fill_masks
from session.model.sampling import RowContext, process_logits, row_logprobs
from session.types import Constraint, SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def compiler(hf_tokenizer, vocab_size):
    return GrammarCompiler(hf_tokenizer, vocab_size, [hf_tokenizer.eos_token_id], max_cached=2)


def allowed(matcher, vocab_size) -> set[int]:
    logits = torch.zeros(1, vocab_size)
    masked = apply_masks(logits, [0], fill_masks([matcher], vocab_size))
    return set(torch.isfinite(masked[0]).nonzero().flatten().tolist())


def test_a_constraint_compiles_once_and_the_cache_is_bounded(compiler):
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
               for i in range(3)]
    first = compiler.compile(Constraint.json_schema(schemas[0], "response_format"))
    again = compiler.compile(Constraint.json_schema(dict(reversed(list(schemas[0].items()))), "response_format"))
    assert again is first  # the same schema, keys in another order: one key, one grammar
    compiled = compiler.num_compiled
    for schema in schemas[1:]:
        compiler.compile(Constraint.json_schema(schema, "response_format"))
    assert compiler.num_compiled == compiled + 2
    assert compiler.compile(Constraint.json_schema(schemas[0], "response_format")) is not first  # evicted (max 2)


def test_each_row_gets_its_own_matcher_and_the_mask_follows_it(compiler, hf_tokenizer, vocab_size):
    grammar = compiler.compile(Constraint(kind="regex", source="(yes|no)", what="regex"))
    a, b = grammar.start(), grammar.start()
    yes = hf_tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1 and yes[0] in allowed(a, vocab_size)
    assert a.consume_token(yes[0])
    assert allowed(a, vocab_size) == {hf_tokenizer.eos_token_id}  # done: only EOS
    assert yes[0] in allowed(b, vocab_size)  # the other row did not move
    assert hf_tokenizer.eos_token_id not in allowed(b, vocab_size)


def test_a_bad_or_unsupported_constraint_is_a_400_naming_it(compiler):
    with pytest.raises(BadRequest, match="response_format.json_schema"):
        compiler.compile(Constraint(kind="json_schema", source='{"type": "nonsense"}', what="response_format.json_schema"))
    with pytest.raises(BadRequest, match="regex"):
        compiler.compile(Constraint(kind="regex", source="(unclosed", what="regex"))
    with pytest.raises(BadRequest, match="grammar"):
        compiler.compile(Constraint(kind="lark", source="start: undefined_rule", what="grammar"))


def test_process_logits_leaves_plain_rows_alone_and_applies_each_rows_own(vocab_size):
    logits = torch.zeros(3, 8)
    logits[:, 5] = 1.0
    rows = [RowContext(SamplingParams(max_tokens=4), [], []),
            RowContext(SamplingParams(max_tokens=4, logit_bias=((2, 3.0),), presence_penalty=0.5,
                                      frequency_penalty=0.25), [5, 5, 1], []),
            RowContext(SamplingParams(max_tokens=4, min_tokens=2, repetition_penalty=2.0), [4], [5])]
    out = process_logits(logits, rows, eos_token_ids=[7])
    assert torch.equal(out[0], logits[0])
    # row 1: bias on 2; 5 seen twice (-(0.25*2)-0.5), 1 once (-(0.25)-0.5)
    assert out[1].tolist() == [0.0, -0.75, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # row 2: 5 in the transcript (1.0/2), 4 in the answer (0*2), EOS banned below min_tokens
    assert out[2, 5].item() == 0.5 and out[2, 4].item() == 0.0 and out[2, 7].item() == float("-inf")
    assert torch.equal(logits[1], torch.tensor([0.0] * 5 + [1.0] + [0.0] * 2))  # out of place
    plain = [RowContext(SamplingParams(max_tokens=4), [], [])]
    first = logits[:1]
    assert process_logits(first, plain, [7]) is first  # no processed row: no copy


def test_a_grammar_row_and_a_free_row_in_one_batch(compiler, hf_tokenizer, vocab_size):
    grammar = compiler.compile(Constraint(kind="regex", source="[0-9]+", what="regex"))
    logits = torch.randn(2, vocab_size)
    rows = [RowContext(SamplingParams(max_tokens=4, constraint=grammar.constraint), [], [], grammar.start()),
            RowContext(SamplingParams(max_tokens=4), [], [])]
    out = process_logits(logits, rows, eos_token_ids=[hf_tokenizer.eos_token_id])
    assert torch.equal(out[1], logits[1])
    chosen = int(out[0].argmax())
    assert hf_tokenizer.decode([chosen]).strip().isdigit()
    assert torch.isinf(out[0]).sum() > vocab_size - 2000


def test_row_logprobs_are_the_models_and_top_k_is_sorted():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    out = row_logprobs(logits, [1, 0], [2, None])
    expected = torch.log_softmax(logits[0], -1)
    assert out[1] is None
    assert out[0].token_id == 1 and out[0].logprob == pytest.approx(expected[1].item())
    assert [t for t, _ in out[0].top] == [2, 1]
