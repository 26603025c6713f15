"""The schema suite (tests/schema_suite.py) through the engine, on a random-weight model (the tiny demo
LLaVA: noise logits stress the grammar hardest) and on a real one (SmolLM2-135M-Instruct). Every
schema is sent as a strict ``response_format``, sixteen requests at a time, sampled at temperature 1;
every answer the grammar ended (finish_reason "stop") must parse and validate. On random weights
every answer must end; a real model may write an unbounded string until max_tokens (SmolLM2 did
for one schema at temperature 1), and such an answer may only be cut, never wrong."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from tests.schema_suite import SCHEMAS, format_checker

MAX_TOKENS = 900  # the tiny model's context is 1024 tokens


@pytest.fixture(scope="module", params=["tiny-random", "smollm2"])
def service(request, tiny_model_path):
    if request.param == "smollm2":
        from model_store.build_smollm2 import build
        from tests.conftest import REPO

        path = build(REPO / "models")
    else:
        path = tiny_model_path
    engine = Engine(EngineConfig(model_path=str(path), max_new_tokens=MAX_TOKENS, speculative="off",
                                 check_invariants=True)).start()
    yield ChatService(engine, "llava" if request.param == "tiny-random" else "smollm2")
    engine.stop()


def request(i: int, schema: dict) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"Answer {i} in JSON."}], "max_tokens": MAX_TOKENS,
                       "temperature": 1.0, "seed": i,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "answer", "schema": schema, "strict": True}}})


def test_every_suite_answer_from_noise_logits_validates(service):
    async def go():
        out = []
        for start in range(0, len(SCHEMAS), 16):
            group = SCHEMAS[start:start + 16]
            responses = await asyncio.gather(*(service.invoke({}, request(start + j, schema))
                                               for j, (_, schema) in enumerate(group)))
            out.extend(zip(group, responses))
        return out
    failures = []
    for (name, schema), response in asyncio.run(go()):
        if response.status != 200:
            failures.append((name, response.status, response.body))
            continue
        choice = response.body["choices"][0]
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema, format_checker=format_checker())
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, choice["finish_reason"], str(exc)[:200]))
    wrong = [f for f in failures if f[1] != "length"]
    assert not wrong, wrong
    if service.model_name == "llava":  # random weights: every answer ends within max_tokens
        assert not failures, failures
    assert len(SCHEMAS) >= 50
