"""End to end: a real TorchServe on 127.0.0.1 serving the tiny demo LLaVA through our handler."""

from __future__ import annotations

import io
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from PIL import Image

from launch.torchserve import start_torchserve
from tests.conftest import data_url, free_port, image_url, png_bytes

pytestmark = pytest.mark.e2e

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_ID = "X-Amzn-SageMaker-Closed-Session-Id"
NEW_ID_RE = re.compile(r"^([a-zA-Z0-9](-*[a-zA-Z0-9])*); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$")
TTL_S = 600
TIMEOUT = 60


def start(tmp_path_factory, name, **env):
    port = free_port(5)
    log = open(tmp_path_factory.mktemp(name) / "torchserve.log", "w")
    server = start_torchserve(port, run_dir=tmp_path_factory.mktemp(name + "-run"), stdout=log,
                              extra_env={k: str(v) for k, v in env.items()})
    try:
        server.wait_ready(timeout_s=240)
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    ts = start(tmp_path_factory, "ts", RESIDENT_SESSION_TTL_S=TTL_S, RESIDENT_MAX_IMAGE_BYTES=200_000,
               RESIDENT_MAX_IMAGE_PIXELS=1_000_000)
    yield ts
    ts.stop()


def chat(text, image_seed=None, **extra):
    content = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url(image_seed)}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 10, **extra}


def post(server, body, session=None, path="/invocations", raw=None, headers=None):
    hdrs = dict(headers or {})
    if session is not None:
        hdrs[SESSION] = session
    if raw is not None:
        return requests.post(server.url + path, data=raw, headers={"Content-Type": "application/json", **hdrs},
                             timeout=TIMEOUT)
    return requests.post(server.url + path, json=body, headers=hdrs, timeout=TIMEOUT)


def open_session(server, seed=0, text="What is in this image?"):
    response = post(server, chat(text, image_seed=seed), session="NEW_SESSION")
    assert response.status_code == 200, response.text
    match = NEW_ID_RE.match(response.headers[NEW_SESSION_ID])
    assert match, response.headers[NEW_SESSION_ID]
    return match.group(1), response


def answer(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def test_ping(server):
    response = requests.get(server.url + "/ping", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.json()["status"] == "Healthy"


def test_the_management_url_relays_describe_and_nothing_else(server):
    """Issues #28 and #39: a local process could POST /models?url=... and load a handler of its own.
    The management API is a private Unix socket now (tests/e2e/test_closed_surfaces.py); its URL
    relays only the describe that the front reads."""
    registered = requests.post(f"{server.management_url}/models", timeout=TIMEOUT,
                               params={"url": "evil.mar", "model_name": "evil", "initial_workers": "1"})
    assert registered.status_code == 404
    assert requests.delete(f"{server.management_url}/models/llava", timeout=TIMEOUT).status_code == 405
    described = requests.get(f"{server.management_url}/models/llava", timeout=TIMEOUT)  # what the front reads
    assert described.status_code == 200 and described.json()[0]["workers"][0]["status"] == "READY"
    assert requests.get(f"{server.management_url}/models", timeout=TIMEOUT).status_code == 404
    assert server.worker_statuses() == ["READY"]


def test_open_follow_up_close_with_exact_headers(server):
    before = time.time()
    session_id, opened = open_session(server)
    expires = NEW_ID_RE.match(opened.headers[NEW_SESSION_ID]).group(3)
    expires_epoch = time.mktime(time.strptime(expires, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert before + TTL_S - 2 <= expires_epoch <= time.time() + TTL_S + 1
    assert len(session_id) <= 256
    first = opened.json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["completion_tokens"] == 10
    assert first["choices"][0]["finish_reason"] == "length"

    # lower-case header name, the TorchServe predictions path
    follow = post(server, chat("And what colour is it?"), path="/predictions/llava",
                  headers={SESSION.lower(): session_id})
    assert follow.status_code == 200, follow.text
    usage = follow.json()["usage"]
    # everything but the previous answer's last token (generated, never fed) came from the session
    assert usage["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] + 10 - 1
    assert usage["prompt_tokens"] > first["usage"]["prompt_tokens"] + 10
    assert NEW_SESSION_ID not in follow.headers

    closed = post(server, {"requestType": "CLOSE"}, session=session_id)
    assert closed.status_code == 200
    assert closed.headers[CLOSED_SESSION_ID] == session_id
    assert closed.json() == {"session_id": session_id, "closed": True}

    gone = post(server, chat("Still there?"), session=session_id)
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "session_not_found"
    assert "was closed" in gone.json()["error"]["message"]


def test_new_session_by_body_request_type(server):
    response = post(server, {**chat("Hello there", image_seed=1), "requestType": "NEW_SESSION"})
    assert response.status_code == 200, response.text
    session_id = NEW_ID_RE.match(response.headers[NEW_SESSION_ID]).group(1)
    assert post(server, {"requestType": "CLOSE"}, session=session_id).headers[CLOSED_SESSION_ID] == session_id


def test_stream_joins_to_the_plain_answer(server):
    plain = post(server, chat("Tell me a story", image_seed=2))
    streamed = requests.post(server.url + "/invocations", json=chat("Tell me a story", image_seed=2, stream=True),
                             timeout=TIMEOUT, stream=True)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in streamed.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == answer(plain)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # not asked for (stream_options.include_usage)


def converse(server, seed, questions):
    session_id, opened = open_session(server, seed=seed)
    answers, workers, cached = [answer(opened)], {opened.headers["X-Resident-Worker"]}, []
    for question in questions:
        response = post(server, chat(question), session=session_id)
        assert response.status_code == 200, response.text
        answers.append(answer(response))
        workers.add(response.headers["X-Resident-Worker"])
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    closed = post(server, {"requestType": "CLOSE"}, session=session_id)
    assert closed.headers[CLOSED_SESSION_ID] == session_id
    return answers, workers, cached


def test_twenty_concurrent_sessions_answer_correctly(server):
    questions = ["What colour is it?", "Where was it taken?"]
    seeds = [10, 11, 12, 13]
    reference = {seed: converse(server, seed, questions)[0] for seed in seeds}  # one at a time
    assert len({tuple(a) for a in reference.values()}) == len(seeds)  # different images, different answers
    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = [(seeds[i % 4], pool.submit(converse, server, seeds[i % 4], questions)) for i in range(20)]
        results = [(seed, f.result(timeout=240)) for seed, f in futures]
    for seed, (answers, workers, cached) in results:
        assert answers == reference[seed]
        assert len(workers) == 1  # every turn of the session reached the one worker holding it
        assert all(c > 0 for c in cached)


def big_png(num_bytes: int) -> bytes:
    import numpy as np

    side = int((num_bytes / 3) ** 0.5) + 1
    return png_bytes(Image.fromarray(np.random.RandomState(0).randint(0, 255, (side, side, 3), dtype=np.uint8)))


def bomb_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buffer, format="PNG")  # ~50 KB on the wire, 400 Mpx decoded
    return buffer.getvalue()


BAD_INPUTS = [
    ("malformed json", dict(raw=b'{"messages": [}'), 400, "invalid_request_error", "not valid JSON"),
    ("wrong type", dict(body={**chat("hi"), "max_tokens": "ten"}), 400, "invalid_request_error", "max_tokens"),
    ("missing messages", dict(body={"max_tokens": 5}), 400, "invalid_request_error", "messages"),
    ("unknown field", dict(body={**chat("hi"), "frobnicate": 1}), 400, "invalid_request_error", "frobnicate"),
    ("invalid session id", dict(body=chat("hi"), session="bad_id"), 400, "invalid_session_id", "bad_id"),
    ("unknown session id", dict(body=chat("hi"), session="0d5e7a0c-0000-4000-8000-000000000000"), 404,
     "session_not_found", "unknown"),
    ("image does not decode", dict(body={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}},
        {"type": "text", "text": "hi"}]}]}), 400, "invalid_image", "does not decode"),
    ("image too many bytes", dict(body={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(big_png(300_000))}}]}]}), 413,
     "payload_too_large", "limit"),
    ("decompression bomb", dict(body={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(bomb_png())}}]}]}), 413, "payload_too_large", "pixel"),
    ("prompt beyond context", dict(body={**chat("word " * 1500), "max_tokens": 5}), 400,
     "context_length_exceeded", "context window"),
    ("max_tokens beyond limit", dict(body={**chat("hi"), "max_tokens": 5000}), 400, "invalid_request_error",
     "max_tokens"),
]


@pytest.mark.parametrize("name,request_kwargs,status,error_type,fragment", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_json_4xx_and_server_keeps_serving(server, name, request_kwargs, status, error_type, fragment):
    kwargs = dict(request_kwargs)
    response = post(server, kwargs.pop("body", None), **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type
    assert fragment in error["message"]
    healthy = post(server, chat("still fine?"))
    assert healthy.status_code == 200
    assert healthy.json()["usage"]["completion_tokens"] == 10


def test_idle_session_expires_on_the_server(tiny_model_path, tmp_path_factory):
    """The reaper frees it with no request coming, and the metrics say so with none coming either (the
    handler emitted them only when a request ended, so an idle server showed the session live)."""
    server = start(tmp_path_factory, "ttl", RESIDENT_SESSION_TTL_S=2, RESIDENT_REAPER_INTERVAL_S=0.2)
    try:
        session_id, _ = open_session(server)
        assert wait_for_metric(server, "LiveSessions", [0.0], timeout_s=15) == [0.0]
        expired = metric_values(server, "SessionEvents")
        assert [v for k, v in expired.items() if 'Event="expired"' in k] == [1.0]
        gone = post(server, chat("hello again"), session=session_id)
        assert gone.status_code == 404
        assert "was expired" in gone.json()["error"]["message"]  # the reaper freed it before this request
    finally:
        server.stop()


def metric_values(server, name: str) -> dict[str, float]:
    """A model metric's values on TorchServe's /metrics, by their labels."""
    text = requests.get(f"{server.metrics_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}


def wait_for_metric(server, name: str, values: list[float], timeout_s: float) -> list[float]:
    """The metric's values once they are ``values``, or as they are after ``timeout_s`` (metric lines
    reach TorchServe's endpoint through its log reader)."""
    deadline = time.monotonic() + timeout_s
    while (now := list(metric_values(server, name).values())) != values and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def test_burst_beyond_capacity_gets_only_200_or_503_then_serves(tiny_model_path, tmp_path_factory):
    # Room for about two sessions' KV and a short queue: a burst of 24 new sessions overflows both.
    server = start(tmp_path_factory, "burst", RESIDENT_DEVICE_BUDGET_BYTES=2 * 64 * 512 * 2,
                   RESIDENT_KV_BLOCK_TOKENS=64, RESIDENT_HOST_BUDGET_BYTES=0, RESIDENT_MAX_QUEUE=4)
    try:
        def one(i):
            return post(server, {**chat(f"burst {i}", image_seed=i), "max_tokens": 30}, session="NEW_SESSION")

        with ThreadPoolExecutor(max_workers=24) as pool:
            responses = list(pool.map(one, range(24)))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses
        for response in responses:
            if response.status_code == 503:
                assert response.headers["Retry-After"] in ("1", "5")
                assert response.json()["error"]["type"] == "capacity_exceeded"
        after = post(server, chat("calm again", image_seed=99))
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 10
    finally:
        server.stop()
