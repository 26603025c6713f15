"""The README's "Talking to it" block runs as written against a real TorchServe, with a photo-sized
PNG (a base64 image inlined on the command line would fail with "Argument list too long")."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.e2e


def readme_block(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    from launch.torchserve import start_torchserve

    log = open(tmp_path_factory.mktemp("readme") / "torchserve.log", "w")
    ts = start_torchserve(free_port(5), run_dir=tmp_path_factory.mktemp("readme-run"), stdout=log)
    try:
        ts.wait_ready(timeout_s=240)
        yield ts
    finally:
        ts.stop()


def test_the_talking_to_it_block_runs_as_written(server, tmp_path):
    pixels = (np.random.RandomState(0).rand(768, 1024, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "some.png")
    assert (tmp_path / "some.png").stat().st_size > 1_000_000  # a photo-sized image
    script = readme_block("## Talking to it").replace("localhost:8080", f"127.0.0.1:{server.port}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script + '\necho "SID=$SID"'], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    session_id = re.search(r"SID=(\S+)$", out, re.M).group(1)
    assert re.fullmatch(r"[0-9a-f-]{36}", session_id)
    assert re.search(r"^HTTP/1.1 200", done.stderr, re.M)  # the open's headers, through tee
    follow_up, _ = json.JSONDecoder().raw_decode(out[out.index("{"):])  # curl -s prints no newline after it
    assert "usage" in follow_up, out
    assert follow_up["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert follow_up["choices"][0]["message"]["role"] == "assistant"
    assert re.search(rf"^X-Amzn-SageMaker-Closed-Session-Id: {session_id}\r?$", out, re.M | re.I)


@pytest.mark.parametrize("body", ['{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}',
                                  '{"messages": [{"role": "user", "content": "a=b & c"}], "max_tokens": 3}'])
def test_a_json_body_sent_as_a_form_gets_a_400_that_says_so(server, body):
    """TorchServe decodes form bodies into fields before the handler sees them (the JSON is lost): the
    answer says what happened and what to send, never that a non-empty body was empty."""
    import requests

    answer = requests.post(f"{server.url}/invocations", data=body,
                           headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=60)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith("the body was sent as a form (Content-Type: application/x-www-form-urlencoded")
    assert "Content-Type: application/json" in message and "empty" not in message
    ok = requests.post(f"{server.url}/invocations", data=body, headers={"Content-Type": "application/json"},
                       timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
