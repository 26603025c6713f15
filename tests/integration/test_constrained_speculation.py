"""Speculative decoding under a grammar (SmolLM2-135M-Instruct): greedy constrained answers with prompt
lookup and with a draft model equal plain constrained decoding, token for token, and the rows did
speculate; a row with penalties or log-probabilities in the batch turns speculation off for that step
rather than being sampled without its processors."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.conftest import chat_service
from tests.integration.test_structured_output import PERSON, schema_format
from tests.integration.test_tool_calls import SCHEMAS, TIME, WEATHER

QUESTIONS = ["Invent a person who lives in Paris. Reply in JSON.", "Describe someone from Berlin as JSON.",
             "A person from Rome, as JSON please."]


@pytest.fixture(scope="module")
def checkpoint(smollm2_path):
    return smollm2_path


def answers(checkpoint, bodies: list[dict], **config) -> tuple[list[dict], int]:
    """Every body answered by one engine, all at once; and how many proposals its speculator made."""
    async def go(service):
        responses = await asyncio.gather(*(service.invoke({}, json.dumps(b)) for b in bodies))
        return [r.body for r in responses]
    with chat_service(checkpoint, **config) as service:
        speculator = service.engine.parts.speculator
        return asyncio.run(go(service)), 0 if speculator is None else speculator.num_proposed


def without_ids(choice: dict) -> dict:
    """A choice with its tool calls' ids (fresh random ones per answer) left out."""
    calls = [call["function"] for call in choice["message"].get("tool_calls", [])]
    return {**choice, "message": {**choice["message"], "tool_calls": calls}}


def constrained_bodies() -> list[dict]:
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": 64, "response_format": schema_format(PERSON)}
              for q in QUESTIONS]
    bodies.append({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, TIME],
                   "tool_choice": "required", "max_tokens": 64})
    bodies.append({"messages": [{"role": "user", "content": "Which year did it happen? 1969 or 1970?"}],
                   "max_tokens": 8, "response_format": {"type": "regex", "regex": "(19|20)[0-9]{2}"}})
    return bodies


@pytest.mark.parametrize("speculation", [{"speculative": "ngram"}, {"speculative": "draft"}])
def test_constrained_greedy_answers_equal_plain_constrained_decoding(checkpoint, speculation):
    if speculation["speculative"] == "draft":
        speculation = {**speculation, "draft_model_path": str(checkpoint)}  # itself: every proposal agrees
    bodies = constrained_bodies()
    plain, _ = answers(checkpoint, bodies, speculative="off")
    fast, proposed = answers(checkpoint, bodies, **speculation)
    assert proposed > 0  # the constrained rows did speculate
    assert [without_ids(a["choices"][0]) for a in fast] == [without_ids(a["choices"][0]) for a in plain]
    for answer in fast[:3]:
        jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), PERSON)
    call = json.loads(fast[3]["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(call, SCHEMAS[fast[3]["choices"][0]["message"]["tool_calls"][0]["function"]["name"]])


def test_rows_with_processors_are_never_sampled_in_a_speculative_step(checkpoint):
    bodies = [{"messages": [{"role": "user", "content": "Count from one to twenty in words."}], "max_tokens": 48}
              for _ in range(2)]
    bodies += [{"messages": [{"role": "user", "content": "Count from one to twenty in words."}], "max_tokens": 48,
                "presence_penalty": 1.5, "logit_bias": {"28": -100}},
               {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24, "logprobs": True,
                "top_logprobs": 2}]
    plain, _ = answers(checkpoint, bodies, speculative="off")
    fast, _ = answers(checkpoint, bodies, speculative="draft", draft_model_path=str(checkpoint))
    assert [a["choices"][0]["message"] for a in fast] == [a["choices"][0]["message"] for a in plain]
    assert len(fast[3]["choices"][0]["logprobs"]["content"]) == len(plain[3]["choices"][0]["logprobs"]["content"])
