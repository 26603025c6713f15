"""The text-only families, token-exact against transformers' own ``generate`` in float32: turn 1, a
stateless multi-turn conversation, and a 3-turn session whose every follow-up equals ``generate``
over the session's transcript ids. Mistral runs Mistral's real SentencePiece tokenizer and a sliding
window of 16 keys that the conversations cross; Qwen3 has per-head q/k norms."""

from __future__ import annotations

import pytest
import torch

from model_store.build_text_models import FAMILIES, MISTRAL_WINDOW, ensure
from session.config import EngineConfig
from session.engine import Engine
from session.engine.events import Finished, Started
from session.types import Message, TextPart
from tests.integration.test_engine import run, turn

QUESTIONS = ["Write a function that adds two numbers.", "Now make it subtract instead.",
             "And what does it return for 3 and 5?"]


@pytest.fixture(scope="module", params=[(f, a) for f in FAMILIES for a in ("per_row", "batched")],
                ids=lambda p: "-".join(p))
def family(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, attention = request.param
    path = ensure([name])[name]
    engine = Engine(EngineConfig(model_path=str(path), speculative="off", max_device_adapters=0,
                                 attention=attention)).start()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield name, engine, reference, AutoTokenizer.from_pretrained(path)
    engine.stop()


def generate(model, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def answer(events) -> tuple[Started, Finished]:
    started = next(e for e in events if isinstance(e, Started))
    finished = events[-1]
    assert isinstance(finished, Finished), finished
    return started, finished


def test_three_turn_session_equals_generate_over_its_transcript(family):
    name, engine, reference, tokenizer = family
    sid = f"family-{name}"
    for step, question in enumerate(QUESTIONS):
        started, finished = answer(turn(engine, sid, question, open_session=step == 0, max_tokens=12))
        prompt = engine.parts.store.get(sid).token_ids[: started.prompt_tokens]
        assert list(finished.token_ids) == generate(reference, prompt, 12)[: len(finished.token_ids)]
        assert started.cached_tokens == (0 if step == 0 else started.prompt_tokens - len(prompt) + started.cached_tokens)
    if name == "mistral":  # the conversation crossed the sliding window several times over
        assert len(engine.parts.store.get(sid).token_ids) > 3 * MISTRAL_WINDOW


def test_stateless_multi_turn_equals_generate(family):
    name, engine, reference, tokenizer = family
    messages = (Message("user", (TextPart(QUESTIONS[0]),)), Message("assistant", (TextPart("def add(a, b): ..."),)),
                Message("user", (TextPart(QUESTIONS[1]),)))
    from session.engine import GenerationRequest
    from session.engine.events import EventStream
    from session.types import SamplingParams

    events = run(engine, GenerationRequest(messages=messages, sampling=SamplingParams(max_tokens=16),
                                           stream=EventStream()))
    started, finished = answer(events)
    ids = engine.parts.formatter.opening(messages).token_ids
    rendered = tokenizer.apply_chat_template([m.__dict__ | {"content": m.parts[0].text} for m in messages],
                                             add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(rendered)["input_ids"]  # the template and tokenizer as transformers runs them
    assert started.prompt_tokens == len(ids)
    assert list(finished.token_ids) == generate(reference, ids, 16)[: len(finished.token_ids)]


def test_follow_up_delta_is_what_the_template_adds(family):
    """A follow-up adds exactly the tokens the chat template renders after the previous answer; with
    Mistral's SentencePiece that includes the "▁" each text segment after a special token gets."""
    name, engine, reference, tokenizer = family
    eos = engine.parts.runner.info.eos_token_ids
    for max_tokens in (3, 40):  # an answer cut by max_tokens, and (most likely) one that ends with EOS
        sid = f"delta-{name}-{max_tokens}"
        _, first = answer(turn(engine, sid, QUESTIONS[0], open_session=True, max_tokens=max_tokens))
        before = len(engine.parts.store.get(sid).token_ids)
        started, _ = answer(turn(engine, sid, QUESTIONS[1], max_tokens=2))
        delta = engine.parts.store.get(sid).token_ids[before: started.prompt_tokens]
        conversation = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": "x"},
                        {"role": "user", "content": QUESTIONS[1]}]
        full = tokenizer(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                       tokenize=False))["input_ids"]
        if first.token_ids[-1] in eos:  # the model wrote the end of its turn itself: the delta follows it
            assert full[-len(delta) - 1:] == [first.token_ids[-1]] + delta
        else:  # cut short: the delta closes the turn first
            assert full[-len(delta):] == delta
    # Both cases on the formatter itself (a random model seldom ends its turn by itself).
    follow_up = (Message("user", (TextPart(QUESTIONS[1]),)),)
    after_eos = engine.parts.formatter.followup(follow_up, ended_with_eos=True).token_ids
    after_cut = engine.parts.formatter.followup(follow_up, ended_with_eos=False).token_ids
    assert full[-len(after_eos) - 1:] == [tokenizer.eos_token_id] + after_eos
    assert full[-len(after_cut):] == after_cut
