"""The embedding cache's byte bound on the tiny demo LLaVA: an evicted image is re-encoded from its kept
bytes on its session's next recompute, and the session answers exactly as without the bound."""

from __future__ import annotations

from session.state.session import Tier
from tests.conftest import make_image
from tests.integration.test_engine import QUESTIONS, finished, run, turn
from tests.integration.test_memory import BLOCK_BYTES, engine_with, image_request


def image_nbytes(engine) -> int:
    """One image's embedding: [num_image_tokens, hidden] float32."""
    info = engine.parts.runner.info
    return info.num_image_tokens * info.hidden_size * 4


def two_sessions_then_follow_up(engine) -> list[list[int]]:
    """"a" on one image, "b" on another (long enough that the device budget drops a's KV), then a's
    follow-up, recomputed over its whole transcript: the one prefill that needs a's embedding again."""
    answers = [finished(run(engine, image_request(engine, "a", 1, QUESTIONS[0]))).token_ids,
               finished(run(engine, image_request(engine, "b", 2, QUESTIONS[0], max_tokens=60))).token_ids]
    assert engine.parts.store.get("a").tier is Tier.DROPPED
    again = turn(engine, "a", QUESTIONS[1])
    assert again[0].cached_tokens == 0  # recomputed
    return answers + [finished(again).token_ids]


def engine_bounded(tiny_model_path, max_embedding_bytes: int):
    # Two blocks: b's 60-token answer drops a's KV; no host tier, so a's follow-up recomputes it.
    return engine_with(tiny_model_path, device_budget_bytes=2 * BLOCK_BYTES, host_budget_bytes=0,
                       max_embedding_bytes=max_embedding_bytes)


def test_an_evicted_embedding_is_re_encoded_and_answers_the_same(tiny_model_path):
    unbounded, bounded = engine_bounded(tiny_model_path, 0), None
    try:
        expected = two_sessions_then_follow_up(unbounded)
        one_image = image_nbytes(unbounded)
        bounded = engine_bounded(tiny_model_path, one_image)  # room for one image's embedding, not two
        # The requests carry the images' bytes, which these sessions keep in memory (no journal here),
        # so their embeddings may be evicted.
        answers = two_sessions_then_follow_up(bounded)
        assert answers == expected  # token-exact
        free, full = unbounded.parts.embeddings, bounded.parts.embeddings
        # Unbounded: a and b encoded once each, a's recompute a hit. Bounded: b's prefill evicted a's
        # tensor, a's recompute re-encoded it (one more miss) and evicted b's.
        assert (free.num_misses, free.num_hits, free.num_evictions) == (2, 1, 0)
        assert (full.num_misses, full.num_hits, full.num_evictions) == (3, 0, 2)
        a, b = (bounded.parts.store.get(sid).image_digests[0] for sid in "ab")
        assert full.get(a).tensor is not None and full.get(b).tensor is None
        assert (full.get(a).refs, full.get(b).refs) == (1, 1)
        stats = bounded.fresh_stats()
        assert stats.events["embedding_evictions"] == 2 and stats.events["embedding_misses"] == 3
        assert stats.resident_bytes["embeddings"] == one_image == full.nbytes
        assert unbounded.fresh_stats().resident_bytes["embeddings"] == 2 * one_image
    finally:
        unbounded.stop()
        if bounded is not None:
            bounded.stop()


def test_images_without_their_bytes_keep_their_embeddings(tiny_model_path):
    """Pixels alone (no encoded bytes to re-encode from): over the bound, nothing is evicted."""
    engine = engine_with(tiny_model_path, max_embedding_bytes=1)
    try:
        for sid, seed in (("p", 3), ("q", 4)):
            turn(engine, sid, QUESTIONS[0], open_session=True, images=engine.preprocess_images([make_image(seed)]))
        embeddings = engine.parts.embeddings
        assert (embeddings.num_evictions, embeddings.nbytes) == (0, 2 * image_nbytes(engine))
    finally:
        engine.stop()
