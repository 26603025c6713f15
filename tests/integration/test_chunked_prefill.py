"""The token-budget step on real (demo) models: prompts prefilled in chunks across steps answer exactly
as prompts prefilled whole, token for token in float32, in every family.

Two engines per family get the same requests: one with a 7-token step budget (so chunks cut through
image placeholders, KV blocks and shared prefixes, and every prompt takes several steps), one whose
budget holds every prompt whole. The requests are those of the shared-prefix test (a stateless one,
a resent history, three sessions on one system prompt and image, a follow-up in each), then a
concurrent burst: four new prompts and two sessions' follow-ups submitted together, so chunks of
several prompts share steps with decoding rows and the follow-ups go first. ``cached_tokens`` and the
answers must be equal; the chunked engine must have run more prefill passes than it had requests.
And one step decodes 40 rows (past the old cap of 16), each answering as it does alone.
"""

from __future__ import annotations

import pytest

from session.config import EngineConfig
from session.engine import Engine
from session.engine.events import TERMINAL, Finished
from tests.integration.test_shared_prefix import SYSTEM, Ask, conversation, demo_engine, demo_paths

CHUNKED, WHOLE = 7, 4096


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    return demo_paths(tiny_model_path)


def burst(engine, with_image: bool) -> list[tuple]:
    """Four new prompts and two follow-ups (on the sessions ``conversation`` left) at once."""
    ask = Ask(engine, with_image)
    requests = [ask.request(SYSTEM + ask.placeholders + [120 + i] * (5 + 9 * i), images=int(with_image))
                for i in range(4)]
    requests += [ask.request([130 + i, 131], session_id=f"s{i}") for i in range(2)]
    for request in requests:
        engine.submit(request)
    out = []
    for request in requests:
        while not isinstance(event := request.stream.get(timeout=60), TERMINAL):
            pass
        assert isinstance(event, Finished), event
        out.append((event.token_ids, event.usage.cached_tokens))
    return out


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "llama"])
def test_chunked_prefills_answer_as_whole_ones(paths, family):
    chunked = demo_engine(paths[family], step_token_budget=CHUNKED, check_invariants=True)
    whole = demo_engine(paths[family], step_token_budget=WHOLE)
    try:
        with_image = family != "llama"
        got = conversation(chunked, with_image) + burst(chunked, with_image)
        assert got == conversation(whole, with_image) + burst(whole, with_image)
        assert chunked.fresh_stats().tokens == whole.fresh_stats().tokens  # prefilled, cached, generated
        assert whole.parts.executor.num_prefill_chunks == len(got)  # one pass each
        assert chunked.parts.executor.num_prefill_chunks > 2 * len(got)
        assert chunked.parts.scheduler.num_prefill_chunks == chunked.parts.executor.num_prefill_chunks
        assert chunked.num_invariant_violations == 0
    finally:
        chunked.stop()
        whole.stop()


def test_more_than_sixteen_rows_decode_in_one_step_and_answer_as_alone(paths):
    """40 requests at once on the text Llama: one step decodes all 40 rows (no cap of 16 any more),
    through our CPU kernels, and each answer equals the one it gets alone."""
    prompts = [[40 + i, 41 + i, 42 + 2 * i] for i in range(40)]

    def answers(engine, one_at_a_time: bool) -> list:
        requests = [Ask(engine, False).request(ids) for ids in prompts]
        out = []
        for item in requests:
            engine.submit(item)
            if one_at_a_time:
                out.append(last(item))
        if not one_at_a_time:
            engine.start()  # all 40 queued first: the first step admits them together
            out = [last(item) for item in requests]
        return out

    def last(item):
        while not isinstance(event := item.stream.get(timeout=60), TERMINAL):
            pass
        assert isinstance(event, Finished), event
        return event.token_ids

    alone = demo_engine(paths["llama"])
    together = Engine(EngineConfig(model_path=paths["llama"], kv_block_tokens=16, max_device_adapters=0,
                                   speculative="off"))
    try:
        assert answers(together, False) == answers(alone, True)
        assert together.max_batch_seen == 40 and together.parts.scheduler.max_batch_size == 256
    finally:
        alone.stop()
        together.stop()
