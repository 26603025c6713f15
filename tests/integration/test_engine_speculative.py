"""Speculative decoding inside the engine: sessions across turns, adapters, concurrency, config."""

from __future__ import annotations

import threading

import pytest

from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.errors import ConfigError
from session.events import EventStream
from session.protocol import SamplingParams
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
        session = engine.store.get(f"spec-{mode}-None")
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
