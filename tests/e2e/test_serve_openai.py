"""`make serve` (``python -m launch serve``): the front on PORT before one TorchServe backend, so the
OpenAI paths answer as well as the SageMaker ones, and ``/v1/models`` names the checkpoint served
(its folder's name) with its context length, not TorchServe's model name. One server start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.e2e

READY_S = 180.0  # the demo model loads in seconds; generous for a loaded 2-core machine
STOP_S = 30.0
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    """The URL of a running ``python -m launch serve`` of the demo model; stopped by SIGTERM (exit 0
    within STOP_S asserted), else killed by PID."""
    port = free_port(15)  # the front on port, its backend on port+10 .. +14
    env = {k: v for k, v in os.environ.items() if k not in (
        "PORT", "SAGEMAKER_BIND_TO_PORT", "HOST", "MODEL", "BACKENDS", "RESIDENT_BACKEND_PORT",
        "RESIDENT_SERVED_MODEL_NAME", "RESIDENT_MAX_CONTEXT_TOKENS")}
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "w") as log:  # a file, not a pipe: TorchServe's logs must never block on a reader
        launcher = subprocess.Popen([sys.executable, "-m", "launch", "serve"], cwd=REPO,
                                    env={**env, "PORT": str(port)}, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while "serving " not in log_path.read_text():
            assert launcher.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time: " + log_path.read_text()[-3000:]
            time.sleep(0.3)
        yield url
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(STOP_S) == 0
    finally:
        if launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)


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
