"""The session engine on the tiny demo LLaVA, float32 on CPU: equivalence, isolation, lifecycle."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from session.config import EngineConfig
from session.engine import CloseRequest, Engine, GenerationRequest
from session.engine.events import TERMINAL, Closed, EventStream, Failed, Finished, Started, TextDelta
from session.errors import BadRequest, ContextLengthExceeded, SessionExists, SessionNotFound
from session.families.vision import NO_IMAGES
from session.types import ImagePart, Message, SamplingParams, TextPart
from tests.conftest import make_image

QUESTIONS = ["What is in the picture?", "What colour is it?", "Why is it there?", "Describe it in one line."]


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module", params=["per_row", "batched"])
def engine(tiny_model_path, request):
    eng = Engine(EngineConfig(model_path=str(tiny_model_path), reaper_interval_s=0.05,
                              attention=request.param)).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """Transformers' own model on dense weights (the engine's linears are oneDNN-packed on CPU)."""
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_model_path).eval()


def run(engine: Engine, request, timeout_s: float = 60.0) -> list:
    """Submit and collect events until the terminal one (each within ``timeout_s``)."""
    engine.submit(request)
    events = []
    while True:
        event = request.stream.get(timeout=timeout_s)
        events.append(event)
        if isinstance(event, TERMINAL):
            return events


def user(text: str, image: bool = False) -> tuple[Message, ...]:
    parts = ((ImagePart("data:,"),) if image else ()) + (TextPart(text),)
    return (Message("user", parts),)


def turn(engine, session_id, text, *, open_session=False, images=NO_IMAGES, max_tokens=12, timeout_s=60.0,
         deltas=True, **sampling):
    request = GenerationRequest(
        messages=user(text, image=len(images) > 0), stream=EventStream(deltas=deltas),
        sampling=SamplingParams(max_tokens=max_tokens, **sampling), session_id=session_id,
        open_session=open_session, images=images,
    )
    return run(engine, request, timeout_s)


def finished(events) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


@pytest.mark.parametrize("size", [(64, 48), (200, 50), (50, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_first_turn_matches_transformers_generate(engine, reference, tiny_model_path, size):
    """Our attention and KV layout give exactly what Hugging Face's own generate gives (three image
    sizes and aspects; LLaVA-1.5 resizes each to one square)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    image = make_image(1, size)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}],
        add_generation_prompt=True)
    inputs = processor(text=text, images=image, return_tensors="pt")
    prompt_len = inputs.input_ids.shape[1]
    expected = reference.generate(**inputs, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                  eos_token_id=None)[0, prompt_len:].tolist()
    events = turn(engine, None, QUESTIONS[0], images=engine.preprocess_images([image]))
    assert isinstance(events[0], Started) and events[0].prompt_tokens == prompt_len
    assert list(finished(events).token_ids) == expected


def test_followups_equal_stateless_runs_over_same_transcript(engine):
    """docs/DESIGN.md, "Invariants": every follow-up from the resident session equals a from-scratch run."""
    images = engine.preprocess_images([make_image(2)])
    sid = "equivalence-1"
    answers = []
    for index, question in enumerate(QUESTIONS):
        events = turn(engine, sid, question, open_session=index == 0,
                      images=images if index == 0 else NO_IMAGES)
        started, done = events[0], finished(events)
        if index > 0:
            assert started.cached_tokens > 0
        prompt = engine.parts.store.get(sid).token_ids[: started.prompt_tokens]
        answers.append((prompt, done.token_ids))
    assert len(answers) == 4
    for prompt, session_tokens in answers:
        reference = finished(run(engine, GenerationRequest(
            messages=(), sampling=SamplingParams(max_tokens=12), stream=EventStream(),
            token_ids=prompt, images=images)))
        assert reference.token_ids == session_tokens
    # cached tokens: each follow-up reuses everything but the previous answer's last token
    run(engine, CloseRequest(sid, EventStream()))


def test_three_turn_session_equals_transformers_generate_over_its_transcript(engine, reference, tiny_model_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    image = make_image(7, (90, 40))
    pixel_values = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    sid = "generate-3"
    for index, question in enumerate(QUESTIONS[:3]):
        events = turn(engine, sid, question, open_session=index == 0,
                      images=engine.preprocess_images([image]) if index == 0 else NO_IMAGES)
        started, done = events[0], finished(events)
        prompt = engine.parts.store.get(sid).token_ids[: started.prompt_tokens]
        ids = torch.tensor([prompt])
        expected = reference.generate(input_ids=ids, pixel_values=pixel_values, do_sample=False,
                                      attention_mask=torch.ones_like(ids), max_new_tokens=12)
        assert list(done.token_ids) == expected[0, len(prompt):].tolist()[: len(done.token_ids)]
    run(engine, CloseRequest(sid, EventStream()))


def test_cached_tokens_count_everything_but_last_answer_token(engine):
    images = engine.preprocess_images([make_image(3)])
    first = turn(engine, "cached-1", QUESTIONS[0], open_session=True, images=images)
    first_done = finished(first)
    second = turn(engine, "cached-1", QUESTIONS[1])
    expected_cached = first[0].prompt_tokens + first_done.usage.completion_tokens - 1
    assert second[0].cached_tokens == expected_cached
    assert first[0].cached_tokens == 0
    assert finished(second).usage.cached_tokens == expected_cached
    run(engine, CloseRequest("cached-1", EventStream()))


def test_identical_sessions_interleaved_concurrently_answer_identically(engine):
    images = engine.preprocess_images([make_image(4)])
    results: dict[str, list] = {"twin-a": [], "twin-b": []}
    engine.max_batch_seen = 0

    def converse(sid):
        for index, question in enumerate(QUESTIONS[:3]):
            events = turn(engine, sid, question, open_session=index == 0,
                          images=images if index == 0 else NO_IMAGES, max_tokens=16)
            results[sid].append(finished(events).token_ids)

    threads = [threading.Thread(target=converse, args=(sid,)) for sid in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results["twin-a"]) == 3
    assert results["twin-a"] == results["twin-b"]
    assert engine.max_batch_seen >= 2  # they really shared forward passes
    for sid in results:
        run(engine, CloseRequest(sid, EventStream()))


def test_close_frees_exactly_the_session_bytes(engine):
    baseline, baseline_embeddings = engine.parts.memory.device_bytes, engine.parts.embeddings.nbytes
    turn(engine, "bytes-1", QUESTIONS[0], open_session=True, images=engine.preprocess_images([make_image(5)]))
    session = engine.parts.store.get("bytes-1")
    info = engine.parts.runner.info
    kv_bytes = 2 * info.num_layers * info.num_kv_heads * session.kv.capacity * info.head_dim * 4
    assert engine.parts.memory.device_bytes - baseline == kv_bytes
    assert engine.parts.embeddings.nbytes - baseline_embeddings == info.num_image_tokens * info.hidden_size * 4
    events = run(engine, CloseRequest("bytes-1", EventStream()))
    assert events == [Closed("bytes-1")]
    assert engine.parts.memory.device_bytes == baseline
    assert engine.parts.embeddings.nbytes == baseline_embeddings
    gone = turn(engine, "bytes-1", QUESTIONS[1])
    assert isinstance(gone[-1], Failed) and isinstance(gone[-1].error, SessionNotFound)
    assert "was closed" in gone[-1].error.message


def test_stop_string_truncates_and_reports_stop(engine):
    free = finished(turn(engine, None, QUESTIONS[0], max_tokens=12))
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 2]
    stopped = finished(turn(engine, None, QUESTIONS[0], max_tokens=12, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]


def test_streamed_deltas_join_to_the_answer(engine):
    events = turn(engine, None, QUESTIONS[2], max_tokens=10)
    deltas = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert deltas == finished(events).text


def test_a_non_streaming_consumer_gets_started_then_the_answer(engine):
    """EventStream(deltas=False), as the API gives a non-streaming request: exactly Started and Finished,
    with the text and tokens a streaming consumer of the same turn gets, stop strings applied alike."""
    streamed = turn(engine, None, QUESTIONS[2], max_tokens=10)
    plain = turn(engine, None, QUESTIONS[2], max_tokens=10, deltas=False)
    assert [type(e) for e in plain] == [Started, Finished]
    assert sum(isinstance(e, TextDelta) for e in streamed) >= 2
    assert (finished(plain).text, finished(plain).token_ids) == (finished(streamed).text, finished(streamed).token_ids)
    stop = finished(streamed).text[3:5]
    stopped = turn(engine, None, QUESTIONS[2], max_tokens=10, deltas=False, stop=(stop,))
    assert [type(e) for e in stopped] == [Started, Finished]
    assert finished(stopped).text == finished(streamed).text[: finished(streamed).text.find(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = dict(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    alone = finished(turn(engine, None, QUESTIONS[1], **params)).token_ids
    outputs = []

    def go():
        outputs.append(finished(turn(engine, None, QUESTIONS[1], **params)).token_ids)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outputs == [alone] * 3
    other_seed = finished(turn(engine, None, QUESTIONS[1], **{**params, "seed": 8})).token_ids
    assert other_seed != alone


def test_context_overflow_is_refused_and_leaves_the_session_usable(engine):
    turn(engine, "ctx-1", QUESTIONS[0], open_session=True)
    before = list(engine.parts.store.get("ctx-1").token_ids)
    too_long = turn(engine, "ctx-1", "word " * 900, max_tokens=200)
    assert isinstance(too_long[-1], Failed) and isinstance(too_long[-1].error, ContextLengthExceeded)
    assert engine.parts.store.get("ctx-1").token_ids == before
    ok = turn(engine, "ctx-1", QUESTIONS[1])
    assert ok[0].cached_tokens == len(before) - 1
    run(engine, CloseRequest("ctx-1", EventStream()))


def test_a_logit_bias_id_outside_the_vocabulary_is_refused_400_before_any_work(engine):
    """An id the logits do not have used to fail the sampler after the prompt's prefill (a 500, the step
    run again part by part). It is refused when admitted: nothing prefilled, no request counted failed,
    and the session's next turn runs as if it had not come."""
    vocab = engine.parts.runner.info.vocab_size
    turn(engine, "bias-1", QUESTIONS[0], open_session=True)
    before = list(engine.parts.store.get("bias-1").token_ids)
    stats = engine.fresh_stats()
    refused = turn(engine, "bias-1", QUESTIONS[1], logit_bias=((vocab - 1, 1.0), (vocab, 1.0)))
    assert len(refused) == 1 and isinstance(refused[0], Failed) and isinstance(refused[0].error, BadRequest)
    assert refused[0].error.status == 400
    assert str(refused[0].error) == (f"logit_bias names token id {vocab}, which is not in the vocabulary "
                                     f"(ids are below {vocab})")
    after = engine.fresh_stats()
    assert after.tokens["prefilled"] == stats.tokens["prefilled"]
    assert after.requests["failed"] == stats.requests["failed"]
    assert engine.parts.store.get("bias-1").token_ids == before
    ok = turn(engine, "bias-1", QUESTIONS[1], logit_bias=((vocab - 1, 1.0),))
    assert isinstance(ok[-1], Finished) and ok[0].cached_tokens == len(before) - 1
    run(engine, CloseRequest("bias-1", EventStream()))


def test_opening_an_id_already_open_is_refused_409_and_leaves_the_session_whole(engine):
    """An engine caller (the API always opens a fresh id) opening an id that is live: replacing the
    session would leak its KV blocks, images and tenant count (the invariant check found blocks held
    by no session). It is refused with 409 session_exists; the session answers on, and closes clean."""
    turn(engine, "dup-1", QUESTIONS[0], open_session=True)
    before = list(engine.parts.store.get("dup-1").token_ids)
    held = engine.parts.memory.device_bytes
    again = turn(engine, "dup-1", QUESTIONS[1], open_session=True)
    assert isinstance(again[-1], Failed) and isinstance(again[-1].error, SessionExists)
    assert again[-1].error.status == 409 and again[-1].error.type == "session_exists"
    assert engine.parts.store.get("dup-1").token_ids == before and engine.parts.memory.device_bytes == held
    ok = turn(engine, "dup-1", QUESTIONS[1])
    assert ok[0].cached_tokens == len(before) - 1
    run(engine, CloseRequest("dup-1", EventStream()))


def test_requests_on_one_session_run_in_arrival_order(engine):
    turn(engine, "order-1", QUESTIONS[0], open_session=True)
    requests = [GenerationRequest(messages=user(q), sampling=SamplingParams(max_tokens=6), stream=EventStream(),
                                  session_id="order-1") for q in QUESTIONS[1:]]
    for r in requests:
        engine.submit(r)
    prompts = []
    for r in requests:
        events = []
        while not events or not isinstance(events[-1], (Finished, Failed)):
            events.append(r.stream.get(timeout=60))
        prompts.append(events[0].prompt_tokens)
    assert prompts == sorted(prompts) and len(set(prompts)) == 3
    closing = CloseRequest("order-1", EventStream())
    late = GenerationRequest(messages=user("late"), sampling=SamplingParams(max_tokens=4), stream=EventStream(),
                             session_id="order-1")
    engine.submit(GenerationRequest(messages=user("busy"), sampling=SamplingParams(max_tokens=30),
                                    stream=EventStream(), session_id="order-1"))
    engine.submit(closing)
    engine.submit(late)
    assert closing.stream.get(timeout=60) == Closed("order-1")
    failed = late.stream.get(timeout=60)
    assert isinstance(failed, Failed) and isinstance(failed.error, SessionNotFound)


def test_idle_session_expires_without_a_request(tiny_model_path):
    clock = FakeClock()
    config = EngineConfig(model_path=str(tiny_model_path), session_ttl_s=30, reaper_interval_s=0.02)
    eng = Engine(config, clock=clock).start()
    try:
        started = turn(eng, "ttl-1", QUESTIONS[0], open_session=True)[0]
        assert started.expires_at == clock.now + 30
        assert len(eng.parts.store) == 1 and eng.parts.memory.device_bytes > 0
        clock.now += 29
        time.sleep(0.2)
        assert len(eng.parts.store) == 1
        clock.now += 2
        deadline = time.monotonic() + 30  # generous: CI machines are shared
        while (len(eng.parts.store) or eng.parts.store.num_expired == 0) and time.monotonic() < deadline:
            time.sleep(0.02)  # the reaper runs on the engine thread: wait for its whole clean-up
        assert len(eng.parts.store) == 0 and eng.parts.memory.device_bytes == 0
        assert eng.parts.store.num_expired == 1
        gone = turn(eng, "ttl-1", QUESTIONS[1])
        assert isinstance(gone[-1], Failed) and "was expired" in gone[-1].error.message
    finally:
        eng.stop()
