"""`make serve` (``python -m launch serve``): the front on PORT before one TorchServe backend, so the
OpenAI paths answer as well as the SageMaker ones, and ``/v1/models`` names the checkpoint served
(its folder's name) with its context length, not TorchServe's model name. One server start."""

from __future__ import annotations

import json

import pytest
import requests

from tests.e2e.serving import launched_serve

pytestmark = pytest.mark.e2e

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    """The URL of a running ``python -m launch serve`` of the demo model."""
    with launched_serve(tmp_path_factory.mktemp("serve")) as url:
        yield url


def test_models_name_the_checkpoint_with_its_context_length(served, tiny_model_path):
    max_positions = json.loads((tiny_model_path / "config.json").read_text())["text_config"]["max_position_embeddings"]
    listed = requests.get(served + "/v1/models", timeout=30).json()
    assert listed["data"] == [{"id": "llava-tiny", "object": "model", "created": 0, "owned_by": "resident",
                               "max_model_len": max_positions}]
    assert requests.get(served + "/v1/models/llava-tiny", timeout=30).json() == listed["data"][0]
    missing = requests.get(served + "/v1/models/llava", timeout=30)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


def test_chat_completions_and_the_sagemaker_paths_answer_through_the_front(served):
    chat = requests.post(served + "/v1/chat/completions", json=CHAT, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.headers["X-Resident-Backend"] == "0"
    [choice] = chat.json()["choices"]
    assert choice["message"]["role"] == "assistant" and chat.json()["usage"]["completion_tokens"] == 4

    assert requests.get(served + "/ping", timeout=30).json()["healthy_backends"] == 1
    opened = requests.post(served + "/invocations", json=CHAT, timeout=60,
                           headers={"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"})
    assert opened.status_code == 200, opened.text
    session_id = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
    assert session_id.endswith("-b0")
    follow = requests.post(served + "/predictions/llava", timeout=60, headers={"X-Amzn-SageMaker-Session-Id": session_id},
                           data=json.dumps({"messages": [{"role": "user", "content": "And then?"}], "max_tokens": 4}))
    assert follow.status_code == 200, follow.text
    assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
