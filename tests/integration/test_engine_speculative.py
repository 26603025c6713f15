"""Speculative decoding inside the engine: sessions across turns, adapters, concurrency, config."""

from __future__ import annotations

import threading

import pytest

from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import TERMINAL, Cancelled, EventStream, Failed, Finished, Started
from session.errors import ConfigError
from session.types import SamplingParams
from tests.conftest import REPO
from tests.integration.test_engine import finished, run, user

PAIR = REPO / "model_store" / "pair"
QUESTIONS = ["def read_config(path):", "Now write the tests for it.", "class Parser:\n    def __init__(self",
             "Explain what this does."]


def converse(engine: Engine, sid: str, adapter: str | None = None, speculative: bool = True) -> list:
    answers = []
    for step, question in enumerate(QUESTIONS):
        request = GenerationRequest(messages=user(question), sampling=SamplingParams(max_tokens=48),
                                    stream=EventStream(), session_id=sid, open_session=step == 0, adapter=adapter,
                                    speculative=speculative)
        answers.append(finished(run(engine, request)).token_ids)
    return answers


@pytest.fixture(scope="module")
def adapters_dir():
    from model_store.build_adapters import build_all

    return build_all(PAIR / "target", REPO / "models" / "adapters-pair-target", count=2)[0].parent


@pytest.fixture(scope="module")
def plain(adapters_dir):
    engine = Engine(EngineConfig(model_path=str(PAIR / "target"), speculative="off",
                                 adapters_dir=str(adapters_dir))).start()
    yield engine
    engine.stop()


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_speculative_sessions_equal_plain_across_turns(plain, adapters_dir, mode):
    engine = Engine(EngineConfig(model_path=str(PAIR / "target"), speculative=mode, adapters_dir=str(adapters_dir),
                                 draft_model_path=str(PAIR / "draft") if mode == "draft" else "")).start()
    try:
        for adapter in (None, "tone"):
            expected = converse(plain, f"plain-{mode}-{adapter}", adapter)
            got = converse(engine, f"spec-{mode}-{adapter}", adapter)
            assert got == expected
        stats = engine.stats().speculation
        assert stats["target_passes"] > 0 and stats["accepted"] > 0
        assert stats["accepted"] <= stats["proposed"]
        session = engine.parts.store.get(f"spec-{mode}-None")
        if mode == "draft":  # the draft's cache lives in the session and is counted in its bytes
            assert session.draft_kv.length > 0
            assert session.device_bytes == session.kv.nbytes + session.draft_kv.nbytes
    finally:
        engine.stop()


def test_speculation_off_per_request_and_under_concurrency(plain):
    engine = Engine(EngineConfig(model_path=str(PAIR / "target"), speculative="draft",
                                 draft_model_path=str(PAIR / "draft"))).start()
    try:
        off = converse(engine, "off", speculative=False)
        assert engine.stats().speculation["target_passes"] == 0
        assert off == converse(plain, "plain-off")
        results = {}

        def go(i):  # several sessions at once: batched plain decoding, same tokens
            results[i] = converse(engine, f"many-{i}")

        threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [results[i] for i in range(3)] == [off] * 3
    finally:
        engine.stop()


def test_draft_with_another_vocabulary_is_refused_at_start(tmp_path):
    import shutil

    from model_store.build_models import build_tokenizer

    bad = tmp_path / "bad-draft"
    shutil.copytree(PAIR / "draft", bad)
    build_tokenizer(1024).save_pretrained(bad)  # same architecture, another vocabulary
    with pytest.raises(ConfigError, match="vocabulary differs"):
        Engine(EngineConfig(model_path=str(PAIR / "target"), speculative="draft", draft_model_path=str(bad)))


def submit_all(engine: Engine, requests: list[GenerationRequest]) -> list:
    """Submit every request before reading any answer, so they decode together."""
    for request in requests:
        engine.submit(request)
    answers = []
    for request in requests:
        while not isinstance(event := request.stream.get(timeout=300), (Finished, Failed, Cancelled)):
            pass
        answers.append(finished([event]).token_ids)
    return answers


def session_turns(num_sessions: int, step: int, prefix: str) -> list[GenerationRequest]:
    """Turn ``step`` of each session: different prompts (so different lengths), budgets, stop strings."""
    return [GenerationRequest(
        messages=user(QUESTIONS[(i + step) % len(QUESTIONS)] + " x" * i),
        sampling=SamplingParams(max_tokens=40 - 2 * i, stop=("):",) if i % 3 == 2 else ()),
        stream=EventStream(), session_id=f"{prefix}-{i}", open_session=step == 0) for i in range(num_sessions)]


@pytest.mark.parametrize("attention", ["per_row", "batched"])
@pytest.mark.parametrize("num_sessions", [1, 3, 8])
def test_concurrent_sessions_speculate_in_one_batched_pass(plain, num_sessions, attention):
    """N sessions decoding at once speculate together: one target pass verifies every row (the verify
    batches reach N rows), and every answer, over two turns, equals plain decoding's token for token.
    Stop strings end some answers inside a speculative run (the rest of the run is rewound)."""
    engine = Engine(EngineConfig(model_path=str(PAIR / "target"), speculative="draft", max_batch_size=8,
                                 draft_model_path=str(PAIR / "draft"), check_invariants=True,
                                 attention=attention)).start()
    verify_rows: list[int] = []
    extend = engine.parts.runner.extend

    def recording(kvs, token_rows, adapter_slots=None):
        verify_rows.append(len(kvs))
        return extend(kvs, token_rows, adapter_slots)

    engine.parts.runner.extend = recording  # the speculator's target is the engine's runner
    try:
        for step in range(2):
            expected = [finished(run(plain, request)).token_ids
                        for request in session_turns(num_sessions, step, f"plain-{num_sessions}-{attention}")]
            got = submit_all(engine, session_turns(num_sessions, step, f"spec-{num_sessions}"))
            assert got == expected
        assert max(verify_rows) == num_sessions
        stats = engine.stats()
        assert stats.speculation["accepted"] > 0
        assert engine.num_invariant_violations == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("mode,fault", [("draft", False), ("ngram", False), ("draft", True)],
                         ids=["draft", "ngram", "draft, a faulty pass"])
def test_a_verify_feeds_the_steps_prompt_chunks_in_its_one_target_pass(plain, mode, fault):
    """Sessions speculate while new prompts arrive and are fed in 16-token chunks: a step that speculates
    and feeds chunks runs ONE target pass (the verify's rows and the chunks packed), and every answer
    equals plain decoding's token for token. With ``fault`` the first such pass raises after it ran
    (its caches advanced): the step runs again with its parts apart (the rows in a plain decode step),
    and every answer is still exact."""
    engine = Engine(EngineConfig(model_path=str(PAIR / "target"), speculative=mode, step_token_budget=16,
                                 draft_model_path=str(PAIR / "draft") if mode == "draft" else None,
                                 check_invariants=True)).start()
    runner, speculator = engine.parts.runner, engine.parts.executor.speculator
    faults = [fault]
    step = runner.step

    def faulty_step(chunks, rows):
        out = step(chunks, rows)
        if faults and chunks and rows is not None and rows.ahead and faults.pop(0):
            raise RuntimeError("injected fault in a verify pass with chunks")
        return out

    runner.step = faulty_step
    steps: list[tuple[int, int, int]] = []  # per step with chunks: (chunks, rows that speculated, target passes)
    original = engine._steps.run

    def counted(plan, ended):
        passes, speculated = runner.num_passes, speculator.num_steps
        original(plan, ended)
        if plan.prefill:
            steps.append((len(plan.prefill), speculator.num_steps - speculated, runner.num_passes - passes))

    engine._steps.run = counted

    def ask(i: int, text: str, max_tokens: int) -> GenerationRequest:
        return GenerationRequest(messages=user(text), sampling=SamplingParams(max_tokens=max_tokens),
                                 stream=EventStream(), session_id=f"packed-{mode}-{fault}-{i}", open_session=True)

    streams = [(QUESTIONS[i], 48) for i in range(2)]
    prompts = [(QUESTIONS[2 + i % 2] + " Then explain it line by line." * (i + 1), 12) for i in range(3)]
    try:
        expected = [finished(run(plain, ask(100 + i, text, n))).token_ids
                    for i, (text, n) in enumerate(streams + prompts)]
        decoding = [ask(i, text, n) for i, (text, n) in enumerate(streams)]
        for request in decoding:
            engine.submit(request)
        for request in decoding:  # both streams answer (and speculate) before the prompts arrive
            while not isinstance(request.stream.get(timeout=60), Started):
                pass
        arriving = [ask(2 + i, text, n) for i, (text, n) in enumerate(prompts)]
        got = submit_all(engine, arriving)
        for request in decoding:
            while not isinstance(event := request.stream.get(timeout=60), TERMINAL):
                pass
            got.insert(len(got) - len(arriving), finished([event]).token_ids)
        assert got == expected
        packed = [passes for _, speculated, passes in steps if speculated]
        assert packed and all(passes == 1 for passes in packed), steps  # speculated and fed chunks: one pass
        if fault:  # the failed pass, then the chunk alone and the rows in a plain decode step
            assert faults == [] and engine.fresh_stats().events["steps_run_apart"] == 1
            assert [passes for _, speculated, passes in steps if not speculated and passes != 1] == [3], steps
        assert engine.num_invariant_violations == 0
    finally:
        engine.stop()
