"""A decode row that cannot be sampled (NaN logits) fails its own request alone: the other rows of
its batch answer exactly what they answer alone (docs/ENGINE.md, "A step"), on the fake runner."""

from __future__ import annotations

import functools

import pytest

import session.engine.assembly
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream, Failed, Finished, Started
from session.errors import ResidentError
from session.model.sampling import NOT_FINITE
from session.types import SamplingParams
from tests.fake_runner import FakeRunner, greedy_answer
from tests.integration.test_engine import run

VOCAB, EOS, IMAGE = 500, (2,), 499
POISON = 498  # a prompt holding it gets NaN logits from its 6th position on: mid-decode, in a batch


class PoisonRunner(FakeRunner):
    def __init__(self):
        super().__init__(vocab_size=VOCAB, eos_token_ids=EOS, image_token_id=IMAGE)
        self.poisoned_batch_sizes: list[int] = []  # the batch size of each step that had a NaN row

    def decode(self, kvs, token_ids, adapter_slots=None, position_offsets=None):
        logits = super().decode(kvs, token_ids, adapter_slots, position_offsets)
        for row, kv in enumerate(kvs):
            if kv.length >= 6 and POISON in [int(t) for t in kv.keys(0, kv.length)[0, :, 0].tolist()]:
                logits[row] = float("nan")
                self.poisoned_batch_sizes.append(len(kvs))
        return logits


@pytest.fixture(scope="module")
def processing():
    return functools.lru_cache(maxsize=None)(session.engine.assembly._load_processing)


def request(prompt: list[int], sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(messages=(), sampling=sampling, stream=EventStream(), token_ids=prompt)


@pytest.mark.parametrize("poisoned_sampling", [SamplingParams(max_tokens=8),
                                               SamplingParams(max_tokens=8, temperature=0.8, seed=1)],
                         ids=["greedy", "sampled"])
def test_a_nan_row_fails_alone_and_its_batch_answers_as_alone(tiny_model_path, processing, monkeypatch,
                                                              poisoned_sampling):
    monkeypatch.setattr(session.engine.assembly, "_load_processing", processing)
    runner = PoisonRunner()
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_batch_size=3, check_invariants=True),
                    runner=runner)
    prompts = [[POISON, 7, 9], [11, 13, 17], [19, 23, 29]]
    expected = [greedy_answer(p, 8, VOCAB, EOS, image_token_id=IMAGE) for p in prompts[1:]]
    assert all(POISON not in answer and len(answer) == 8 for answer in expected)  # they stay healthy
    requests = [request(prompts[0], poisoned_sampling)] + [request(p, SamplingParams(max_tokens=8))
                                                           for p in prompts[1:]]
    for item in requests:  # all waiting before the loop starts: they decode together
        engine.submit(item)
    engine.start()
    try:
        events = [run_collected(item) for item in requests]
    finally:
        engine.stop()
    failed = events[0][-1]
    assert isinstance(events[0][0], Started) and isinstance(failed, Failed)
    assert isinstance(failed.error, ResidentError) and failed.error.status == 500
    assert failed.error.message == NOT_FINITE
    assert [list(e[-1].token_ids) for e in events[1:] if isinstance(e[-1], Finished)] == expected
    assert runner.poisoned_batch_sizes == [3]  # it failed in a step shared with both others
    assert engine.num_failed == 1 and engine.num_invariant_violations == 0


def run_collected(item: GenerationRequest) -> list:
    """The events of a request already submitted, up to its final one."""
    events = []
    while not events or not isinstance(events[-1], (Finished, Failed)):
        events.append(item.stream.get(timeout=60))
    return events


def test_a_session_whose_turn_failed_answers_the_same_as_before(tiny_model_path, processing, monkeypatch):
    """The failed turn is rolled back: the session's next turn answers as if it never ran."""
    monkeypatch.setattr(session.engine.assembly, "_load_processing", processing)
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), check_invariants=True),
                    runner=PoisonRunner()).start()
    try:
        opened = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=1), stream=EventStream(),
                                   token_ids=[5], session_id="s", open_session=True)
        first = list(run(engine, opened)[-1].token_ids)
        poisoned = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=8), stream=EventStream(),
                                     token_ids=[POISON, 3], session_id="s")
        assert isinstance(run(engine, poisoned)[-1], Failed)
        follow = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=4), stream=EventStream(),
                                   token_ids=[8], session_id="s")
        answer = run(engine, follow)[-1]
        assert list(answer.token_ids) == greedy_answer([5] + first + [8], 4, VOCAB, EOS, image_token_id=IMAGE)
        assert engine.num_invariant_violations == 0
    finally:
        engine.stop()
