"""Qwen2-VL and Qwen2.5-VL served by the engine, token-exact against transformers' own ``generate`` in
float32 (the M-RoPE positions and the rope delta a session carries are the engine's own):

- turn 1 with an image of three sizes and aspect ratios: the prompt is the processor's own ids;
- a 3-turn session (a second image of another shape in turn 2, text-only turn 3): every follow-up
  equals ``generate`` over the session's transcript with all of its images, and the session's rope
  delta is transformers' ``get_rope_index`` delta for that transcript;
- a stateless conversation with two images;
- two sessions with different deltas decoding in the same steps;
- a session restored from the journal: its positions and delta rebuilt from the transcript and the
  re-decoded images.
"""

from __future__ import annotations

import threading

import pytest
import torch

from model_store.build_qwen_vl import FAMILIES, ensure
from session.families.qwen_vl import load_processor
from session.state.session import Tier
from session.types import Message, TextPart
from tests.conftest import make_image
from tests.integration.test_engine import run
from tests.vlm import MAX_TOKENS, answer, request, started_engine, user

SIZES = [(56, 56), (140, 84), (56, 140)]  # (width, height): 4, 15 and 10 image tokens
QUESTIONS = ["What is in the picture?", "And in this one?", "Which of the two is brighter?"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def demo(request):
    from transformers import AutoModelForImageTextToText

    path = str(ensure([request.param])[request.param])
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, reference, load_processor(path)


@pytest.fixture(scope="module", params=["per_row", "batched"])
def engine(demo, request):
    """Both decode paths: the rope delta is added per row, and to the batched step's rotary positions."""
    engine = started_engine(demo[1], attention=request.param)
    yield engine
    engine.stop()


def image_inputs(processor, pil_images) -> dict:
    if not pil_images:
        return {}
    out = processor.image_processor(images=pil_images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def generate(reference, processor, ids: list[int], pil_images) -> list[int]:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 mm_token_type_ids=(input_ids == processor.image_token_id).int(),
                                 max_new_tokens=MAX_TOKENS, **image_inputs(processor, pil_images))
    return out[0, len(ids):].tolist()


def reference_delta(reference, processor, ids: list[int], pil_images) -> int:
    input_ids = torch.tensor([ids])
    inputs = image_inputs(processor, pil_images)
    _, delta = reference.model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == processor.image_token_id).int(),
                                              image_grid_thw=inputs.get("image_grid_thw"))
    return int(delta.reshape(-1)[0])


def processor_ids(processor, conversation: list[dict], pil_images) -> list[int]:
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    return processor(text=text, images=pil_images or None, return_tensors="pt")["input_ids"][0].tolist()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_first_turn_with_an_image_equals_generate(demo, engine, size):
    _, _, reference, processor = demo
    image = make_image(sum(size), size)
    started, finished = answer(run(engine, request(engine, [user(QUESTIONS[0], 1)], [image])))
    ids = processor_ids(processor, [{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": QUESTIONS[0]}]}], [image])
    assert started.prompt_tokens == len(ids)
    expected = generate(reference, processor, ids, [image])
    assert list(finished.token_ids) == expected[: len(finished.token_ids)]
    assert len(set(finished.token_ids)) > len(finished.token_ids) // 2  # not a degenerate repetition


def test_three_turn_session_equals_generate_and_carries_the_rope_delta(demo, engine):
    name, _, reference, processor = demo
    sid = f"qwen-session-{name}"
    first, second = make_image(11, SIZES[1]), make_image(12, SIZES[2])
    plan = [([user(QUESTIONS[0], 1)], [first]), ([user(QUESTIONS[1], 1)], [second]), ([user(QUESTIONS[2])], [])]
    seen = []
    for step, (messages, pil_images) in enumerate(plan):
        started, finished = answer(run(engine, request(engine, messages, pil_images, session_id=sid,
                                                       open_session=step == 0)))
        seen += pil_images
        session = engine.parts.store.get(sid)
        prompt = session.token_ids[: started.prompt_tokens]
        assert list(finished.token_ids) == generate(reference, processor, prompt, seen)[: len(finished.token_ids)]
        assert session.rope_delta == reference_delta(reference, processor, session.token_ids, seen)
        if step:  # only the new tokens were prefilled
            assert started.cached_tokens >= len(session.token_ids) - started.prompt_tokens
    assert engine.parts.store.get(sid).rope_delta == (5 - 15) + (5 - 10)  # per image: max(rows, cols) - rows*cols


def test_stateless_conversation_with_two_images_equals_generate(demo, engine):
    _, _, reference, processor = demo
    images = [make_image(21, SIZES[1]), make_image(22, SIZES[2])]
    messages = [user(QUESTIONS[0], 1), Message("assistant", (TextPart("A cat."),)), user(QUESTIONS[1], 1)]
    started, finished = answer(run(engine, request(engine, messages, images)))
    ids = processor_ids(processor, [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[1]}]}], images)
    assert started.prompt_tokens == len(ids)
    assert list(finished.token_ids) == generate(reference, processor, ids, images)[: len(finished.token_ids)]


def test_sessions_with_different_deltas_decode_together(demo, engine):
    name, _, reference, processor = demo
    images = [make_image(41, SIZES[1]), make_image(42, SIZES[2]), make_image(43, SIZES[0])]
    results: dict[int, tuple] = {}

    def converse(index: int) -> None:
        results[index] = answer(run(engine, request(engine, [user(QUESTIONS[0], 1)], [images[index]],
                                                    session_id=f"qwen-batch-{name}-{index}", open_session=True)))

    threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    deltas = set()
    for index, image in enumerate(images):
        started, finished = results[index]
        session = engine.parts.store.get(f"qwen-batch-{name}-{index}")
        deltas.add(session.rope_delta)
        prompt = session.token_ids[: started.prompt_tokens]
        assert list(finished.token_ids) == generate(reference, processor, prompt, [image])[: len(finished.token_ids)]
    assert deltas == {5 - 15, 5 - 10, 2 - 4}


def test_session_restored_from_the_journal_rebuilds_positions(demo, tmp_path):
    name, path, reference, processor = demo
    journal = str(tmp_path / "journal")
    sid = f"qwen-journal-{name.replace('_', '-')}"  # a wire-valid id: the journal names its file by it
    images = [make_image(31, SIZES[1]), make_image(32, SIZES[2])]
    engine = started_engine(path, journal_dir=journal)
    try:
        answer(run(engine, request(engine, [user(QUESTIONS[0], 2)], images, session_id=sid, open_session=True)))
        delta = engine.parts.store.get(sid).rope_delta
    finally:
        engine.stop()
    restarted = started_engine(path, journal_dir=journal)
    try:
        session = restarted.parts.store.get(sid)
        assert session.tier is Tier.DROPPED and session.rope_delta == 0  # not journaled: rebuilt on recompute
        started, finished = answer(run(restarted, request(restarted, [user(QUESTIONS[2])], [], session_id=sid)))
        assert started.cached_tokens == 0
        assert session.rope_delta == delta
        prompt = session.token_ids[: started.prompt_tokens]
        assert list(finished.token_ids) == generate(reference, processor, prompt, images)[: len(finished.token_ids)]
    finally:
        restarted.stop()
