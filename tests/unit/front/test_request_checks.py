"""What the front checks before it forwards anything: ``/predictions/{model}`` only for a plain model
name in the raw path (no dot-segments, encoded or not, that a backend would resolve to another of its
routes), and no routing header sent twice (a session id routed by one copy and acted on by another)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import aiohttp
import pytest
from aiohttp import web

from launch.nginx import PLAIN_PATHS
from session.front.config import FrontConfig
from session.front.request_checks import PREDICTIONS_PREFIX, predictions_path
from session.front.server import Front
from session.serving.protocol import NEW_SESSION_HEADER, SESSION_HEADER
from tests.fake_backend import TOKEN, SessionBackend

pytestmark = pytest.mark.asyncio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Recorder:
    """A backend that answers anything with 200 and records every request but its health probes, as
    (method, raw path): what reached TorchServe, whichever route it was."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None

    async def answer(self, request: web.Request) -> web.Response:
        if (request.method, request.path) != ("GET", "/ping"):
            self.seen.append((request.method, request.raw_path))
        return web.json_response({"status": "Healthy", "choices": []})

    async def start(self) -> Recorder:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return self

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.runner.addresses[0][1]


@contextlib.asynccontextmanager
async def front_before(backend, **settings):
    config = FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, admin_token=TOKEN,
                                  **settings)
    front = Front(config)
    await front.start("127.0.0.1", 0)
    await front.check_health()
    try:
        yield front
    finally:
        await front.stop()
        await backend.runner.cleanup()


async def raw_post(port: int, target: str, headers: list[tuple[str, str]] = ()) -> tuple[int, dict, bytes]:
    """POST ``target`` with ``headers`` exactly as written (no client normalises the path or merges two
    headers of one name): the status, the JSON body and the raw head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(CHAT).encode()
    extra = b"".join(f"{name}: {value}\r\n".encode() for name, value in headers)
    writer.write(b"POST " + target.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra +
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload or b"{}"), head


@pytest.mark.parametrize("target", [
    "/predictions/..%2Fping", "/predictions/..%2fping", "/predictions/%2e%2e/ping", "/predictions/%2E%2E%2Fping",
    "/predictions/llava/../ping", "/predictions/..%2Fwfpredict%2Fx", "/predictions/..", "/predictions/.",
    "/predictions/llava%2F..%2F..%2Fping", "/predictions/ll%61va", "/predictions/a..b", "/predictions/.llava",
    "/predictions/llava.",
])
async def test_a_predictions_path_that_is_not_a_plain_model_name_is_404_and_reaches_no_backend(target):
    recorder = await Recorder().start()
    async with front_before(recorder) as front:
        status, body, _ = await raw_post(front.port, target)
        assert status == 404, (target, body)
        assert body["error"]["type"] == "not_found"
        assert recorder.seen == []


@pytest.mark.parametrize("target,forwarded", [
    ("/predictions/llava", "/predictions/llava"),
    ("/predictions/llava?x=1", "/predictions/llava"),
    ("/predictions/other-model_2.1", "/predictions/other-model_2.1"),
])
async def test_a_plain_model_name_is_forwarded_as_it_is(target, forwarded):
    recorder = await Recorder().start()
    async with front_before(recorder) as front:
        status, _, _ = await raw_post(front.port, target)
        assert status == 200
        assert recorder.seen == [("POST", forwarded)]


async def test_the_served_model_name_passes_whatever_characters_it_has():
    recorder = await Recorder().start()
    async with front_before(recorder, model_name="llava+v1") as front:
        status, _, _ = await raw_post(front.port, "/predictions/llava+v1")
        assert status == 200
        assert recorder.seen == [("POST", "/predictions/llava+v1")]


@pytest.mark.parametrize("name", ["X-Amzn-SageMaker-Session-Id", "X-Amzn-SageMaker-Adapter-Identifier",
                                  "X-Amzn-SageMaker-Inference-Component", "X-Amzn-SageMaker-Custom-Attributes",
                                  "Authorization", "X-Amzn-SageMaker-Target-Model"])
@pytest.mark.parametrize("path", ["/invocations", "/v1/chat/completions", "/endpoints/e/invocations",
                                  "/endpoints/e/invocations-response-stream"])
async def test_a_header_sent_twice_in_any_case_is_400_naming_it_and_reaches_no_backend(name, path):
    backend = await SessionBackend(0).start()
    async with front_before(backend) as front:
        session_id = backend.new_id()
        first, second = ("NEW_SESSION", session_id) if "Session" in name else ("a", "b")
        status, body, head = await raw_post(front.port, path, [(name, first), (name.lower(), second)])
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error"
        assert name in body["error"]["message"]
        assert NEW_SESSION_HEADER.lower().encode() not in head.lower()
        assert backend.requests == []


async def test_the_session_header_once_is_routed_as_before():
    backend = await SessionBackend(0).start()
    async with front_before(backend) as front:
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://127.0.0.1:{front.port}/invocations", json=CHAT,
                                   headers={SESSION_HEADER: "NEW_SESSION", "Authorization": "x"}) as answer:
                assert answer.status == 200
                assert answer.headers[NEW_SESSION_HEADER].endswith("Z")
        assert [r["session"] for r in backend.requests] == ["NEW_SESSION"]


@pytest.mark.parametrize("target", [
    "/predictions/llava", "/predictions/llava.v1?x=1", "/invocations", "/ping", "/v1/completions",
    "/predictions/..%2Fping", "/predictions/%2e%2e/ping", "/predictions/llava/../ping", "/predictions/a..b",
    "/predictions/.llava", "/predictions/llava.", "/invocations/", "/predictions/ll%61va", "/wfpredict/x",
])
async def test_the_generated_nginx_forwards_the_raw_paths_the_front_does(target):
    """launch/nginx.py's map on $request_uri (real nginx: tests/e2e/test_nginx.py) and the front agree."""
    nginx_allows = re.fullmatch(f"/({PLAIN_PATHS})(\\?.*)?", target) is not None
    if target.startswith(PREDICTIONS_PREFIX):
        try:
            front_allows = bool(predictions_path(target, "llava"))
        except web.HTTPNotFound:
            front_allows = False
        assert nginx_allows == front_allows
    assert nginx_allows == (target.partition("?")[0] in (
        "/predictions/llava", "/predictions/llava.v1", "/invocations", "/ping", "/v1/completions"))
