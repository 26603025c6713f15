"""Structured output with what Resident already does, on the tiny LLaVA (random weights, so only the
grammar makes the answers valid): a JSON answer about an image, under a LoRA adapter, n answers, a
session's follow-up with its own schema, and a batch of constrained and free rows of several adapters."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from benchmarks.common import image_data_url
from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from tests.integration.test_structured_output import NEW, SESSION, call, schema_format

PRODUCT = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                            "count": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["colour", "count"], "additionalProperties": False}
LABEL = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 12}},
         "required": ["label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def service(tiny_model_path, adapters_dir):
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), adapters_dir=str(adapters_dir), speculative="off",
                                 check_invariants=True)).start()
    yield ChatService(engine, "llava")
    engine.stop()


def about_image(picture: int, schema: dict, **fields) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(picture, size=64)}},
        {"type": "text", "text": "Describe the product in the picture as JSON."}]}],
        "max_tokens": 48, "response_format": schema_format(schema), **fields}


def test_a_json_answer_about_an_image_under_an_adapter_n_times(service):
    status, answer, _ = call(service, about_image(1, PRODUCT, n=2, temperature=1.0, seed=4),
                             {"X-Amzn-SageMaker-Adapter-Identifier": "tone"})
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PRODUCT)


def test_a_sessions_follow_up_has_its_own_schema(service):
    status, first, headers = call(service, about_image(2, PRODUCT), {SESSION: "NEW_SESSION"})
    assert status == 200, first
    jsonschema.validate(json.loads(first["choices"][0]["message"]["content"]), PRODUCT)
    session_id = headers[NEW].split(";")[0]
    follow = {"messages": [{"role": "user", "content": "Now give it a label."}], "max_tokens": 32,
              "response_format": schema_format(LABEL)}
    status, second, _ = call(service, follow, {SESSION: session_id})
    assert status == 200, second
    jsonschema.validate(json.loads(second["choices"][0]["message"]["content"]), LABEL)


def test_constrained_and_free_rows_of_several_adapters_in_one_batch(service):
    adapters = ["tone", "terse", None, "domain"]
    bodies = [about_image(10 + i, PRODUCT if i % 2 == 0 else LABEL) for i in range(4)]
    bodies.append({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})

    async def go():
        return await asyncio.gather(*(service.invoke(
            {"X-Amzn-SageMaker-Adapter-Identifier": adapters[i]} if i < 4 and adapters[i] else {}, json.dumps(b))
            for i, b in enumerate(bodies)))
    responses = asyncio.run(go())
    assert [r.status for r in responses] == [200] * 5
    for i, response in enumerate(responses[:4]):
        jsonschema.validate(json.loads(response.body["choices"][0]["message"]["content"]),
                            PRODUCT if i % 2 == 0 else LABEL)
    assert responses[4].body["choices"][0]["message"]["content"] is not None
