"""Randomized schedules against the engine's invariant (docs/ENGINE.md), on a fake runner.

Each schedule is drawn from a seeded generator: arrivals of stateless requests, new sessions and
follow-ups (with images, with adapters), random ``max_tokens``, closes (also of busy sessions),
cancels, expiry (a fake clock), a device budget that forces demotion, and faults injected in the
runner (prefill, decode, image encoding, out of device memory in a prefill or a decode), the journal (ENOSPC / EIO on entries and on images) and
adapter loads. More requests run than one step takes (max_batch_size 1..3), so rows finish
mid-batch while others wait: the state the rotation bug needed. After every step:

- the scheduler's and the sessions' own checks pass, and no session is busy without a request;
- every device-resident session's cache holds exactly its transcript (the fake stores token ids),
  shared blocks included: prompts open with one system prompt, with the same image, and stateless
  requests resend finished sessions' transcripts, so blocks are shared, evicted and copied on write;
- every KV block's ref count equals the block tables holding it, and no held block is free
  (``BlockPool.check``, inside the sessions' check);
- no request has more than one final event.
Steps have small token budgets (3..256), so prompts are prefilled in chunks across steps, follow-ups
go before cold prompts (within ``max_passed_over``), and cancels and faults land between chunks.
At the end every request has exactly one final event, and every Finished answer equals the fake
model's greedy answer over the session's transcript as the test itself tracked it (so rolled-back
turns, recomputed and restored sessions all answer exactly).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

import session.engine.assembly
import session.model.lora
from session.config import EngineConfig
from session.engine import CloseRequest, Engine, GenerationRequest
from session.engine.events import TERMINAL, Cancelled, Closed, EventStream, Failed, Finished, Started
from session.model.lora import AdapterWeights
from session.state.session import Tier
from session.types import SamplingParams
from tests.fake_runner import FakeRunner, cache_tokens, greedy_answer

NUM_SCHEDULES = 500
SYSTEM_PROMPT = list(range(300, 321))  # a prefix many conversations open with (blocks of 8 share it)
ADAPTERS = ("ad-a", "ad-b", "ad-c")
CURRENT: dict = {}  # "faults": the running schedule's Faults (read by the patched adapter loader)


@dataclass
class Sent:
    request: GenerationRequest | CloseRequest
    events: list = field(default_factory=list)
    context: list[int] | None = None  # transcript + prompt when its turn was prefilled (from Started)

    @property
    def finals(self) -> list:
        return [e for e in self.events if isinstance(e, TERMINAL)]


class Faults:
    """Counters of faults to inject next, shared by the patched journal and adapter loader."""

    def __init__(self):
        self.journal_entry = 0
        self.journal_image = 0
        self.adapter_load = 0

    def take(self, name: str) -> bool:
        if getattr(self, name) > 0:
            setattr(self, name, getattr(self, name) - 1)
            return True
        return False


@pytest.fixture(scope="module")
def processing(tiny_model_path):
    return functools.lru_cache(maxsize=None)(session.engine.assembly._load_processing)


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8 + seed, 8), (seed * 40 % 256, 7, 9)).save(buffer, format="PNG")
    return buffer.getvalue()


def _engine(rng: random.Random, tiny_model_path, tmp_path, clock, faults: Faults, speculative: str,
            adapters_dir: Path) -> Engine:
    runner = FakeRunner(vocab_size=500, eos_token_ids=(2,), image_token_id=499)
    config = EngineConfig(
        model_path=str(tiny_model_path), max_batch_size=rng.choice([1, 2, 3]), max_queue=64,
        step_token_budget=rng.choice([4, 8, 16, 256]), max_passed_over=rng.choice([1, 4]),
        kv_block_tokens=8, device_budget_bytes=rng.choice([0, 1024, 2048]),
        host_budget_bytes=rng.choice([0, 512, 4096]), session_ttl_s=50.0, reaper_interval_s=0.001,
        journal_dir=str(tmp_path), adapters_dir=str(adapters_dir), max_device_adapters=2, max_host_adapters=1,
        speculative=speculative,
        max_new_tokens=24, default_max_tokens=8, check_invariants=True, max_sessions=64,
    )
    engine = Engine(config, runner=runner, clock=clock)
    journal = engine.parts.journal
    write, write_image = journal.write, journal.write_image

    def faulty(original, name):
        def call(*args, **kwargs):
            if faults.take(name):
                raise OSError(rng.choice([errno.ENOSPC, errno.EIO]), "injected journal fault")
            return original(*args, **kwargs)
        return call

    journal.write, journal.write_image = faulty(write, "journal_entry"), faulty(write_image, "journal_image")
    return engine


def _check_step(engine: Engine, sent: list[Sent]) -> None:
    problems = engine.parts.scheduler.check() + engine.parts.sessions.check(engine.parts.scheduler.active)
    assert problems == []
    for state in engine.parts.store.all_sessions():
        assert state.busy == (state.session_id in engine.parts.scheduler.active), state.session_id
        if state.tier is Tier.DEVICE:  # a prefill under way in chunks has fed part of its turn too
            seq = engine.parts.scheduler.active.get(state.session_id)
            feeding = seq.prompt_ids if seq is not None and seq.progress is not None else []
            assert cache_tokens(state.kv) == (state.token_ids + feeding)[: state.kv.length], state.session_id
    assert all(len(s.finals) <= 1 for s in sent)


def _drain(stream: EventStream, into: list) -> None:
    while True:
        try:
            into.append(stream.get_nowait())
        except Exception:
            return


def run_schedule(seed: int, tiny_model_path, tmp_path) -> dict:
    rng = random.Random(seed)
    now = [1000.0]
    faults = CURRENT["faults"] = Faults()
    # odd seeds speculate (prompt lookup): batched verify passes with plain rows riding along, rewinds
    adapters_dir = tmp_path / "adapters"  # empty folders: the patched loader reads nothing
    for name in ADAPTERS:
        (adapters_dir / name).mkdir(parents=True, exist_ok=True)
    engine = _engine(rng, tiny_model_path, tmp_path / f"journal-{seed}", lambda: now[0], faults,
                     speculative="ngram" if seed % 2 else "off", adapters_dir=adapters_dir)
    runner: FakeRunner = engine.parts.runner
    for name in ADAPTERS:
        engine.parts.adapters.register(name, name)
    images = [_png(i) for i in range(3)]
    pixels = [engine.preprocess_images([Image.open(io.BytesIO(raw)).convert("RGB")]) for raw in images]
    sent: list[Sent] = []
    sessions: dict[str, dict] = {}  # session id -> {"tokens": transcript as the test tracks it, "adapter"}
    counter = 0

    def submit(request) -> Sent:
        item = Sent(request)
        sent.append(item)
        try:
            engine.submit(request)
        except Exception as exc:  # queue full: a final answer too
            item.events.append(Failed(exc))
        return item

    def generation(session_id=None, open_session=False, adapter=None) -> GenerationRequest:
        nonlocal counter
        counter += 1
        prompt = [rng.randrange(3, 498) for _ in range(rng.randrange(1, 6))]
        request = dict(image_digests=(), image_bytes=())
        opening = session_id is None or open_session
        image_first = opening and rng.random() < 0.5  # system prompt, image, question: the image is shared too
        if rng.random() < 0.3:
            which = rng.randrange(len(images))
            placeholders = [499] * runner.info.num_image_tokens
            prompt = placeholders + prompt if image_first else prompt + placeholders
            request = dict(images=pixels[which], image_bytes=(images[which],),
                           image_digests=(hashlib.sha256(images[which]).hexdigest(),))
        if opening and rng.random() < 0.5:  # many conversations on one system prompt (shared KV blocks)
            prompt = SYSTEM_PROMPT[: rng.choice([5, 8, 13, 16, 21])] + prompt
        histories = [t["tokens"] for t in sessions.values() if t["tokens"] and 499 not in t["tokens"]]
        if session_id is None and histories and rng.random() < 0.4:  # a stateless client resends a history
            prompt = rng.choice(histories) + prompt
        return GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=rng.randrange(1, 24)),
                                 stream=EventStream(), session_id=session_id, open_session=open_session,
                                 token_ids=prompt, request_id=f"r{counter}", adapter=adapter, **request)

    for _ in range(rng.randrange(20, 60)):
        action = rng.random()
        live = [sid for sid in sessions if sessions[sid]["open"]]
        if action < 0.25:
            submit(generation())
        elif action < 0.45:
            sid = f"s{seed}-{len(sessions)}"
            adapter = rng.choice((None, *ADAPTERS))
            sessions[sid] = {"tokens": [], "adapter": adapter, "open": True}
            submit(generation(sid, open_session=True, adapter=adapter))
        elif action < 0.7 and live:
            sid = rng.choice(live)
            submit(generation(sid, adapter=sessions[sid]["adapter"]))
        elif action < 0.75 and live:
            sid = rng.choice(live)
            submit(CloseRequest(session_id=sid, stream=EventStream()))
        elif action < 0.82:
            candidates = [s for s in sent if isinstance(s.request, GenerationRequest) and not s.finals]
            if candidates:
                engine.cancel(rng.choice(candidates).request.request_id)
        elif action < 0.85:
            now[0] += rng.choice([1.0, 60.0])  # 60: every idle session expires
        else:
            kind = rng.choice(["prefill", "decode", "encode", "oom_prefill", "oom_decode", "journal_entry",
                               "journal_image", "adapter_load"])
            if kind in runner.fail:
                runner.fail[kind] += 1
            else:
                setattr(faults, kind, getattr(faults, kind) + 1)
        for _ in range(rng.randrange(0, 4)):
            engine.step()
            _collect(sent, sessions)
            _check_step(engine, sent)
    for _ in range(2000):  # run to quiescence
        if not engine.parts.scheduler.active and all(s.finals for s in sent):
            break
        engine.step()
        _collect(sent, sessions)
        _check_step(engine, sent)
    engine.step()  # admit stray cancels
    _collect(sent, sessions)
    assert [s.request.request_id for s in sent if len(s.finals) != 1] == []
    assert engine.num_invariant_violations == 0
    kinds = [type(s.finals[0]).__name__ for s in sent]
    counts = {k: kinds.count(k) for k in set(kinds)}
    counts["tokens cached on a first turn"] = sum(  # shared blocks: nothing of its own was cached
        s.finals[0].usage.cached_tokens for s in sent if isinstance(s.finals[0], Finished)
        and (s.request.session_id is None or s.request.open_session))
    counts["shared block hits"] = sum(p.blocks.prefix.num_hit_blocks for p in runner.pools.values())
    counts["prefills ended between chunks"] = engine.num_abandoned_prefills
    counts["prefill chunks"] = engine.parts.executor.num_prefill_chunks
    counts["prompts passed over"] = engine.parts.scheduler.num_passed_over
    if engine.parts.speculator is not None:
        counts["speculative row steps"] = engine.parts.speculator.num_steps
        counts["speculative tokens accepted"] = engine.parts.speculator.num_accepted
        counts["verifies that fed prefill chunks"] = engine.parts.executor.num_verifies_with_chunks
    return counts


def _collect(sent: list[Sent], sessions: dict[str, dict]) -> None:
    """Read new events; check each Finished answer against the fake model over the tracked transcript."""
    for item in sent:
        before = len(item.events)
        _drain(item.request.stream, item.events)
        request = item.request
        for event in item.events[before:]:
            if isinstance(request, CloseRequest):
                if isinstance(event, Closed):
                    sessions[request.session_id]["open"] = False
                continue
            tracked = sessions.get(request.session_id) if request.session_id else None
            if isinstance(event, Started):
                item.context = (tracked["tokens"] if tracked else []) + list(request.token_ids)
                assert event.prompt_tokens == len(item.context)
            elif isinstance(event, Finished):
                adapter = tracked["adapter"] if tracked else request.adapter
                expected = greedy_answer(item.context, request.sampling.max_tokens, 500, (2,), adapter, image_token_id=499)
                assert list(event.token_ids) == expected, request.request_id
                if tracked:
                    tracked["tokens"] = item.context + expected
            elif isinstance(event, (Failed, Cancelled)) and tracked is not None and request.open_session:
                tracked["open"] = False  # a failed opening turn leaves no session
            if isinstance(event, Failed) and "was expired" in str(event.error) and tracked:
                tracked["open"] = False


def test_random_schedules_keep_the_invariant(tiny_model_path, tmp_path, processing, monkeypatch):
    monkeypatch.setattr(session.engine.assembly, "_load_processing", processing)
    def fake_load_adapter(name, path, shapes, max_rank, dtype):
        if CURRENT["faults"].take("adapter_load"):
            raise OSError(errno.EIO, "injected adapter load fault")
        return AdapterWeights(name=name, rank=1, weights={})

    monkeypatch.setattr(session.model.lora, "load_adapter", fake_load_adapter)
    totals: dict[str, int] = {}
    num = int(os.environ.get("RESIDENT_TEST_SCHEDULES", NUM_SCHEDULES))
    for seed in range(num):
        counts = run_schedule(seed, tiny_model_path, tmp_path)
        for kind, count in counts.items():
            totals[kind] = totals.get(kind, 0) + count
    # Every kind of ending happened, many times over.
    assert totals.get("Finished", 0) > 5 * num and totals.get("Cancelled", 0) > num and \
        totals.get("Failed", 0) > num and totals.get("Closed", 0) > num // 2, totals
    assert totals.get("speculative row steps", 0) > num, totals
    assert totals.get("verifies that fed prefill chunks", 0) > num, totals  # one pass, chunks and verify
    # Shared prefixes were found often (system prompts, resent histories), and answers stayed exact.
    assert totals["tokens cached on a first turn"] > 10 * num and totals["shared block hits"] > 2 * num, totals
    # Long prompts were fed in chunks across steps, follow-ups went first, and prefills were cancelled
    # or failed between two of their chunks (rolled back like any other).
    assert totals["prefill chunks"] > 15 * num and totals["prompts passed over"] > num // 4 and \
        totals["prefills ended between chunks"] > num // 5, totals
