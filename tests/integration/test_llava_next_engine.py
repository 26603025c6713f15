"""LLaVA-NeXT (llava_next) served by the engine, token-exact against transformers' own ``generate`` in
float32, on both demos (a Llama LM with byte-level BPE; a Mistral LM with Mistral's SentencePiece):

- turn 1 with an image of three sizes and aspect ratios: the engine's prompt is the processor's own
  ids (each ``<image>`` expanded to that image's anyres count) and the answer equals ``generate``;
- a 3-turn session, a second image of another size in turn 2: every follow-up equals ``generate``
  over the session's transcript ids with all of its images;
- a stateless conversation with an image and an assistant turn;
- a session brought back from the journal after a restart: its images are re-encoded from the
  journaled bytes (their sizes re-read), and the follow-up still equals ``generate``.
"""

from __future__ import annotations

import pytest
import torch

from model_store.build_llava_next import ensure
from session.state.session import Tier
from session.types import Message, TextPart
from tests.conftest import make_image
from tests.integration.test_engine import run
from tests.vlm import MAX_TOKENS, answer, request, started_engine, user

# (width, height) as PIL takes them: a square, a wide and a tall image (different tile grids and counts)
SIZES = [(56, 56), (200, 50), (50, 200)]
QUESTIONS = ["What is in this picture?", "And in this one?", "Which of the two is brighter?"]


@pytest.fixture(scope="module", params=["vicuna", "mistral"])
def demo(request):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    path = str(ensure([request.param])[request.param])
    model = LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, model, AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def engine(demo):
    engine = started_engine(demo[1])
    yield engine
    engine.stop()


def generate(model, processor, ids: list[int], pil_images) -> list[int]:
    kwargs = {}
    if pil_images:
        pixels = processor.image_processor(images=pil_images, return_tensors="pt")
        kwargs = {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def processor_ids(processor, conversation: list[dict], pil_images) -> list[int]:
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    return processor(text=text, images=pil_images or None, return_tensors="pt")["input_ids"][0].tolist()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_first_turn_with_an_image_equals_generate(demo, engine, size):
    _, _, model, processor = demo
    image = make_image(sum(size), size)
    started, finished = answer(run(engine, request(engine, [user(QUESTIONS[0], 1)], [image])))
    ids = processor_ids(processor, [{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": QUESTIONS[0]}]}], [image])
    assert started.prompt_tokens == len(ids)
    assert list(finished.token_ids) == generate(model, processor, ids, [image])[: len(finished.token_ids)]


def test_image_counts_follow_each_image(demo, engine):
    """Three sizes -> three counts, equal to the processor's expansion (and the per-image features' lengths)."""
    _, _, model, processor = demo
    images = [make_image(i, size) for i, size in enumerate(SIZES)]
    prepared = engine.preprocess_images(images)
    expanded = processor(text="<image>" * 3, images=images, return_tensors="pt")["input_ids"][0]
    image_id = model.config.image_token_id
    assert sum(prepared.num_tokens) == int((expanded == image_id).sum())
    assert len(set(prepared.num_tokens)) == 3
    assert prepared.sizes == tuple((h, w) for w, h in SIZES)
    features = engine.parts.runner.encode_images(list(prepared.pixels), list(prepared.sizes))
    assert [f.shape[0] for f in features] == list(prepared.num_tokens)


def test_three_turn_session_equals_generate_over_its_transcript(demo, engine):
    name, _, model, processor = demo
    sid = f"next-session-{name}"
    first, second = make_image(11, SIZES[1]), make_image(12, SIZES[2])
    plan = [([user(QUESTIONS[0], 1)], [first]), ([user(QUESTIONS[1], 1)], [second]), ([user(QUESTIONS[2])], [])]
    seen = []
    for step, (messages, pil_images) in enumerate(plan):
        events = run(engine, request(engine, messages, pil_images, session_id=sid, open_session=step == 0))
        started, finished = answer(events)
        seen += pil_images
        prompt = engine.parts.store.get(sid).token_ids[: started.prompt_tokens]
        assert list(finished.token_ids) == generate(model, processor, prompt, seen)[: len(finished.token_ids)]
        if step:  # only the new tokens were prefilled
            assert started.cached_tokens >= len(engine.parts.store.get(sid).token_ids) - started.prompt_tokens
    session = engine.parts.store.get(sid)
    prepared = engine.preprocess_images(seen)
    assert session.token_ids.count(model.config.image_token_id) == sum(prepared.num_tokens)


def test_stateless_conversation_with_an_image_equals_generate(demo, engine):
    _, _, model, processor = demo
    image = make_image(21, SIZES[2])
    messages = [user(QUESTIONS[0], 1), Message("assistant", (TextPart("A square."),)), user(QUESTIONS[1])]
    started, finished = answer(run(engine, request(engine, messages, [image])))
    ids = processor_ids(processor, [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
        {"role": "user", "content": [{"type": "text", "text": QUESTIONS[1]}]}], [image])
    assert started.prompt_tokens == len(ids)
    assert list(finished.token_ids) == generate(model, processor, ids, [image])[: len(finished.token_ids)]


def test_session_restored_from_the_journal_recomputes_its_images(demo, tmp_path):
    name, path, model, processor = demo
    journal = str(tmp_path / "journal")
    sid = f"next-journal-{name}"
    images = [make_image(31, SIZES[1]), make_image(32, SIZES[2])]
    engine = started_engine(path, journal_dir=journal)
    try:
        answer(run(engine, request(engine, [user(QUESTIONS[0], 2)], images, session_id=sid, open_session=True)))
    finally:
        engine.stop()
    restarted = started_engine(path, journal_dir=journal)
    try:
        assert restarted.parts.store.get(sid).tier is Tier.DROPPED
        started, finished = answer(run(restarted, request(restarted, [user(QUESTIONS[2])], [], session_id=sid)))
        assert started.cached_tokens == 0  # KV and embeddings rebuilt from the journaled transcript and bytes
        prompt = restarted.parts.store.get(sid).token_ids[: started.prompt_tokens]
        assert list(finished.token_ids) == generate(model, processor, prompt, images)[: len(finished.token_ids)]
    finally:
        restarted.stop()
