"""The output processor on its own: incremental text equals decoding the whole answer, stop strings,
held-back text, usage, and the cost of detokenising a long answer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from session.events import Finished, TextDelta
from session.outputs import Detokenizer, OutputProcessor
from session.protocol import SamplingParams
from session.sequence import Sequence


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


class Stream:
    def __init__(self):
        self.events = []

    def put(self, event):
        self.events.append(event)


def make_seq(max_tokens=64, stop=()):
    request = SimpleNamespace(sampling=SamplingParams(max_tokens=max_tokens, stop=tuple(stop)), stream=Stream(),
                              request_id="r")
    session = SimpleNamespace(token_ids=[], ephemeral=False, session_id="s", ended_with_eos=False)
    return Sequence(request=request, session=session, prompt_tokens=7, cached_tokens=3)


def test_incremental_text_equals_decoding_the_whole_answer(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        detok = Detokenizer(tokenizer)
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stream_and_final_text_agree_and_usage_counts(tokenizer):
    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,))
    seq = make_seq(max_tokens=20)
    processor.start(seq)
    ids = tokenizer.encode("def main():\n    return 42  # the answer", add_special_tokens=False)[:20]
    finished = None
    for token in ids:
        assert finished is None
        finished = processor.on_token(seq, token)
    streamed = "".join(e.text for e in seq.request.stream.events if isinstance(e, TextDelta))
    if finished is None:  # shorter than max_tokens: end it with EOS
        finished = processor.on_token(seq, tokenizer.eos_token_id)
    assert isinstance(finished, Finished)
    assert finished.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert finished.text.startswith(streamed)
    assert seq.session.token_ids == list(finished.token_ids)
    assert (finished.usage.prompt_tokens, finished.usage.cached_tokens) == (7, 3)
    assert finished.usage.completion_tokens == len(finished.token_ids)


def test_a_stop_string_ends_the_answer_and_is_never_streamed(tokenizer):
    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,))
    seq = make_seq(max_tokens=50, stop=["return"])
    processor.start(seq)
    finished = None
    for token in tokenizer.encode("def main():\n    return 42", add_special_tokens=False):
        finished = processor.on_token(seq, token)
        if finished is not None:
            break
    assert finished is not None and finished.finish_reason == "stop"
    assert finished.text == "def main():\n    "
    streamed = "".join(e.text for e in seq.request.stream.events if isinstance(e, TextDelta))
    assert streamed == finished.text  # "ret..." was held back, never sent


def test_max_tokens_ends_with_length(tokenizer):
    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,))
    seq = make_seq(max_tokens=3)
    processor.start(seq)
    results = [processor.on_token(seq, t) for t in tokenizer.encode("a b c d e", add_special_tokens=False)[:3]]
    assert results[:2] == [None, None] and results[2].finish_reason == "length"


def test_detokenising_a_long_answer_decodes_short_windows(tokenizer):
    """Linear, not quadratic: each token decodes a window of a few tokens, not the answer so far."""
    decoded = []
    counting = SimpleNamespace(decode=lambda ids, **kw: decoded.append(len(ids)) or tokenizer.decode(ids, **kw))
    detok = Detokenizer(counting)
    text = "The quick brown fox jumps over the lazy dog. " * 60
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.add(token)
    assert detok.text == text
    assert max(decoded) <= 8  # windows stay short however long the answer grows
