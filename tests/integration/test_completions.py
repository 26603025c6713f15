"""OpenAI ``/v1/completions`` through the invocation service on a real checkpoint (SmolLM2-135M-Instruct):
a text prompt (no chat template) or its token ids, greedy answers equal transformers' ``generate``,
``echo``, log-probabilities in the older shape, streams, ``n``, and the 400s that name what to fix."""

from __future__ import annotations

import json

import pytest
import torch

from session.serving.protocol import COMPLETIONS_ENDPOINT, ENDPOINT_HEADER
from tests.conftest import chat_service
from tests.integration.test_structured_output import call

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def checkpoint(smollm2_path):
    return smollm2_path


@pytest.fixture(scope="module")
def service(checkpoint):
    with chat_service(checkpoint) as chat:
        yield chat


def complete(service, body: dict, headers: dict | None = None):
    return call(service, body, {ENDPOINT_HEADER: COMPLETIONS_ENDPOINT, **(headers or {})})


def test_a_text_prompt_is_continued_as_transformers_does(service, checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    status, body, _ = complete(service, {"model": "smollm2-135m-instruct", "prompt": PROMPT, "max_tokens": 12})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "smollm2-135m-instruct"
    [choice] = body["choices"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert choice["text"] == tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 12 and choice["finish_reason"] == "length"

    status, by_ids, _ = complete(service, {"prompt": ids, "max_tokens": 12})
    assert status == 200 and by_ids["choices"][0]["text"] == choice["text"]
    status, echoed, _ = complete(service, {"prompt": [PROMPT], "max_tokens": 12, "echo": True})
    assert status == 200 and echoed["choices"][0]["text"] == PROMPT + choice["text"]


def test_logprobs_in_the_older_shape_and_streams(service):
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2}
    status, plain, _ = complete(service, body)
    assert status == 200, plain
    [choice] = plain["choices"]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(6)]
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]))

    status, text, _ = complete(service, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert [t for c in chunks[:-1] for t in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] == \
        pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_n_answers_with_seeds(service):
    body = {"prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 5}
    status, answer, _ = complete(service, body)
    assert status == 200, answer
    texts = [c["text"] for c in answer["choices"]]
    assert texts == [complete(service, {**body, "n": 1, "seed": 5 + i})[1]["choices"][0]["text"] for i in range(2)]


@pytest.mark.parametrize("body, headers, message", [
    ({"prompt": "x", "suffix": "y"}, {}, "field(s) ['suffix'] are not supported by this server"),
    ({"prompt": "x"}, {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"},
     "/v1/completions is stateless; sessions (X-Amzn-SageMaker-Session-Id) are for chat completions"),
    ({"prompt": [1, 10**9]}, {}, "prompt token id 1000000000 is not in the vocabulary (ids are below 49152)"),
    ({"prompt": ["a", "b"]}, {}, "one prompt per request: send a string or a list of token ids (use n for several answers)"),
    ({"prompt": ""}, {}, "prompt must not be empty"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, {},
     "echo with logprobs (the prompt's log-probabilities) is not supported by this server"),
    ({"prompt": "x", "best_of": 3}, {}, "best_of other than n is not supported by this server"),
    ({"prompt": "x", "model": "gpt-4"}, {}, "model 'gpt-4' is not served here: GET /v1/models lists "
                                            "'smollm2-135m-instruct' and the registered adapters"),
])
def test_what_is_refused_is_named_and_the_server_goes_on(service, body, headers, message):
    status, answer, _ = complete(service, body, headers)
    assert status in (400, 404) and answer["error"]["message"] == message, answer
    status, _, _ = complete(service, {"prompt": "x", "max_tokens": 1})
    assert status == 200
