"""End to end: the front before two real TorchServe backends on 127.0.0.1, driven with requests and
with the real boto3 ``sagemaker-runtime`` client (docs/DESIGN.md, "TorchServe as we found it"). The last test kills a backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
import requests
from botocore.config import Config
from botocore.exceptions import ClientError

from launch.torchserve import MODEL_NAME, start_torchserve
from session.front.answers import BACKEND_HEADER
from session.front.config import FrontConfig
from session.front.server import Front
from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    CLOSED_SESSION_HEADER,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    WORKER_HEADER,
)
from tests.conftest import free_port, image_url

pytestmark = pytest.mark.e2e

NEW_ID_RE = re.compile(r"^([a-zA-Z0-9](-*[a-zA-Z0-9])*); Expires=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
TIMEOUT = 60
ADMIN_TOKEN = "front-e2e-admin-token"


class FrontThread:
    """The front on its own event loop in a thread, so that tests can talk to it synchronously."""

    def __init__(self, config: FrontConfig):
        self.front = Front(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="front", daemon=True)

    def start(self, port: int) -> FrontThread:
        self.thread.start()
        self.call(self.front.start("127.0.0.1", port))
        return self

    def call(self, coroutine, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.call(self.front.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def running_cluster(tmp_path_factory, prefix: str, env: dict[str, str], **front_overrides):
    """Two TorchServe backends (started together) and the front before them; everything stopped after."""
    servers, front = [], None
    try:
        for i in range(2):
            log = open(tmp_path_factory.mktemp(f"{prefix}{i}") / "torchserve.log", "w")
            servers.append(start_torchserve(free_port(5), run_dir=tmp_path_factory.mktemp(f"{prefix}{i}-run"),
                                            stdout=log, extra_env=env))
        for server in servers:
            server.wait_ready(timeout_s=240)
        config = FrontConfig.from_env({}, backends=tuple(s.url for s in servers),
                                      management_urls=tuple(s.management_url for s in servers),
                                      model_name=MODEL_NAME, health_interval_s=0.5, **front_overrides)
        front = FrontThread(config).start(free_port())
        deadline = time.monotonic() + 30
        while not all(b.healthy for b in front.front.router.backends):
            assert time.monotonic() < deadline, "backends not healthy behind the front"
            time.sleep(0.1)
        yield front, servers
    finally:
        if front is not None:
            front.stop()
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    with running_cluster(tmp_path_factory, "backend", {"RESIDENT_THREADS": "1", "RESIDENT_ADMIN_TOKEN": ADMIN_TOKEN},
                         timeout_s=TIMEOUT, admin_token=ADMIN_TOKEN) as running:
        yield running


def url(cluster) -> str:
    return f"http://127.0.0.1:{cluster[0].front.port}"


def chat(text, image_seed=None, max_tokens=8, **extra):
    content = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url(image_seed)}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def post(cluster, body, session=None, path="/invocations"):
    headers = {SESSION_HEADER: session} if session else {}
    return requests.post(url(cluster) + path, json=body, headers=headers, timeout=TIMEOUT)


def answer(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def open_session(cluster, seed, text="What is in this image?"):
    response = post(cluster, chat(text, image_seed=seed), session="NEW_SESSION")
    assert response.status_code == 200, response.text
    return NEW_ID_RE.match(response.headers[NEW_SESSION_HEADER]).group(1), response


def sagemaker_client(cluster):
    return boto3.client("sagemaker-runtime", endpoint_url=url(cluster), region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(retries={"total_max_attempts": 1}, read_timeout=TIMEOUT + 10))


def test_ping_and_backends(cluster):
    ping = requests.get(url(cluster) + "/ping", timeout=TIMEOUT)
    assert (ping.status_code, ping.json()) == (200, {"status": "Healthy", "healthy_backends": 2, "backends": 2})
    refused = requests.get(url(cluster) + "/backends", timeout=TIMEOUT)  # internal URLs: not for anyone
    assert (refused.status_code, refused.json()["error"]["type"]) == (403, "forbidden")
    described = requests.get(url(cluster) + "/backends", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN},
                             timeout=TIMEOUT).json()
    assert [(b["index"], b["healthy"], b["num_outstanding"]) for b in described["backends"]] == \
        [(0, True, 0), (1, True, 0)]


def converse(cluster, seed, questions):
    session_id, opened = open_session(cluster, seed)
    answers = [answer(opened)]
    backends, workers = {opened.headers[BACKEND_HEADER]}, {opened.headers[WORKER_HEADER]}
    for question in questions:
        response = post(cluster, chat(question), session=session_id)
        assert response.status_code == 200, response.text
        answers.append(answer(response))
        backends.add(response.headers[BACKEND_HEADER])
        workers.add(response.headers[WORKER_HEADER])
    closed = post(cluster, {"requestType": "CLOSE"}, session=session_id)
    assert closed.headers[CLOSED_SESSION_HEADER] == session_id
    backends.add(closed.headers[BACKEND_HEADER])
    return answers, backends, workers


def test_concurrent_sessions_each_stay_on_one_backend(cluster):
    front = cluster[0].front
    questions = ["What colour is it?", "Where was it taken?"]
    seeds = [20, 21, 22]
    reference = {seed: converse(cluster, seed, questions)[0] for seed in seeds}  # one at a time
    assert len({tuple(a) for a in reference.values()}) == len(seeds)
    with ThreadPoolExecutor(max_workers=24) as pool:
        futures = [(seeds[i % 3], pool.submit(converse, cluster, seeds[i % 3], questions)) for i in range(24)]
        results = [(seed, future.result(timeout=240)) for seed, future in futures]
    worker_of_backend = {}
    for seed, (answers, backends, workers) in results:
        assert answers == reference[seed]  # same image and questions: same greedy answers, on either backend
        assert len(backends) == 1 and len(workers) == 1  # every turn, and the close, reached one backend
        backend, worker = backends.pop(), workers.pop()
        assert worker_of_backend.setdefault(backend, worker) == worker
    assert set(worker_of_backend) == {"0", "1"}  # sessions were spread over both
    assert worker_of_backend["0"] != worker_of_backend["1"]
    assert front.router.pins == {}  # every close forgot its pin
    assert [(b.num_outstanding, b.num_sessions) for b in front.router.backends] == [(0, 0), (0, 0)]
    assert sum(b.num_requests for b in front.router.backends) == (3 + 24) * 4  # open, 2 follow-ups, close


def invoke(client, body, session_id):
    return client.invoke_endpoint(EndpointName="llava", Body=json.dumps(body), ContentType="application/json",
                                  SessionId=session_id)


def test_boto3_sagemaker_client_sessions_and_response_stream(cluster):
    client = sagemaker_client(cluster)
    first = chat("Describe the picture.", image_seed=30)
    opened_a = invoke(client, first, "NEW_SESSION")
    opened_b = invoke(client, first, "NEW_SESSION")
    match_a, match_b = NEW_ID_RE.match(opened_a["NewSessionId"]), NEW_ID_RE.match(opened_b["NewSessionId"])
    assert match_a and match_b
    id_a, id_b = match_a.group(1), match_b.group(1)
    backend_a = opened_a["ResponseMetadata"]["HTTPHeaders"]["x-resident-backend"]
    backend_b = opened_b["ResponseMetadata"]["HTTPHeaders"]["x-resident-backend"]
    assert {backend_a, backend_b} == {"0", "1"}  # the second went to the backend holding fewer sessions
    assert opened_a["Body"].read() and opened_b["Body"].read()

    for turn in ("What colour is it?", "Is it large?"):  # identical histories in both sessions
        for session_id, backend in ((id_a, backend_a), (id_b, backend_b)):
            reply = invoke(client, chat(turn), session_id)
            assert reply["ResponseMetadata"]["HTTPHeaders"]["x-resident-backend"] == backend
            assert reply["ResponseMetadata"]["HTTPHeaders"][SESSION_HEADER.lower()] == session_id
            assert "NewSessionId" not in reply

    question = chat("Tell me more about it.", max_tokens=12)
    plain = json.loads(invoke(client, question, id_a)["Body"].read())
    question = {**question, "stream_options": {"include_usage": True}}  # usage in a last chunk, as OpenAI sends it
    streamed = client.invoke_endpoint_with_response_stream(
        EndpointName="llava", Body=json.dumps(question), ContentType="application/json", SessionId=id_b)
    assert streamed["ContentType"] == "text/event-stream"
    assert streamed["ResponseMetadata"]["HTTPHeaders"]["x-resident-backend"] == backend_b
    parts = [event["PayloadPart"]["Bytes"] for event in streamed["Body"]]
    assert all(p.startswith(b"data: ") and p.endswith(b"\n\n") for p in parts)  # one SSE event per part
    events = [p[len(b"data: "):-2].decode() for p in parts]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and "usage" not in chunks[-2]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["usage"]["prompt_tokens_details"] == plain["usage"]["prompt_tokens_details"]

    with pytest.raises(ClientError) as refused:
        client.invoke_endpoint_with_response_stream(EndpointName="llava", Body=json.dumps(question),
                                                    ContentType="application/json", SessionId="NEW_SESSION")
    assert refused.value.response["Error"]["Code"] == "invalid_request_error"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400

    for session_id in (id_a, id_b):
        closed = invoke(client, {"requestType": "CLOSE"}, session_id)
        assert closed["ClosedSessionId"] == session_id
    assert cluster[0].front.router.pins == {}
    with pytest.raises(ClientError) as gone:
        invoke(client, chat("Still there?"), id_a)
    assert gone.value.response["Error"]["Code"] == "session_not_found"
    assert gone.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_sse_stream_passes_through_the_front(cluster):
    question = chat("Say something.", image_seed=31, max_tokens=6)
    plain = post(cluster, question)
    streamed = requests.post(url(cluster) + "/invocations", json={**question, "stream": True}, timeout=TIMEOUT)
    assert streamed.status_code == 200
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    assert streamed.headers[BACKEND_HEADER] in ("0", "1")
    events = [line[len("data: "):] for line in streamed.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == answer(plain)


def test_killed_backend_sessions_get_410_others_carry_on(cluster):
    """Must run last in this module: it stops backend 1."""
    front, servers = cluster
    sessions = [open_session(cluster, seed=40 + i) for i in range(4)]
    on = {sid: response.headers[BACKEND_HEADER] for sid, response in sessions}
    assert sorted(on.values()) == ["0", "0", "1", "1"]
    servers[1].stop()

    for session_id, backend in on.items():
        response = post(cluster, chat("Are you there?"), session=session_id)
        if backend == "1":
            assert response.status_code == 410, response.text
            error = response.json()["error"]
            assert error["type"] == "session_backend_unavailable"
            assert "open a new session" in error["message"]
        else:
            assert response.status_code == 200, response.text
            assert response.headers[BACKEND_HEADER] == "0"
    dead = next(sid for sid, backend in on.items() if backend == "1")
    with pytest.raises(ClientError) as info:
        invoke(sagemaker_client(cluster), chat("And now?"), dead)
    assert info.value.response["Error"]["Code"] == "session_backend_unavailable"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 410

    for seed in (50, 51, 52):
        new_id, response = open_session(cluster, seed)
        assert response.headers[BACKEND_HEADER] == "0"
    ping = requests.get(url(cluster) + "/ping", timeout=TIMEOUT)
    assert (ping.status_code, ping.json()["healthy_backends"]) == (200, 1)
    assert [b.healthy for b in front.front.router.backends] == [True, False]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_is_json_whatever_its_content_type_says(cluster, content_type):
    """curl -d labels JSON a form; SageMaker clients send all sorts: the front forwards it as JSON."""
    body = '{"messages": [{"role": "user", "content": "a=b & c+d"}], "max_tokens": 3}'
    headers = {"Content-Type": content_type} if content_type else {}
    answer = requests.post(url(cluster) + "/invocations", data=body.encode(), headers=headers, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
