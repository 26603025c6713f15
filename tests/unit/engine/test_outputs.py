"""The output processor on its own: incremental text equals decoding the whole answer, stop strings,
held-back text, usage, and the cost of detokenising a long answer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from session.engine.detokenizer import Detokenizer, text_of
from session.engine.events import Finished, TextDelta
from session.engine.outputs import OutputProcessor
from session.engine.requests import Sequence
from session.families.vision import NO_IMAGES
from session.types import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


class Stream:
    def __init__(self, deltas=True):
        self.events = []
        self.deltas = deltas

    def put(self, event):
        self.events.append(event)


class FakeTranscript:
    """Sessions' two transcript writes, on the fake session."""

    def append_token(self, session, token):
        session.token_ids.append(token)

    def end_answer(self, session, ended_with_eos):
        session.ended_with_eos = ended_with_eos


def make_seq(max_tokens=64, stop=(), logprobs=None, keep_special=False):
    request = SimpleNamespace(sampling=SamplingParams(max_tokens=max_tokens, stop=tuple(stop), logprobs=logprobs),
                              stream=Stream(), request_id="r", images=NO_IMAGES, keep_special=keep_special)
    session = SimpleNamespace(token_ids=[], ephemeral=False, session_id="s", ended_with_eos=False)
    seq = Sequence(request=request, session=session, prompt_tokens=7)
    seq.turn.cached_tokens = 3
    return seq


def test_incremental_text_equals_decoding_the_whole_answer(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        detok = Detokenizer(tokenizer)
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_rust_decode_is_transformers_decode(tokenizer, monkeypatch):
    """Where the fast tokenizer's own decode adds nothing, ``text_of`` calls the Rust tokenizer directly
    (transformers' decode is never called) and gives its text, special tokens skipped; a tokenizer that
    cleans up spaces keeps transformers' decode."""
    rng = random.Random(1)
    samples = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 40))] for _ in range(300)]
    samples.append(tokenizer.all_special_ids + [5, 6] + tokenizer.all_special_ids)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in samples]
    assert tokenizer.clean_up_tokenization_spaces is False
    direct = text_of(tokenizer)
    monkeypatch.setattr(type(tokenizer), "decode", lambda *a, **k: pytest.fail("the wrapper was called"))
    assert [direct(ids) for ids in samples] == expected
    monkeypatch.undo()
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **k: calls.append(ids) or "x")
    assert text_of(tokenizer)([5]) == "x" and calls == [[5]]


def test_a_stream_without_deltas_gets_only_the_answer(tokenizer):
    """A non-streaming consumer (EventStream(deltas=False)) is sent no TextDelta; Finished's text is the
    one a streaming consumer assembles, stop strings applied alike."""
    ids = tokenizer.encode("def main():\n    return 42  # the answer", add_special_tokens=False)[:20]
    results = {}
    for deltas in (True, False):
        processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,), transcript=FakeTranscript())
        seq = make_seq(max_tokens=len(ids), stop=["42"])
        seq.request.stream = Stream(deltas=deltas)
        processor.start(seq)
        finished = next(f for f in (processor.on_token(seq, t) for t in ids) if f is not None)
        results[deltas] = (finished.text, finished.finish_reason,
                           [type(e).__name__ for e in seq.request.stream.events],
                           "".join(e.text for e in seq.request.stream.events if isinstance(e, TextDelta)))
    assert results[True][1] == results[False][1] == "stop"
    assert results[True][0] == results[False][0] == results[True][3] != ""
    assert "TextDelta" in results[True][2] and "TextDelta" not in results[False][2]


def test_stream_and_final_text_agree_and_usage_counts(tokenizer):
    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,), transcript=FakeTranscript())
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
    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,), transcript=FakeTranscript())
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
    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,), transcript=FakeTranscript())
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


def test_logprobs_travel_with_the_text_they_made_and_eos_is_left_out(tokenizer):
    """Each TextDelta carries the log-probabilities of the tokens recorded since the last one; Finished
    has every answer token's, the EOS that ended it excluded."""
    from session.types import TokenLogprob

    processor = OutputProcessor(tokenizer, eos_token_ids=(tokenizer.eos_token_id,), transcript=FakeTranscript())
    seq = make_seq(max_tokens=20, logprobs=1)
    processor.start(seq)
    ids = tokenizer.encode("one two three four", add_special_tokens=False) + [tokenizer.eos_token_id]
    finished = None
    for i, token in enumerate(ids):
        seq.logprobs.append(TokenLogprob(token_id=token, logprob=-float(i), top=((token, -float(i)),)))
        finished = processor.on_token(seq, token)
    streamed = [entry.token_id for e in seq.request.stream.events if isinstance(e, TextDelta) for entry in e.logprobs]
    assert streamed == ids[:-1]
    assert [entry.token_id for entry in finished.logprobs] == ids[:-1]
    assert [entry.logprob for entry in finished.logprobs] == [-float(i) for i in range(len(ids) - 1)]


def test_an_answer_asked_with_special_tokens_keeps_their_text(tokenizer):
    """keep_special (tool-call parsing reads markers that are special tokens): the text holds them."""
    special = tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens[0])
    assert special != tokenizer.eos_token_id or len(tokenizer.all_special_tokens) == 1
    ids = tokenizer.encode("hello", add_special_tokens=False) + [special]
    texts = {}
    for keep in (False, True):
        processor = OutputProcessor(tokenizer, eos_token_ids=(-1,), transcript=FakeTranscript())
        seq = make_seq(max_tokens=len(ids), keep_special=keep)
        processor.start(seq)
        texts[keep] = [processor.on_token(seq, t) for t in ids][-1].text
    assert texts[True] == texts[False] + tokenizer.all_special_tokens[0]
