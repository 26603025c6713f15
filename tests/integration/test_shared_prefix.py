"""Shared KV blocks on real (demo) models: greedy answers with reuse equal answers without it, token for
token in float32, and ``cached_tokens`` counts exactly the tokens served from shared blocks.

Two engines per family, one sharing (16-token blocks) and one with ``prefix_cache_bytes=0``, get the
same requests as raw ids (placeholders expanded), so the test knows every prefix exactly:

- a stateless request, then a stateless one that resends it with its answer and a new question (the
  OpenAI-SDK pattern): the second reuses every full block of the first's transcript but the last token;
- three sessions opened on one system prompt and one image (it straddles a block boundary, so the
  sessions' shared prefix cuts into it: its remaining rows are embedded, M-RoPE positions sliced),
  each with its own question, then a follow-up in each: the prefix's blocks are held once
  (the pool's "shared" bytes), and every answer equals the unshared engine's;
- families: the tiny LLaVA, LLaVA-NeXT (anyres), Qwen2-VL and Qwen2.5-VL (M-RoPE and rope deltas),
  and a text Llama; on the tiny LLaVA also with two adapters (never shared across adapters) and with
  speculative decoding (prompt lookup), and a session restored from the journal that reuses blocks
  another session published.
"""

from __future__ import annotations

import hashlib
import queue

import pytest

from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import TERMINAL, EventStream, Finished
from session.state.session import Tier
from session.types import SamplingParams
from tests.conftest import make_image, png_bytes
from tests.integration.test_engine import run

BLOCK = 16
SYSTEM = list(range(40, 66))  # 26 tokens: an image after it starts 10 tokens into the second block
MAX_TOKENS = 8


def demo_paths(tiny_model_path) -> dict:
    from model_store.build_llava_next import ensure as ensure_next
    from model_store.build_qwen_vl import FAMILIES as QWEN, ensure as ensure_qwen
    from model_store.build_text_models import ensure as ensure_text

    paths = {"llava": str(tiny_model_path), "llava_next": str(ensure_next(["vicuna"])["vicuna"]),
             "llama": str(ensure_text(["llama"])["llama"])}
    paths.update({name: str(path) for name, path in ensure_qwen(sorted(QWEN)).items()})
    return paths


def demo_engine(path: str, **config) -> Engine:
    """An engine on a demo model with 16-token blocks, no adapters and no speculation unless given."""
    return Engine(EngineConfig(**{"model_path": path, "kv_block_tokens": BLOCK, "max_device_adapters": 0,
                                  "speculative": "off", **config})).start()


def engine_pair(path: str, **config) -> tuple[Engine, Engine]:
    return demo_engine(path, **config), demo_engine(path, prefix_cache_bytes=0, **config)


class Ask:
    """Requests as raw ids, with the image (if any) its placeholders stand for."""

    def __init__(self, engine: Engine, with_image: bool):
        self.engine = engine
        info = engine.parts.runner.info
        self.image = make_image(3, (140, 84)) if with_image else None
        self.images = engine.preprocess_images([self.image]) if with_image else None
        self.placeholders = [info.image_token_id] * self.images.num_tokens[0] if with_image else []

    def request(self, ids: list[int], *, images: int = 0, **kwargs) -> GenerationRequest:
        extra = {}
        if images:
            raw = png_bytes(self.image)
            extra = dict(images=self.images, image_digests=(hashlib.sha256(raw).hexdigest(),), image_bytes=(raw,))
        return GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=MAX_TOKENS), stream=EventStream(),
                                 token_ids=list(ids), **extra, **kwargs)

    def __call__(self, ids: list[int], *, images: int = 0, **kwargs) -> Finished:
        events = run(self.engine, self.request(ids, images=images, **kwargs))
        assert isinstance(events[-1], Finished), events[-1]
        return events[-1]


def conversation(engine: Engine, with_image: bool, adapters=(None,)) -> list[tuple]:
    """The scenario above; returns (answer ids, cached_tokens) of every request, in order."""
    ask = Ask(engine, with_image)
    image = ask.placeholders
    out = []
    first = SYSTEM + image + [70, 71, 72]
    one = ask(first, images=int(with_image))
    out.append((one.token_ids, one.usage.cached_tokens))
    resent = first + list(one.token_ids) + [80, 81, 82, 83]
    two = ask(resent, images=int(with_image))
    out.append((two.token_ids, two.usage.cached_tokens))
    for index, adapter in enumerate(adapters * 3 if len(adapters) == 1 else adapters):
        sid = f"s{index}"
        opened = ask(SYSTEM + image + [90 + index, 91], images=int(with_image), session_id=sid, open_session=True,
                     adapter=adapter)
        out.append((opened.token_ids, opened.usage.cached_tokens))
    for index in range(len(out) - 2):
        follow = ask([100 + index, 101], session_id=f"s{index}")
        out.append((follow.token_ids, follow.usage.cached_tokens))
    return out


def expected_cached(image_tokens: int, first_answer: int) -> list[int]:
    """cached_tokens of the scenario's first five requests on the sharing engine."""
    first_prompt = len(SYSTEM) + image_tokens + 3
    transcript = first_prompt + first_answer - 1  # the last answer token is never fed: its block stays private
    opening = (len(SYSTEM) + image_tokens) // BLOCK * BLOCK  # sessions share up to the question
    return [0, transcript // BLOCK * BLOCK, opening, opening, opening]


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    return demo_paths(tiny_model_path)


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "llama"])
def test_reuse_answers_exactly_as_without_and_counts_what_it_reused(paths, family):
    shared, plain = engine_pair(paths[family])
    try:
        with_image = family != "llama"
        got, want = conversation(shared, with_image), conversation(plain, with_image)
        assert [a for a, _ in got] == [a for a, _ in want]  # token for token
        image_tokens = len(Ask(shared, with_image).placeholders)
        # first turns: exactly the shared blocks; follow-ups: the session's own transcript, as without sharing
        assert [c for _, c in got[:5]] == expected_cached(image_tokens, len(got[0][0]))
        assert [c for _, c in want[:5]] == [0] * 5
        assert [c for _, c in got[5:]] == [c for _, c in want[5:]]
        pool = shared.parts.runner.kv_pool(BLOCK)
        # three live sessions hold the opening's full blocks once: "shared" is those blocks, not three copies
        assert pool.blocks.usage()["shared"] == (len(SYSTEM) + image_tokens) // BLOCK
        assert shared.parts.sessions.check({}) == []
    finally:
        shared.stop()
        plain.stop()


def test_a_draft_model_shares_its_own_blocks_and_answers_stay_exact():
    """The draft's pool shares its text's blocks too: later conversations on one system prompt feed
    the draft only past it, and every answer equals the unshared engine's."""
    from tests.integration.test_engine_speculative import PAIR

    settings = dict(speculative="draft", draft_model_path=str(PAIR / "draft"))
    shared, plain = engine_pair(str(PAIR / "target"), **settings)
    try:
        got, want = conversation(shared, False), conversation(plain, False)
        assert [a for a, _ in got] == [a for a, _ in want]
        draft_pool = shared.parts.speculator.draft.kv_pool(BLOCK)
        # the resent history: its first two blocks; sessions 1 and 2: the system prompt's one block each
        assert draft_pool.blocks.prefix.num_hit_blocks == 2 + 1 + 1
        # those blocks were taken, not fed to the draft again. (How many tokens the draft is fed in all
        # is no exact measure: shared KV differs from recomputed KV in the last bits, so the draft's
        # proposals, the adaptive k and with them the catch-ups after plain steps may differ.)
        assert [e.parts.speculator.num_draft_shared_tokens for e in (shared, plain)] == [4 * BLOCK, 0]
        fed, fed_alone = (e.parts.speculator.num_draft_synced_tokens for e in (shared, plain))
        assert fed < fed_alone
        assert shared.parts.sessions.check({}) == []
    finally:
        shared.stop()
        plain.stop()


def test_adapters_never_share_and_speculation_stays_exact(paths, adapters_dir):
    names = sorted(p.name for p in adapters_dir.iterdir())[:2]
    shared, plain = engine_pair(paths["llava"], adapters_dir=str(adapters_dir), max_device_adapters=2,
                                speculative="ngram")
    try:
        got = conversation(shared, True, adapters=(names[0], None, names[1], names[0]))
        want = conversation(plain, True, adapters=(names[0], None, names[1], names[0]))
        assert [a for a, _ in got] == [a for a, _ in want]
        image_tokens = len(Ask(shared, True).placeholders)
        opening = (len(SYSTEM) + image_tokens) // BLOCK * BLOCK
        # sessions 0..3 open with adapter a, base, adapter b, adapter a: only the last finds its adapter's blocks
        assert [c for _, c in got[2:6]] == [0, opening, 0, opening]
    finally:
        shared.stop()
        plain.stop()


def test_a_session_restored_from_the_journal_reuses_blocks_another_published(paths, tmp_path):
    config = dict(model_path=paths["llava"], kv_block_tokens=BLOCK, max_device_adapters=0, speculative="off",
                  journal_dir=str(tmp_path / "journal"))
    engine = Engine(EngineConfig(**config)).start()
    ask = Ask(engine, True)
    opening = SYSTEM + ask.placeholders + [90, 91]
    ask(opening, images=1, session_id="old", open_session=True)
    engine.stop()
    engine = Engine(EngineConfig(**config)).start()  # a restart: the journal restores "old" without KV
    try:
        ask = Ask(engine, True)
        ask(SYSTEM + ask.placeholders + [95, 96], images=1, session_id="new", open_session=True)
        follow = ask([100, 101], session_id="old")
        alone = Engine(EngineConfig(**{**config, "journal_dir": "", "prefix_cache_bytes": 0})).start()
        try:
            ask_alone = Ask(alone, True)
            ask_alone(opening, images=1, session_id="old", open_session=True)
            want = ask_alone([100, 101], session_id="old")
        finally:
            alone.stop()
        assert follow.token_ids == want.token_ids
        # its transcript is recomputed from the shared system prompt and image on, not from 0
        assert follow.usage.cached_tokens == (len(SYSTEM) + len(ask.placeholders)) // BLOCK * BLOCK
    finally:
        engine.stop()


def test_a_session_restored_from_the_host_tier_shares_what_another_published(tiny_model_path):
    """On the fake runner (its KV holds token ids): session a is demoted to host memory; its follow-up
    restores it, sharing the published blocks (the system prompt's, which b holds) and copying the rest."""
    from tests.fake_runner import FakeRunner, cache_tokens, greedy_answer

    runner = FakeRunner(vocab_size=500, eos_token_ids=(2,), image_token_id=499)
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), kv_block_tokens=8, max_device_adapters=0,
                                 speculative="off", check_invariants=True), runner=runner)

    def ask(ids, **kwargs) -> Finished:
        request = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=4), stream=EventStream(),
                                    token_ids=ids, **kwargs)
        engine.submit(request)
        events = []
        while not events or not isinstance(events[-1], TERMINAL):
            engine.step()
            while True:
                try:
                    events.append(request.stream.get_nowait())
                except queue.Empty:
                    break
        assert isinstance(events[-1], Finished), events[-1]
        return events[-1]

    system = list(range(300, 330))  # 30 tokens: 3 full blocks of 8
    opened = ask(system + [5], session_id="a", open_session=True)
    ask(system + [6], session_id="b", open_session=True)
    session = engine.parts.store.peek("a")
    assert engine.parts.memory.demote(session) is Tier.HOST and session.kv.length == 0
    follow = ask([7], session_id="a")
    transcript = system + [5] + list(opened.token_ids) + [7]
    assert list(follow.token_ids) == greedy_answer(transcript, 4, 500, (2,), None, image_token_id=499)
    # the system prompt's three blocks, held with b, and a's own fourth (published when its answer
    # ended, idle while it was on the host); its last two tokens copied from the host copy
    assert engine.parts.memory.num_restored_shared_tokens == 4 * 8 and session.host_kv is None
    assert session.kv.block_ids[:3] == engine.parts.store.peek("b").kv.block_ids[:3]
    assert cache_tokens(session.kv) == session.token_ids[: session.kv.length]
    assert engine.num_invariant_violations == 0
