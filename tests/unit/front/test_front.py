"""session/front/server.py against small fake backends (aiohttp servers in this process): headers both ways,
errors as JSON, limits, timeouts, failover, and event-stream conversion as chunks arrive."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from botocore.eventstream import EventStreamBuffer

from session.errors import ConfigError
from session.front.config import FrontConfig
from session.front.forwarding import split_sse
from session.front.server import Front
from session.serving.protocol import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, SESSION_HEADER, new_session_header_value
from tests.fake_backend import FakeServer

pytestmark = pytest.mark.asyncio

SID = "5f0c1d2e-0000-4000-8000-000000000001"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeBackend(FakeServer):
    """A TorchServe stand-in answered by ``handler``; records requests."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.requests: list[tuple[str, dict[str, str], bytes]] = []  # (path, headers, body)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.headers), await request.read()))
        return await self.handler(request)


async def answer_ok(request: web.Request) -> web.Response:
    """A session-aware answer in our handler's shape: opens, follows up, closes."""
    body = json.loads(await request.read())
    session = request.headers.get(SESSION_HEADER)
    headers = {"X-Resident-Worker": "fake:1", "ts_stream_next": "true", "Pragma": "no-cache"}
    if body.get("requestType") == "CLOSE":
        headers[CLOSED_SESSION_HEADER] = session
        return web.json_response({"session_id": session, "closed": True}, headers=headers)
    if session == "NEW_SESSION":
        headers[NEW_SESSION_HEADER] = new_session_header_value(SID, 4_000_000_000)
    elif session:
        headers[SESSION_HEADER] = session
    return web.json_response({"choices": [{"message": {"content": "ok"}}]}, headers=headers)


@contextlib.asynccontextmanager
async def stack(*handlers: Handler, **settings):
    """Fake backends + a front before them (probed once, so healthy), + an HTTP client."""
    backends = [await FakeBackend(h).start() for h in handlers]
    config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), health_interval_s=3600.0,
                                  **settings)
    front = Front(config)
    await front.start("127.0.0.1", 0)
    await front.check_health()
    client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{front.port}")
    try:
        yield front, backends, client
    finally:
        await client.close()
        await front.stop()
        for backend in backends:
            await backend.stop()


async def test_config_from_env_and_its_errors():
    config = FrontConfig.from_env({"RESIDENT_FRONT_BACKENDS": "http://a:1/, http://b:2",
                                   "RESIDENT_FRONT_TIMEOUT_S": "12.5", "RESIDENT_FRONT_UNHEALTHY_AFTER": "4"})
    assert (config.backends, config.timeout_s, config.unhealthy_after) == (("http://a:1", "http://b:2"), 12.5, 4)
    assert config.max_request_bytes == 6 * 1024 * 1024
    with pytest.raises(ConfigError, match="RESIDENT_FRONT_BACKENDS"):
        FrontConfig.from_env({})
    with pytest.raises(ConfigError, match="RESIDENT_FRONT_TIMEOUT_S must be float"):
        FrontConfig.from_env({"RESIDENT_FRONT_BACKENDS": "http://a:1", "RESIDENT_FRONT_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="one per backend"):
        FrontConfig.from_env({"RESIDENT_FRONT_BACKENDS": "http://a:1",
                              "RESIDENT_FRONT_MANAGEMENT_URLS": "http://a:2,http://a:3"})
    with pytest.raises(ConfigError, match="not an http"):
        FrontConfig.from_env({"RESIDENT_FRONT_BACKENDS": "a:1"})


async def test_backend_tags_default_to_b_i_and_are_checked():
    two = {"RESIDENT_FRONT_BACKENDS": "http://a:1,http://b:2"}
    assert FrontConfig.from_env(two).session_tags() == ("b0", "b1")
    assert FrontConfig.from_env({**two, "RESIDENT_FRONT_BACKEND_TAGS": "ia*, ib*"}).session_tags() == ("ia*", "ib*")
    assert FrontConfig.from_env({**two, "RESIDENT_FRONT_BACKEND_TAGS": "none"}).session_tags() == ("", "")
    with pytest.raises(ConfigError, match="1 tags for 2 backends"):
        FrontConfig.from_env({**two, "RESIDENT_FRONT_BACKEND_TAGS": "x"})
    with pytest.raises(ConfigError, match="letters and digits"):
        FrontConfig.from_env({**two, "RESIDENT_FRONT_BACKEND_TAGS": "b-0,b1"})
    front = Front(FrontConfig.from_env({**two, "RESIDENT_FRONT_BACKEND_TAGS": "ia*,ib*"}))
    assert [b.tag for b in front.router.backends] == ["ia*", "ib*"]


async def test_split_sse():
    assert split_sse(b"data: 1\n\ndata: 2\n\ndata: 3") == ([b"data: 1\n\n", b"data: 2\n\n"], b"data: 3")
    assert split_sse(b"") == ([], b"")


async def test_headers_pass_both_ways_and_backend_is_named():
    async with stack(answer_ok) as (front, [backend], client):
        response = await client.post("/invocations", json=CHAT, headers={
            SESSION_HEADER: "NEW_SESSION", "X-Amzn-SageMaker-Custom-Attributes": "trace=1",
            "Authorization": "AWS4-HMAC-SHA256 secret"})
        assert response.status == 200
        assert response.headers[NEW_SESSION_HEADER] == f"{SID}; Expires=2096-10-02T07:06:40Z"
        assert response.headers["X-Resident-Backend"] == "0"
        assert response.headers["X-Resident-Worker"] == "fake:1"
        assert "ts_stream_next" not in response.headers and "Pragma" not in response.headers
        assert "x-Amzn-Invoked-Production-Variant" not in response.headers  # only on SageMaker paths
        path, sent, body = backend.requests[0]
        assert path == "/invocations"
        assert sent[SESSION_HEADER] == "NEW_SESSION"
        assert sent["X-Amzn-SageMaker-Custom-Attributes"] == "trace=1"
        assert "Authorization" not in sent
        assert json.loads(body) == CHAT
        assert front.router.pins[SID].backend.index == 0


async def test_sagemaker_path_forwards_to_invocations_and_close_forgets_the_pin():
    async with stack(answer_ok, answer_ok) as (front, backends, client):
        opened = await client.post("/endpoints/llava/invocations", json=CHAT, headers={SESSION_HEADER: "NEW_SESSION"})
        assert opened.headers["x-Amzn-Invoked-Production-Variant"] == "AllTraffic"
        assert [b.num_sessions for b in front.router.backends] == [1, 0]
        follow = await client.post("/endpoints/llava/invocations", json=CHAT, headers={SESSION_HEADER: SID})
        assert (follow.status, follow.headers["X-Resident-Backend"]) == (200, "0")
        closed = await client.post("/endpoints/llava/invocations", json={"requestType": "CLOSE"},
                                   headers={SESSION_HEADER: SID})
        assert closed.headers[CLOSED_SESSION_HEADER] == SID
        assert front.router.pins == {}
        assert [len(b.requests) for b in backends] == [3, 0]
        assert {r[0] for r in backends[0].requests} == {"/invocations"}
        assert [(b.num_outstanding, b.num_requests) for b in front.router.backends] == [(0, 3), (0, 0)]


async def test_errors_are_json_with_sagemaker_error_type_on_sagemaker_paths():
    async with stack(answer_ok, max_request_bytes=1000) as (front, backends, client):
        unknown = await client.post("/endpoints/x/invocations", json=CHAT, headers={SESSION_HEADER: SID})
        assert unknown.status == 404
        assert unknown.headers["X-Amzn-ErrorType"] == "session_not_found"
        body = await unknown.json()
        assert body["error"]["type"] == "session_not_found"
        assert body["message"] == body["error"]["message"]
        plain = await client.post("/invocations", json=CHAT, headers={SESSION_HEADER: "bad_id"})
        assert plain.status == 400
        assert "X-Amzn-ErrorType" not in plain.headers
        assert (await plain.json())["error"]["type"] == "invalid_session_id"
        big = await client.post("/invocations", data=b"x" * 1001, headers={"Content-Type": "application/json"})
        assert big.status == 413
        assert (await big.json())["error"]["type"] == "payload_too_large"
        exact = await client.post("/invocations", data=json.dumps({**CHAT, "user": "x" * 900}).ljust(1000))
        assert exact.status == 200
        missing = await client.get("/nowhere")
        assert (missing.status, (await missing.json())["error"]["type"]) == (404, "not_found")
        wrong = await client.get("/invocations")
        assert (wrong.status, (await wrong.json())["error"]["type"]) == (405, "method_not_allowed")
        assert len(backends[0].requests) == 1  # only the one that fit


async def test_backend_errors_are_relayed_as_json():
    async def html_500(request):
        return web.Response(status=500, text="<html>oops</html>", content_type="text/html")

    async def torchserve_404(request):
        return web.json_response({"code": 404, "type": "ModelNotFoundException", "message": "Model not found"},
                                 status=404)

    async with stack(html_500, torchserve_404) as (front, backends, client):
        first = await client.post("/invocations", json=CHAT)
        assert first.status == 500
        assert await first.json() == {"error": {"type": "backend_error", "message": "<html>oops</html>",
                                                "code": "backend_error"}}
        front.router.acquire(front.router.backends[0])  # make backend 1 the least loaded
        third = await client.post("/endpoints/x/invocations", json=CHAT)
        assert third.status == 404
        assert third.headers["X-Amzn-ErrorType"] == "ModelNotFoundException"
        assert third.headers["X-Resident-Backend"] == "1"


async def test_refused_connection_fails_over_and_pinned_sessions_get_410():
    async with stack(answer_ok, answer_ok) as (front, backends, client):
        opened = await client.post("/invocations", json=CHAT, headers={SESSION_HEADER: "NEW_SESSION"})
        assert opened.headers["X-Resident-Backend"] == "0"
        await backends[0].stop()  # its port now refuses connections
        front.router.acquire(front.router.backends[1])  # so that backend 0 is the least loaded
        stateless = await client.post("/invocations", json=CHAT)
        front.router.release(front.router.backends[1])
        assert (stateless.status, stateless.headers["X-Resident-Backend"]) == (200, "1")
        assert [b.num_requests for b in front.router.backends] == [2, 2]  # tried 0, refused, then 1
        assert [b.healthy for b in front.router.backends] == [False, True]
        gone = await client.post("/invocations", json=CHAT, headers={SESSION_HEADER: SID})
        assert gone.status == 410
        assert (await gone.json())["error"]["type"] == "session_backend_unavailable"
        ping = await client.get("/ping")
        assert (ping.status, (await ping.json())["healthy_backends"]) == (200, 1)
        await backends[1].stop()
        await front.check_health()
        await front.check_health()
        await front.check_health()
        assert (await client.get("/ping")).status == 503
        none = await client.post("/invocations", json=CHAT)
        assert (none.status, none.headers["Retry-After"]) == (503, "2")
        assert (await none.json())["error"]["type"] == "backend_unavailable"
        assert [b.num_outstanding for b in front.router.backends] == [0, 0]


async def test_timeout_answers_504():
    async def slow(request):
        await asyncio.sleep(1.0)
        return web.json_response({})

    async with stack(slow, timeout_s=0.3) as (front, backends, client):
        response = await client.post("/invocations", json=CHAT)
        assert response.status == 504
        assert (await response.json())["error"]["type"] == "backend_timeout"
        assert front.router.backends[0].num_outstanding == 0


def sse_backend(release: asyncio.Event, break_off: bool = False) -> Handler:
    async def handler(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", SESSION_HEADER: SID})
        await response.prepare(request)
        await response.write(b'data: {"n":1}\n\ndata: {"n"')  # one event and the start of the next
        await release.wait()
        if break_off:
            request.transport.close()
            return response
        await response.write(b':2}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response
    return handler


async def read_frames(response: aiohttp.ClientResponse, buffer: EventStreamBuffer, count: int) -> list:
    frames = list(buffer)
    while len(frames) < count:
        chunk = await asyncio.wait_for(response.content.readany(), 5)
        if not chunk:
            break
        buffer.add_data(chunk)
        frames.extend(buffer)
    return frames


async def test_response_stream_converts_each_sse_event_as_it_arrives():
    release = asyncio.Event()
    async with stack(answer_ok, sse_backend(release)) as (front, backends, client):
        front.router.pin(SID, front.router.backends[1], None)  # the session lives on the SSE backend
        response = await client.post("/endpoints/x/invocations-response-stream", json=CHAT,
                                     headers={SESSION_HEADER: SID})
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/vnd.amazon.eventstream"
        assert response.headers["X-Amzn-SageMaker-Content-Type"] == "text/event-stream"
        assert response.headers["X-Resident-Backend"] == "1"
        buffer = EventStreamBuffer()
        [first] = await read_frames(response, buffer, 1)  # arrives while the backend still holds the rest
        assert first.payload == b'data: {"n":1}\n\n'
        assert first.headers[":event-type"] == "PayloadPart"
        release.set()
        rest = await read_frames(response, buffer, 2)
        assert [f.payload for f in rest] == [b'data: {"n":2}\n\n', b"data: [DONE]\n\n"]
        assert json.loads(backends[1].requests[0][2]) == {**CHAT, "stream": True}
        assert front.router.backends[1].num_outstanding == 0


async def test_response_stream_refuses_to_open_a_session():
    async with stack(answer_ok) as (front, backends, client):
        by_header = await client.post("/endpoints/x/invocations-response-stream", json=CHAT,
                                      headers={SESSION_HEADER: "NEW_SESSION"})
        by_body = await client.post("/endpoints/x/invocations-response-stream",
                                    json={**CHAT, "requestType": "NEW_SESSION"})
        not_json = await client.post("/endpoints/x/invocations-response-stream", data=b"[1, 2")
        for response in (by_header, by_body, not_json):
            assert response.status == 400
            assert response.headers["X-Amzn-ErrorType"] == "invalid_request_error"
        assert "cannot open a session" in (await by_header.json())["error"]["message"]
        assert backends[0].requests == []


async def test_a_close_on_the_stream_path_is_one_payload_part():
    async with stack(answer_ok) as (front, backends, client):
        front.router.pin(SID, front.router.backends[0], None)
        response = await client.post("/endpoints/x/invocations-response-stream", json={"requestType": "CLOSE"},
                                     headers={SESSION_HEADER: SID})
        assert response.headers[CLOSED_SESSION_HEADER] == SID
        buffer = EventStreamBuffer()
        buffer.add_data(await response.read())
        [part] = list(buffer)
        assert json.loads(part.payload) == {"session_id": SID, "closed": True}
        assert front.router.pins == {}


async def test_a_broken_stream_ends_with_model_stream_error_or_an_sse_error():
    release = asyncio.Event()
    release.set()
    async with stack(sse_backend(release, break_off=True)) as (front, backends, client):
        events = await client.post("/endpoints/x/invocations-response-stream", json=CHAT)
        buffer = EventStreamBuffer()
        buffer.add_data(await events.read())
        first, error = list(buffer)
        assert first.payload == b'data: {"n":1}\n\n'
        assert error.headers[":exception-type"] == "ModelStreamError"
        assert json.loads(error.payload)["ErrorCode"] == "backend_error"
        sse = await client.post("/invocations", json={**CHAT, "stream": True})
        text = (await sse.read()).decode()
        assert text.startswith('data: {"n":1}\n\ndata: {"n"')  # relayed as it came, then the error event
        error = json.loads(text.rsplit("data: ", 1)[1])["error"]
        assert error["type"] == "backend_error"
        assert error["message"].startswith("backend 0 broke off its stream")
