"""Structured output on a real checkpoint (SmolLM2-135M-Instruct) through the invocation service:
``response_format`` answers parse and validate; under greedy decoding they equal transformers'
``generate`` with llguidance's mask as its logits processor, token for token, on the first turn of a
session and on a follow-up with its own schema; log-probabilities are the model's; constrained and
free rows decode in one batch."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from session.serving.chat_request import parse_request
from tests.conftest import chat_service

NEW = "X-Amzn-SageMaker-New-Session-Id"
SESSION = "X-Amzn-SageMaker-Session-Id"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "Rome", "Berlin"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
CITIES = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                      "minItems": 1, "maxItems": 3}},
          "required": ["cities"], "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(smollm2_path):
    return smollm2_path


@pytest.fixture(scope="module")
def service(checkpoint):
    with chat_service(checkpoint) as chat:
        yield chat


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(checkpoint))


def call(service, body: dict, headers: dict | None = None):
    async def go():
        response = await service.invoke({"Content-Type": "application/json", **(headers or {})}, json.dumps(body))
        if response.chunks is None:
            return response.status, response.body, response.headers
        return response.status, "".join([c async for c in response.chunks]), response.headers
    return asyncio.run(go())


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


class GrammarProcessor(LogitsProcessor):
    """llguidance's mask as a transformers logits processor (one row): the reference the engine must equal."""

    def __init__(self, tokenizer, grammar: str, prompt_len: int):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        bits = self.matcher.compute_bitmask()
        words = torch.frombuffer(bytearray(bits), dtype=torch.int32)
        unpacked = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()
        allowed = unpacked[: scores.shape[-1]]
        return scores.masked_fill(~allowed, float("-inf"))


def reference_answer(reference, body: dict, prompt: list[int], max_new: int) -> list[int]:
    model, hf_tokenizer = reference
    constraint = parse_request(json.dumps(body), {}, default_max_tokens=64, max_new_tokens=256).sampling.constraint
    eos = [model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int) \
        else list(model.generation_config.eos_token_id)
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=model.config.vocab_size, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.source)
    processor = GrammarProcessor(tokenizer, grammar, len(prompt))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             logits_processor=LogitsProcessorList([processor]))
    return out[0, len(prompt):].tolist()


def session_tokens(service, session_id: str, usage: dict) -> tuple[list[int], list[int]]:
    ids = service.engine.parts.store.get(session_id).token_ids
    prompt = ids[: usage["prompt_tokens"]]
    return prompt, ids[usage["prompt_tokens"]: usage["prompt_tokens"] + usage["completion_tokens"]]


def test_a_session_answers_each_turn_in_its_own_schema_token_exact(service, reference):
    first = {"messages": [{"role": "user", "content": "Invent a person who lives in Rome. Reply in JSON."}],
             "max_tokens": 60, "response_format": schema_format(PERSON)}
    status, body, headers = call(service, first, {SESSION: "NEW_SESSION"})
    assert status == 200, body
    session_id = headers[NEW].split(";")[0]
    value = json.loads(body["choices"][0]["message"]["content"])
    jsonschema.validate(value, PERSON)
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt, generated = session_tokens(service, session_id, body["usage"])
    assert generated == reference_answer(reference, first, prompt, 60)

    follow = {"messages": [{"role": "user", "content": "Now list cities they might visit."}], "max_tokens": 60,
              "response_format": schema_format(CITIES)}
    status, body, _ = call(service, follow, {SESSION: session_id})
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), CITIES)
    prompt, generated = session_tokens(service, session_id, body["usage"])
    assert generated == reference_answer(reference, follow, prompt, 60)


def test_json_object_and_regex_and_a_free_row_in_one_batch(service):
    bodies = [
        {"messages": [{"role": "user", "content": "Describe Paris as JSON."}], "max_tokens": 48,
         "response_format": {"type": "json_object"}},
        {"messages": [{"role": "user", "content": "What year is it?"}], "max_tokens": 8,
         "response_format": {"type": "regex", "regex": "(19|20)[0-9]{2}"}},
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
    ]

    async def go():
        responses = await asyncio.gather(*(service.invoke({}, json.dumps(b)) for b in bodies))
        return [r.body for r in responses]
    answers = asyncio.run(go())
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert isinstance(json.loads(texts[0]), dict) or answers[0]["choices"][0]["finish_reason"] == "length"
    assert len(texts[1]) == 4 and texts[1][:2] in ("19", "20") and texts[1].isdigit()
    assert answers[2]["choices"][0]["finish_reason"] in ("stop", "length") and texts[2]


def test_logprobs_are_the_models_and_stream_with_usage_last(service, reference):
    model, tokenizer = reference
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6, "logprobs": True,
            "top_logprobs": 3}
    status, answer, _ = call(service, body)
    assert status == 200, answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] - (answer["choices"][0]["finish_reason"] == "stop")
    assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6 for e in content)
    prompt = tokenizer(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                     tokenize=False))["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert content[0]["logprob"] == pytest.approx(logp.max().item(), abs=2e-3)  # greedy: the top token's

    status, text, _ = call(service, {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert all("usage" not in e for e in events[:-1])
    streamed = [e2 for e in events[:-1] for e2 in (e["choices"][0].get("logprobs") or {}).get("content", [])]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)


def test_an_unsupported_schema_is_a_400_naming_it_and_the_server_goes_on(service):
    status, body, _ = call(service, {"messages": [{"role": "user", "content": "x"}],
                                     "response_format": schema_format({"type": "object", "if": {"type": "string"}})})
    assert status == 400 and "response_format.json_schema" in body["error"]["message"], body
    status, body, _ = call(service, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert status == 200
