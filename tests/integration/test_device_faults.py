"""Device faults on the real Engine with a fake runner (docs/ENGINE.md, "A step"): an OOM fails only
what does not fit (503, Retry-After) after the batch is retried smaller, and a fatal CUDA error fails
every request, stops the heartbeat and hands the error to ``on_fatal`` (the worker's exit)."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest

import session.engine.assembly
import session.engine.executor
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import TERMINAL, EventStream, Failed, Finished, Started
from session.errors import DeviceFailed, DeviceOutOfMemory, ServiceStopping
from session.types import SamplingParams
from tests.fake_runner import ILLEGAL_ADDRESS, FakeRunner, greedy_answer, injected_oom

VOCAB, EOS, IMAGE = 500, (2,), 499
POISON = 498  # with runner.oom_token = POISON, a decode with that request's row runs out of memory, alone too
PROMPTS = [[11, 13, 17], [19, 23, 29], [31, 37, 41], [43, 47, 53]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def processing(tiny_model_path):
    return functools.lru_cache(maxsize=None)(session.engine.assembly._load_processing)


@pytest.fixture
def make_engine(tiny_model_path, processing, monkeypatch, tmp_path):
    monkeypatch.setattr(session.engine.assembly, "_load_processing", processing)
    engines = []

    def make(speculative: str = "off", on_fatal=None) -> Engine:
        config = EngineConfig(model_path=str(tiny_model_path), max_batch_size=4, check_invariants=True,
                              reaper_interval_s=0.05, speculative=speculative,
                              heartbeat_file=str(tmp_path / f"heartbeat-{len(engines)}"))
        engine = Engine(config, runner=FakeRunner(vocab_size=VOCAB, eos_token_ids=EOS, image_token_id=IMAGE),
                        on_fatal=on_fatal or unexpected_fatal)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def unexpected_fatal(error: BaseException) -> None:
    raise AssertionError(f"on_fatal called: {error!r}")


def request(prompt: list[int], sampling: SamplingParams | None = None, **kwargs) -> GenerationRequest:
    return GenerationRequest(messages=(), sampling=sampling or SamplingParams(max_tokens=MAX_TOKENS),
                             stream=EventStream(), token_ids=prompt, **kwargs)


def serve(engine: Engine, requests: list[GenerationRequest], max_steps: int = 200) -> list[list]:
    """Submit every request before the first step (they then decode together), step the engine on this
    thread until each has its final event; returns each request's events."""
    for item in requests:
        engine.submit(item)
    events: list[list] = [[] for _ in requests]
    for _ in range(max_steps):
        engine.step()
        for item, seen in zip(requests, events):
            while not seen or not isinstance(seen[-1], TERMINAL):
                try:
                    seen.append(item.stream.get_nowait())
                except Exception:
                    break
        if all(seen and isinstance(seen[-1], TERMINAL) for seen in events):
            return events
    raise AssertionError(f"not all requests ended within {max_steps} steps: {events}")


def tokens(events: list) -> list[int]:
    assert isinstance(events[-1], Finished), events[-1]
    return list(events[-1].token_ids)


def expected(prompt: list[int]) -> list[int]:
    return greedy_answer(prompt, MAX_TOKENS, VOCAB, EOS, image_token_id=IMAGE)


def test_prompts_decode_in_full():
    """The scenarios below count steps: every answer runs to max_tokens (no EOS)."""
    assert all(len(expected(p)) == MAX_TOKENS for p in PROMPTS + [PROMPTS[3][:2] + [POISON]])


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_oom_above_two_rows_retries_smaller_and_every_answer_is_exact(make_engine, speculative):
    clean = make_engine(speculative)
    baseline = [tokens(e) for e in serve(clean, [request(p) for p in PROMPTS])]
    assert baseline == [expected(p) for p in PROMPTS]
    assert clean.stats().events["oom_retries"] == 0 and clean.parts.runner.num_ooms == 0

    engine = make_engine(speculative)
    runner: FakeRunner = engine.parts.runner
    runner.oom_over_rows = 2
    events = serve(engine, [request(p) for p in PROMPTS])
    assert [tokens(e) for e in events] == baseline
    stats = engine.stats()
    # Each OOM (a decode of 3 or 4 rows) is retried once as two halves, which fit.
    assert stats.events["oom_retries"] == runner.num_ooms == engine.num_oom_retries
    if speculative == "off":  # the four prompts share the first step (the token budget holds them),
        assert runner.num_ooms == MAX_TOKENS - 1  # then every decode step has four rows
    assert stats.events["oom_failures"] == 0 and stats.requests["failed"] == 0
    assert stats.requests["overloaded"] == 0 and engine.num_invariant_violations == 0


def test_a_request_that_runs_out_of_memory_alone_fails_503_and_the_others_finish_exactly(make_engine):
    engine = make_engine()
    runner: FakeRunner = engine.parts.runner
    opened = serve(engine, [request([5, 7], session_id="s1", open_session=True)])[0]
    transcript = [5, 7] + tokens(opened)
    assert engine.parts.store.peek("s1").token_ids == transcript

    runner.oom_token = POISON
    follow_up = [9, POISON]  # a resident follow-up: its step first, then it decodes beside the 3 prompts' chunks
    events = serve(engine, [request(p) for p in PROMPTS[:3]] + [request(follow_up, session_id="s1")])
    assert [tokens(e) for e in events[:3]] == [expected(p) for p in PROMPTS[:3]]
    started, failed = events[3][0], events[3][-1]
    assert isinstance(started, Started) and isinstance(failed, Failed)
    error = failed.error
    assert isinstance(error, DeviceOutOfMemory) and error.status == 503 and error.headers == {"Retry-After": "1"}
    assert error.type == "capacity_exceeded"
    # The step of 3 chunks and s1's decode row OOMs -> run apart: the chunks fit, s1's row OOMs alone: fails.
    assert runner.num_ooms == 2
    stats = engine.stats()
    assert stats.events["oom_retries"] == 1 and stats.events["oom_failures"] == 1
    assert stats.events["steps_run_apart"] == 1
    assert stats.requests["overloaded"] == 1 and stats.requests["failed"] == 1
    # Rolled back: the session is as before the failed turn, and answers the next one exactly.
    assert engine.parts.store.peek("s1").token_ids == transcript
    runner.oom_token = None
    again = serve(engine, [request([21], session_id="s1")])[0]
    assert tokens(again) == expected(transcript + [21])
    assert engine.num_invariant_violations == 0


def test_an_oom_in_prefill_fails_that_request_503_and_later_ones_are_served(make_engine):
    engine = make_engine()
    runner: FakeRunner = engine.parts.runner
    runner.fail["oom_prefill"] = 1
    events = serve(engine, [request(PROMPTS[0])])  # alone in its step: nothing smaller to run
    assert len(events[0]) == 1 and isinstance(events[0][0], Failed)  # no Started: headers not sent yet
    error = events[0][0].error
    assert isinstance(error, DeviceOutOfMemory) and error.status == 503 and error.headers == {"Retry-After": "1"}
    later = serve(engine, [request(p) for p in PROMPTS[1:3]])
    assert [tokens(e) for e in later] == [expected(p) for p in PROMPTS[1:3]]
    stats = engine.stats()
    assert stats.events["oom_failures"] == 1 and stats.events["oom_retries"] == 0
    assert stats.requests["failed"] == 1 and engine.num_invariant_violations == 0


def test_an_oom_in_a_step_of_two_prompts_runs_them_apart_and_both_are_served(make_engine):
    """The two prompts share a step; its pass runs out of memory in the first one's prefill. The step
    runs again a pass per prompt (the failed pass left both caches as before it): both answer exactly."""
    engine = make_engine()
    runner: FakeRunner = engine.parts.runner
    runner.fail["oom_prefill"] = 1
    events = serve(engine, [request(p) for p in PROMPTS[:2]])
    assert [tokens(e) for e in events] == [expected(p) for p in PROMPTS[:2]]
    stats = engine.stats()
    assert stats.events["oom_failures"] == 0 and stats.events["oom_retries"] == 1
    assert stats.events["steps_run_apart"] == 1 and engine.num_invariant_violations == 0


def test_an_oom_after_sampling_leaves_the_rows_as_before_and_sampled_answers_are_exact(make_engine, monkeypatch):
    """The OOM comes after the stepper advanced the cache lengths and after the sampled rows drew:
    ``Executor.decode`` must crop the caches and restore the generators for the retry to be exact."""
    samplings = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=i) for i in range(3)] + \
        [SamplingParams(max_tokens=MAX_TOKENS)]
    clean = make_engine()
    baseline = [tokens(e) for e in serve(clean, [request(p, s) for p, s in zip(PROMPTS, samplings)])]

    original = session.engine.executor.sample_rows
    num_raised = []

    def sample_then_oom(logits, params, generators):
        chosen = original(logits, params, generators)
        if len(params) > 2:
            num_raised.append(len(params))
            raise injected_oom("sampling")
        return chosen

    monkeypatch.setattr(session.engine.executor, "sample_rows", sample_then_oom)
    engine = make_engine()
    events = serve(engine, [request(p, s) for p, s in zip(PROMPTS, samplings)])
    assert [tokens(e) for e in events] == baseline
    # the four share the first step's budget, so every decode step has four rows
    # the first step draws the four first tokens together, then each decode step its four rows
    assert num_raised == [4] * MAX_TOKENS and engine.stats().events["oom_retries"] == MAX_TOKENS
    assert engine.num_invariant_violations == 0


def test_a_fatal_device_error_fails_everything_stops_the_heartbeat_and_calls_on_fatal_once(make_engine):
    calls: list[tuple[BaseException, str]] = []
    called = threading.Event()
    heartbeat_at_fatal: list[float] = []

    def on_fatal(error: BaseException) -> None:
        heartbeat_at_fatal.append(engine.heartbeat)
        os.utime(engine.config.heartbeat_file, (1.0, 1.0))  # a beat from now on would show
        calls.append((error, threading.current_thread().name))
        called.set()

    engine = make_engine(on_fatal=on_fatal)
    runner: FakeRunner = engine.parts.runner
    engine.start()
    warm = serve_threaded([request([3, 5])], engine)[0]  # the loop turns and beats
    assert tokens(warm) == expected([3, 5]) and os.path.getmtime(engine.config.heartbeat_file) > 1.0

    runner.fail["fatal_decode"] = 1  # the first decode below hits it: the others are waiting or queued
    requests = [request(p, session_id=f"s{i}", open_session=True) for i, p in enumerate(PROMPTS)]
    requests.append(request([61], session_id="s0"))  # queued behind s0's turn
    events = serve_threaded(requests, engine)
    assert called.wait(10.0)
    for seen in events:
        assert isinstance(seen[-1], Failed), seen
        error = seen[-1].error
        assert isinstance(error, DeviceFailed) and error.status == 500 and error.__cause__ is runner.device_error
    assert str(runner.device_error) == ILLEGAL_ADDRESS
    assert calls == [(runner.device_error, "resident-engine")]
    assert heartbeat_at_fatal[0] < runner.device_lost_at  # no beat since the device was lost, not even that step's
    assert engine.fatal_error is events[0][-1].error
    num_calls = runner.num_calls

    time.sleep(0.7)  # a live loop beats (and touches the file) at least every 0.5 s here
    assert engine.heartbeat == heartbeat_at_fatal[0] and os.path.getmtime(engine.config.heartbeat_file) == 1.0
    with pytest.raises(ServiceStopping):
        engine.submit(request([3]))
    with pytest.raises(ServiceStopping):
        engine.precheck(session_id=None, open_session=False, adapter=None)
    engine.step()  # nothing more runs on the lost device
    assert runner.num_calls == num_calls and len(calls) == 1
    stats = engine.stats()
    assert stats.requests["failed"] == 4 and stats.running_requests == 0  # the one queued was never admitted
    assert engine.num_invariant_violations == 0 and engine.parts.store.peek("s0") is None


def serve_threaded(requests: list[GenerationRequest], engine: Engine, timeout_s: float = 10.0) -> list[list]:
    for item in requests:
        engine.submit(item)
    events = []
    for item in requests:
        seen = [item.stream.get(timeout=timeout_s)]
        while not isinstance(seen[-1], TERMINAL):
            seen.append(item.stream.get(timeout=timeout_s))
        events.append(seen)
    return events

