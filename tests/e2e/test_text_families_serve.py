"""`MODEL=<a text-only checkpoint> make serve`: sessions over TorchServe for Mistral (SentencePiece,
sliding window) and Qwen3 (ChatML, q/k norms), follow-ups from cache."""

from __future__ import annotations

import pytest
import requests

from launch.torchserve import start_torchserve
from model_store.build_text_models import ensure
from tests.conftest import free_port, image_url

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_a_text_family_serves_sessions(family, tmp_path):
    path = ensure([family])[family]
    server = start_torchserve(free_port(5), run_dir=tmp_path / "run", model_path=path,
                              stdout=open(tmp_path / "torchserve.log", "w"))
    try:
        server.wait_ready(timeout_s=240)
        body = {"messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 20}
        opened = requests.post(f"{server.url}/invocations", json=body, timeout=60,
                               headers={"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"})
        assert opened.status_code == 200, opened.text
        session = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        body["messages"][0]["content"] = "Now in reverse."
        follow = requests.post(f"{server.url}/invocations", json=body, timeout=60,
                               headers={"X-Amzn-SageMaker-Session-Id": session})
        assert follow.status_code == 200, follow.text
        usage = follow.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= opened.json()["usage"]["prompt_tokens"]
        image = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url(1)}}]}]}
        refused = requests.post(f"{server.url}/invocations", json=image, timeout=60)
        assert refused.status_code == 400 and "text-only" in refused.json()["error"]["message"]
    finally:
        server.stop()
