"""Session memory: byte budget, tiers, shared embeddings, journal recovery, overload (docs/DESIGN.md, "Invariants")."""

from __future__ import annotations

import threading
import time

import pytest

from session.config import EngineConfig
from session.engine import CloseRequest, Engine, GenerationRequest
from session.engine.events import EventStream, Failed, Finished
from session.errors import ContextLengthExceeded
from session.state.session import Tier
from session.types import SamplingParams
from tests.conftest import make_image, png_bytes
from tests.integration.test_engine import QUESTIONS, FakeClock, finished, run, turn

BLOCK = 64
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # tiny model: 2 layers, 2 KV heads, head_dim 16, float32
NUM_SESSIONS = 12
TURNS = 3


def engine_with(tiny_model_path, **overrides) -> Engine:
    config = EngineConfig(model_path=str(tiny_model_path), kv_block_tokens=BLOCK, reaper_interval_s=0.05,
                          **overrides)
    return Engine(config).start()


def image_request(engine, sid, seed, question, **kwargs):
    image = make_image(seed)
    raw = png_bytes(image)
    import hashlib

    return GenerationRequest(
        messages=_user(question, image=True), sampling=SamplingParams(max_tokens=kwargs.get("max_tokens", 12)),
        stream=EventStream(), session_id=sid, open_session=True, images=engine.preprocess_images([image]),
        image_digests=(hashlib.sha256(raw).hexdigest(),), image_bytes=(raw,))


def _user(text, image=False):
    from tests.integration.test_engine import user

    return user(text, image=image)


def round_robin(engine: Engine, sample: list | None = None) -> dict[int, list]:
    """12 sessions, their turns interleaved one session after another; returns tokens per session."""
    answers: dict[int, list] = {i: [] for i in range(NUM_SESSIONS)}
    for step in range(TURNS):
        for i in range(NUM_SESSIONS):
            sid = f"mem-{i}"
            if step == 0:
                events = run(engine, image_request(engine, sid, 200 + i, QUESTIONS[0]))
            else:
                events = turn(engine, sid, QUESTIONS[step])
            answers[i].append(finished(events).token_ids)
            if sample is not None:
                sample.append(engine.parts.memory.device_bytes)
    return answers


@pytest.fixture(scope="module")
def unlimited_answers(tiny_model_path):
    engine = engine_with(tiny_model_path)
    try:
        return round_robin(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("attention", ["per_row", "batched"])
@pytest.mark.parametrize("host_budget", [1 << 30, 0, 3 * BLOCK_BYTES], ids=["host-tier", "drop-only", "small-host"])
def test_budget_for_three_sessions_serves_twelve_exactly(tiny_model_path, unlimited_answers, host_budget, attention):
    budget = 3 * 2 * BLOCK_BYTES  # about three sessions of two blocks each
    engine = engine_with(tiny_model_path, device_budget_bytes=budget, host_budget_bytes=host_budget,
                         attention=attention)
    samples: list[int] = []
    stop = threading.Event()

    def sampler():  # resident bytes, sampled from another thread while the engine runs
        while not stop.is_set():
            samples.append(engine.parts.memory.device_bytes)
            time.sleep(0.001)

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        answers = round_robin(engine, samples)
    finally:
        stop.set()
        thread.join()
        engine.stop()
    assert answers == unlimited_answers
    assert max(samples) <= budget and engine.parts.memory.peak_device_bytes <= budget
    memory = engine.parts.memory
    assert memory.num_to_host + memory.num_dropped > 0
    assert memory.num_restored_from_host + memory.num_recomputed > 0
    if host_budget == 0:
        assert memory.num_to_host == 0 and memory.num_recomputed >= NUM_SESSIONS
    if host_budget == 1 << 30:
        assert memory.num_dropped == 0 and memory.num_restored_from_host >= NUM_SESSIONS
    if host_budget == 3 * BLOCK_BYTES:
        assert memory.num_to_host > 0 and memory.num_dropped > 0


def test_restored_session_reports_what_it_reused(tiny_model_path):
    engine = engine_with(tiny_model_path, device_budget_bytes=2 * BLOCK_BYTES, host_budget_bytes=0)
    try:
        first = run(engine, image_request(engine, "a", 1, QUESTIONS[0]))  # one block
        run(engine, image_request(engine, "b", 2, QUESTIONS[0], max_tokens=60))  # two blocks: "a" is dropped
        assert engine.parts.store.get("a").tier is Tier.DROPPED
        assert engine.parts.store.get("a").device_bytes == 0
        again = turn(engine, "a", QUESTIONS[1])
        assert again[0].cached_tokens == 0  # recomputed, not served from cache
        assert again[0].prompt_tokens > first[0].prompt_tokens
        assert engine.parts.store.get("a").tier is Tier.DEVICE
    finally:
        engine.stop()


def test_same_image_is_encoded_once_and_freed_with_its_last_session(tiny_model_path):
    engine = engine_with(tiny_model_path)
    try:
        run(engine, image_request(engine, "one", 7, QUESTIONS[0]))
        run(engine, image_request(engine, "two", 7, QUESTIONS[1]))
        assert (engine.parts.embeddings.num_misses, engine.parts.embeddings.num_hits) == (1, 1)
        assert len(engine.parts.embeddings) == 1 and engine.parts.embeddings.get(
            engine.parts.store.get("one").image_digests[0]).refs == 2
        run(engine, CloseRequest("one", EventStream()))
        assert len(engine.parts.embeddings) == 1
        run(engine, CloseRequest("two", EventStream()))
        assert len(engine.parts.embeddings) == 0 and engine.parts.embeddings.nbytes == 0
    finally:
        engine.stop()


def test_journal_restores_sessions_after_a_crash(tiny_model_path, unlimited_answers, tmp_path):
    journal = tmp_path / "journal"
    crashed = engine_with(tiny_model_path, journal_dir=str(journal))
    for i in range(2):
        run(crashed, image_request(crashed, f"mem-{i}", 200 + i, QUESTIONS[0]))
        turn(crashed, f"mem-{i}", QUESTIONS[1])
    crashed.stop()  # the process "dies": nothing is cleaned up
    (journal / "sessions" / "garbage.json").write_text("{not json")
    (journal / "sessions" / "partial.json").write_text('{"version": 1, "session_id": "partial"}')
    restarted = engine_with(tiny_model_path, journal_dir=str(journal))
    try:
        assert restarted.parts.sessions.num_journal_restored == 2
        assert restarted.parts.journal.num_corrupt == 2
        assert sorted(p.name for p in (journal / "sessions").glob("*.corrupt")) == ["garbage.corrupt",
                                                                                   "partial.corrupt"]
        for i in range(2):
            session = restarted.parts.store.get(f"mem-{i}")
            assert session.tier is Tier.DROPPED and session.device_bytes == 0
            events = turn(restarted, f"mem-{i}", QUESTIONS[2])
            assert finished(events).token_ids == unlimited_answers[i][2]
        assert restarted.parts.memory.num_recomputed == 2
        run(restarted, CloseRequest("mem-0", EventStream()))
        assert not (journal / "sessions" / "mem-0.json").exists()
        assert (journal / "sessions" / "mem-1.json").exists()
        assert len(list((journal / "images").iterdir())) == 1  # mem-0's image went with it
    finally:
        restarted.stop()


def test_expiry_frees_memory_and_journal_without_a_request(tiny_model_path, tmp_path):
    clock = FakeClock()
    config = EngineConfig(model_path=str(tiny_model_path), session_ttl_s=10, reaper_interval_s=0.02,
                          journal_dir=str(tmp_path))
    engine = Engine(config, clock=clock).start()
    try:
        run(engine, image_request(engine, "ttl", 3, QUESTIONS[0]))
        assert (tmp_path / "sessions" / "ttl.json").exists() and len(list((tmp_path / "images").iterdir())) == 1
        clock.now += 11
        deadline = time.monotonic() + 30  # generous: CI machines are shared

        def freed() -> bool:  # the reaper runs on the engine thread: wait for all of its clean-up
            return (len(engine.parts.store) == 0 and engine.parts.memory.device_bytes == 0 and len(engine.parts.embeddings) == 0
                    and not (tmp_path / "sessions" / "ttl.json").exists()
                    and list((tmp_path / "images").iterdir()) == [])

        while not freed() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.parts.store) == 0 and engine.parts.memory.device_bytes == 0 and len(engine.parts.embeddings) == 0
        assert not (tmp_path / "sessions" / "ttl.json").exists()
        assert list((tmp_path / "images").iterdir()) == []
    finally:
        engine.stop()


def test_overload_waits_for_room_instead_of_failing(tiny_model_path):
    # Room for one session's KV: concurrent new sessions beyond it find every resident session busy,
    # so they wait (the scheduler asks the KV manager) until one ends and can be demoted.
    engine = engine_with(tiny_model_path, device_budget_bytes=BLOCK_BYTES * 2, host_budget_bytes=0)
    results: list = []
    lock = threading.Lock()

    def go(i):
        request = GenerationRequest(messages=_user(f"question {i}"), sampling=SamplingParams(max_tokens=40),
                                    stream=EventStream(), session_id=f"burst-{i}", open_session=True)
        events = run(engine, request)
        with lock:
            results.append(events[-1])

    try:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 6 and all(isinstance(r, Finished) for r in results), results
        assert engine.parts.scheduler.num_waited_for_room >= 1  # (the old engine failed these with 503)
        assert engine.parts.memory.peak_device_bytes <= BLOCK_BYTES * 2
        assert engine.parts.memory.num_dropped >= 4  # room for 2 of the 6: the others' made by demoting
        after = turn(engine, None, "and now?")
        assert isinstance(after[-1], Finished)
    finally:
        engine.stop()


def test_per_session_token_cap_is_a_clear_400(tiny_model_path):
    engine = engine_with(tiny_model_path, max_session_tokens=80)
    try:
        turn(engine, "cap", QUESTIONS[0], open_session=True, max_tokens=10)
        over = turn(engine, "cap", "tell me more " * 10, max_tokens=10)
        assert isinstance(over[-1], Failed) and isinstance(over[-1].error, ContextLengthExceeded)
        assert over[-1].error.status == 400 and "per-session cap of 80" in over[-1].error.message
    finally:
        engine.stop()
