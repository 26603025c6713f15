"""End to end: the adapter API on the front before two real TorchServe backends, while other
traffic keeps flowing; adapters chosen by header, by SageMaker inference component and by body."""

from __future__ import annotations

import shutil
import threading

import pytest
import requests

from session.serving.protocol import ADAPTER_HEADER, ADMIN_TOKEN_HEADER, SESSION_HEADER
from tests.e2e.test_front import NEW_ID_RE, chat, running_cluster, sagemaker_client

pytestmark = pytest.mark.e2e

TOKEN = "test-admin-token"
ADMIN = {ADMIN_TOKEN_HEADER: TOKEN}
TIMEOUT = 60


@pytest.fixture(scope="module")
def cluster(served_dir, tmp_path_factory):
    env = {"RESIDENT_THREADS": "1", "RESIDENT_ADAPTERS_DIR": str(served_dir), "RESIDENT_ADMIN_TOKEN": TOKEN}
    with running_cluster(tmp_path_factory, "ad-backend", env, admin_token=TOKEN) as (front, _):
        yield f"http://127.0.0.1:{front.front.port}", front


def ask(base, adapter=None, session=None, text="Tell me about adapters.", **extra):
    headers = {}
    if adapter:
        headers[ADAPTER_HEADER] = adapter
    if session:
        headers[SESSION_HEADER] = session
    return requests.post(f"{base}/invocations", json=chat(text, max_tokens=10, **extra), headers=headers,
                         timeout=TIMEOUT)


def content(response):
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_register_use_unregister_while_serving(cluster, served_dir):
    base, front = cluster
    stop, background = threading.Event(), []

    def traffic():  # other users keep being served throughout
        while not stop.is_set():
            background.append(ask(base).status_code)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        listed = requests.get(f"{base}/adapters", headers=ADMIN, timeout=TIMEOUT).json()["adapters"]
        assert {a["name"] for a in listed} == {"tone", "domain", "customer", "terse"}

        fresh = served_dir / "staged" / "fresh"
        shutil.copytree(served_dir / "tone", fresh)
        registered = requests.post(f"{base}/adapters", json={"name": "fresh", "src": str(fresh)}, headers=ADMIN, timeout=TIMEOUT)
        assert registered.status_code == 200, registered.text
        assert registered.json() == {"registered": "fresh", "src": str(fresh), "backends": 2}

        plain = content(ask(base))
        assert content(ask(base, "fresh")) == content(ask(base, "tone")) != plain
        by_body = requests.post(f"{base}/invocations", json=chat("Tell me about adapters.", max_tokens=10,
                                                                 model="fresh"), timeout=TIMEOUT)
        assert content(by_body) == content(ask(base, "fresh"))

        removed = requests.delete(f"{base}/adapters/fresh", headers=ADMIN, timeout=TIMEOUT)
        assert removed.status_code == 200 and removed.json() == {"unregistered": "fresh", "backends": 2}
        gone = ask(base, "fresh")
        assert gone.status_code == 404
        assert gone.json()["error"]["type"] == "adapter_not_found" and "'fresh'" in gone.json()["error"]["message"]
    finally:
        stop.set()
        thread.join(60)
    assert background and set(background) == {200}


def test_bad_register_is_400_and_changes_nothing(cluster, served_dir):
    base, _ = cluster
    before = requests.get(f"{base}/adapters", headers=ADMIN, timeout=TIMEOUT).json()
    broken = served_dir / "staged" / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    response = requests.post(f"{base}/adapters", json={"name": "broken", "src": str(broken)}, headers=ADMIN, timeout=TIMEOUT)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_adapter"
    assert "not a PEFT adapter directory" in response.json()["error"]["message"]
    outside = requests.post(f"{base}/adapters", json={"name": "etc", "src": "/etc"}, headers=ADMIN, timeout=TIMEOUT)
    assert outside.status_code == 403 and outside.json()["error"]["type"] == "forbidden"
    assert "not inside RESIDENT_ADAPTERS_DIR" in outside.json()["error"]["message"]
    named_base = requests.post(f"{base}/adapters", json={"name": "llava", "src": str(served_dir / "domain")},
                               headers=ADMIN, timeout=TIMEOUT)  # TorchServe's name for the base model
    assert named_base.status_code == 400 and named_base.json()["error"]["message"].startswith(
        "adapter name 'llava' is the base model's: a request naming it gets the base model")
    assert requests.get(f"{base}/adapters", headers=ADMIN, timeout=TIMEOUT).json() == before
    assert requests.delete(f"{base}/adapters/never-was", headers=ADMIN, timeout=TIMEOUT).status_code == 404


def test_the_adapter_api_refuses_anyone_without_the_admin_token(cluster, served_dir):
    """Issue #28's reproduction: list, register ("/etc", or another tenant's name) and delete, tokenless."""
    base, _ = cluster
    before = requests.get(f"{base}/adapters", headers=ADMIN, timeout=TIMEOUT).json()
    attempts = [("GET", f"{base}/adapters", None), ("POST", f"{base}/adapters", {"name": "tone", "src": "/etc"}),
                ("POST", f"{base}/adapters", {"name": "mine", "src": str(served_dir / "domain")}),
                ("DELETE", f"{base}/adapters/tone", None)]
    for method, path, body in attempts:
        for headers in ({}, {ADMIN_TOKEN_HEADER: "guess"}, {ADMIN_TOKEN_HEADER: TOKEN + "x"}):
            answer = requests.request(method, path, json=body, headers=headers, timeout=TIMEOUT)
            assert (answer.status_code, answer.json()["error"]["type"]) == (403, "forbidden"), (method, body)
    assert requests.get(f"{base}/adapters", headers=ADMIN, timeout=TIMEOUT).json() == before


def test_session_keeps_its_adapter_and_blocks_unregister(cluster):
    base, _ = cluster
    opened = ask(base, "tone", session="NEW_SESSION", text="Describe the weather.")
    session_id = NEW_ID_RE.match(opened.headers["X-Amzn-SageMaker-New-Session-Id"]).group(1)
    content(opened)
    mismatch = ask(base, "domain", session=session_id)
    assert mismatch.status_code == 400 and mismatch.json()["error"]["type"] == "adapter_mismatch"
    named_base = ask(base, session=session_id, model="llava")  # TorchServe's name for the base model
    assert named_base.status_code == 400 and named_base.json()["error"]["type"] == "adapter_mismatch"
    follow = ask(base, session=session_id, text="And tomorrow?")
    assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert follow.json()["model"] == "tone"  # the adapter that answered, though the request named none
    busy = requests.delete(f"{base}/adapters/tone", headers=ADMIN, timeout=TIMEOUT)
    assert busy.status_code == 409 and busy.json()["error"]["type"] == "adapter_in_use"
    closed = requests.post(f"{base}/invocations", json={"requestType": "CLOSE"}, headers={SESSION_HEADER: session_id},
                           timeout=TIMEOUT)
    assert closed.status_code == 200
    assert "tone" in {a["name"] for a in requests.get(f"{base}/adapters", headers=ADMIN, timeout=TIMEOUT).json()["adapters"]}


def test_boto3_inference_component_selects_the_adapter(cluster):
    base, front = cluster
    client = sagemaker_client((front, None))
    import json

    body = json.dumps(chat("Tell me about adapters.", max_tokens=10))
    with_component = client.invoke_endpoint(EndpointName="resident", Body=body, ContentType="application/json",
                                            InferenceComponentName="domain")
    text = json.loads(with_component["Body"].read())["choices"][0]["message"]["content"]
    assert text == content(ask(base, "domain")) != content(ask(base))
