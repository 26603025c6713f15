"""The invocation service (session/serving/api.py) on the tiny demo LLaVA, as an attacker uses it:
malformed bodies are 4xx JSON errors, never 500s (a seeded fuzz pass of 2,000 bodies); prompts over
the caps are refused in parsing; cancels need the admin token; a reused live request id is
replaced; a request's session and adapter are checked before its images are decoded."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from tests.conftest import image_url

TOKEN = "service-admin-token"
SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture(scope="module")
def service(tiny_model_path):
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_new_tokens=4, default_max_tokens=2,
                                 admin_token=TOKEN, max_prompt_chars=5000, max_messages=8,
                                 check_invariants=True)).start()
    yield ChatService(engine, "llava")
    engine.stop()


def call(service: ChatService, body, headers: dict | None = None):
    """One invocation, its answer read to the end: (status, JSON body or the SSE text, headers)."""
    async def go():
        response = await service.invoke({"Content-Type": "application/json", **(headers or {})}, body)
        if response.chunks is None:
            return response.status, response.body, response.headers
        return response.status, "".join([chunk async for chunk in response.chunks]), response.headers
    return asyncio.run(go())


def chat(content, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


def assert_error(answer, status: int, kind: str, says: str = "") -> None:
    got_status, body, _ = answer
    assert got_status == status, body
    assert body["error"]["type"] == kind and says in body["error"]["message"], body


def test_client_mistakes_that_were_500s_are_400s(service):
    # A lone surrogate (JSON's \ud800 escape) in text, in a string body and in one TorchServe decoded.
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    for body in (raw, json.loads(raw)):
        assert_error(call(service, body), 400, "invalid_request_error", "not valid Unicode text")
    parts = [{"type": "text", "text": "a\udfff"}]
    assert_error(call(service, {"messages": [{"role": "user", "content": parts}]}), 400, "invalid_request_error",
                 "messages[0].content[0].text is not valid Unicode text")
    # A 5,000-digit integer: past the digits Python converts.
    assert_error(call(service, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000
                      + b"}"), 400, "invalid_request_error", "out of range")
    # A non-ASCII admin token is a wrong token (403), not a TypeError in compare_digest.
    assert_error(call(service, b'{"adapters": "list"}', {"X-Resident-Admin-Token": "t\u00f6ken"}), 403, "forbidden")
    assert_error(call(service, b"{}", {"X-Resident-Cancel": "abc", "X-Resident-Admin-Token": "\u2603"}), 403,
                 "forbidden")


def test_prompts_over_the_caps_are_refused_in_parsing(service):
    assert_error(call(service, chat("x" * 5001)), 400, "invalid_request_error",
                 "the messages' text is 5001 characters; at most 5000 per request (RESIDENT_MAX_PROMPT_CHARS)")
    split = [{"type": "text", "text": "y" * 2500}] * 3  # the cap counts every part of every message
    assert_error(call(service, chat(split)), 400, "invalid_request_error", "7500 characters")
    many = {"messages": [{"role": "user", "content": "hi"}] * 9}
    assert_error(call(service, json.dumps(many).encode()), 400, "invalid_request_error",
                 "9 messages; at most 8 per request (RESIDENT_MAX_MESSAGES)")
    status, body, _ = call(service, chat("x" * 100))  # under the caps: answered
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_cancel_needs_the_admin_token(service):
    for headers in ({}, {"X-Resident-Admin-Token": "wrong"}):
        assert_error(call(service, b"{}", {"X-Resident-Cancel": "someone-elses", **headers}), 403, "forbidden")
    status, body, _ = call(service, b"{}", {"X-Resident-Cancel": "someone-elses", "X-Resident-Admin-Token": TOKEN})
    assert (status, body) == (200, {"cancelled": False})


def test_a_reused_live_request_id_runs_under_a_fresh_one(service):
    async def go():
        first = await service.invoke({"X-Resident-Request-Id": "mine-1"}, chat("tell me", stream=True))
        chunks = first.chunks.__aiter__()
        await chunks.__anext__()  # the first request is live
        second = await service.invoke({"X-Resident-Request-Id": "mine-1"}, chat("hello"))
        rest = [chunk async for chunk in chunks]
        return first, second, rest
    first, second, rest = asyncio.run(go())
    assert first.status == 200 and first.headers["X-Resident-Request-Id"] == "mine-1"
    assert second.status == 200, second.body
    assert second.headers["X-Resident-Request-Id"] not in ("mine-1", "")
    assert rest[-1] == "data: [DONE]\n\n"
    # Once answered, the id is the client's to use again.
    status, _, headers = call(service, chat("again"), {"X-Resident-Request-Id": "mine-1"})
    assert status == 200 and headers["X-Resident-Request-Id"] == "mine-1"


def test_the_session_and_adapter_are_checked_before_images_are_decoded(service, monkeypatch):
    import session.serving.api as api

    decoded = []
    monkeypatch.setattr(api, "decode_data_url", lambda *a, **k: decoded.append(1) or pytest.fail("decoded"))
    parts = [{"type": "image_url", "image_url": {"url": image_url(3)}}, {"type": "text", "text": "what?"}]
    assert_error(call(service, chat(parts), {SESSION: "0123456789abcdef0123456789abcdef"}), 404,
                 "session_not_found", "unknown on this worker")
    assert_error(call(service, chat(parts), {"X-Amzn-SageMaker-Adapter-Identifier": "nobody"}), 404,
                 "adapter_not_found")
    assert decoded == []


# ---------------------------------------------------------------- fuzz


BIG_INT = "@big{}@"


def _value(rng: random.Random, depth: int = 0):
    """Any JSON value, biased towards the shapes and edges a parser trips on."""
    kinds = ["int", "bigint", "float", "str", "surrogate", "bool", "null", "list", "dict"]
    kind = rng.choice(kinds if depth < 3 else kinds[:7])
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 3, 2**31, -(2**63) - 1, 2**64, 10**30])
    if kind == "bigint":  # written into the JSON text as digits (Python itself converts at most 4,300)
        return BIG_INT.format(rng.choice([20, 400, 4400]))
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e308, -1e-308, 2.5, 1e400])  # 1e400 serialises as Infinity
    if kind == "str":
        return rng.choice(["", "hi", "NEW_SESSION", "CLOSE", "user", "text", "image_url", "data:,", "\x00",
                           "data:image/png;base64,AAAA", "x" * rng.choice([1, 100, 6000])])
    if kind == "surrogate":
        return "a\ud800b"
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "null":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 9]))]
    return {rng.choice(["role", "content", "type", "text", "image_url", "url", "x"]): _value(rng, depth + 1)
            for _ in range(rng.choice([0, 1, 2, 3]))}


def _part(rng: random.Random):
    if rng.random() < 0.5:
        return {"type": "text", "text": rng.choice(["hi", "", _value(rng)])}
    return {"type": "image_url", "image_url": rng.choice([{"url": _value(rng)}, _value(rng), {"url": "data:,"}])}


def _message(rng: random.Random):
    content = rng.choice(["hello", [_part(rng) for _ in range(rng.choice([0, 1, 2]))], _value(rng)])
    message = {"role": rng.choice(["user", "system", "assistant", "tool", _value(rng)]), "content": content}
    if rng.random() < 0.2:
        message[rng.choice(["name", "role", "content"])] = _value(rng)
    return message


FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream", "seed", "requestType",
          "model", "n", "stream_options", "user", "speculative", "bogus", "adapters", "sessions"]


def fuzz_body(rng: random.Random) -> bytes:
    """A request body: mostly schema-shaped with wrong types and edge values, sometimes not JSON at all."""
    if rng.random() < 0.05:
        return rng.choice([b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"messages": [}', b"[" * 3000, b"\x00"])
    body: dict = {}
    if rng.random() < 0.45:  # a good request with plausible settings, so the engine's paths are fuzzed too
        body = {"messages": [{"role": "user", "content": rng.choice(["hello", [{"type": "text", "text": "hi"}]])}],
                "max_tokens": rng.choice([1, 2, 4]), "temperature": rng.choice([0, 0.7, 2]),
                "top_p": rng.choice([0.1, 1]), "stop": rng.choice([None, "a", ["x", "yz"]]),
                "stream": rng.choice([True, False]), "seed": rng.choice([None, 0, -(2**63), 2**64 - 1])}
        if rng.random() < 0.3:
            body[rng.choice(FIELDS)] = _value(rng)
    else:
        if rng.random() < 0.9:
            body["messages"] = rng.choice([[_message(rng) for _ in range(rng.choice([1, 2, 3, 10]))], _value(rng)])
        for name in rng.sample(FIELDS, rng.choice([0, 1, 2, 4])):
            body[name] = _value(rng)
    text = re.sub(r'"@big(\d+)@"', lambda m: "9" * int(m.group(1)), json.dumps(body, allow_nan=True))
    return text.encode("utf-8", "surrogatepass") if rng.random() < 0.5 else text.encode("ascii")


def fuzz_headers(rng: random.Random) -> dict:
    headers = {}
    if rng.random() < 0.3:
        headers[SESSION] = rng.choice(["NEW_SESSION", "nope", "0123456789abcdef0123456789abcdef", " ", "\u00e9"])
    if rng.random() < 0.1:
        headers["X-Resident-Request-Id"] = rng.choice(["ok-1", "bad id", "", "-x", "a" * 65])
    if rng.random() < 0.1:
        headers["X-Amzn-SageMaker-Adapter-Identifier"] = rng.choice(["nobody", "", "../x"])
    if rng.random() < 0.05:
        headers["X-Resident-Admin-Token"] = rng.choice(["", "x", "\u00fc", TOKEN])
    return headers


def test_two_thousand_fuzzed_bodies_get_no_5xx(service):
    rng = random.Random(28)
    statuses: dict[int, int] = {}

    async def go():
        for i in range(2000):
            body, headers = fuzz_body(rng), fuzz_headers(rng)
            response = await service.invoke({"Content-Type": "application/json", **headers}, body)
            if response.chunks is not None:
                text = "".join([chunk async for chunk in response.chunks])
                assert '"internal_error"' not in text, (i, body[:300], text[-300:])
            assert response.status < 500, (i, body[:300], headers, response.body)
            if response.status >= 400:
                error = response.body["error"]
                assert isinstance(error["type"], str) and isinstance(error["message"], str)
            statuses[response.status] = statuses.get(response.status, 0) + 1
    asyncio.run(go())
    assert sum(statuses.values()) == 2000
    assert statuses.get(400, 0) > 1000 and statuses.get(200, 0) > 200, statuses  # both paths were exercised


def test_session_ids_are_never_logged_in_full(tiny_model_path, caplog):
    """An id is a bearer credential: the lines that name a session (here: its expiry, a refused
    follow-up, the close) show its first 8 characters only."""
    import time

    caplog.set_level("INFO", logger="session")
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_new_tokens=4, default_max_tokens=2,
                                 session_ttl_s=0.5, reaper_interval_s=0.05)).start()
    try:
        service = ChatService(engine, "llava")
        ids = []
        for _ in range(2):
            status, _, headers = call(service, chat("hello"), {SESSION: "NEW_SESSION"})
            assert status == 200
            ids.append(headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0])
        assert call(service, b'{"requestType": "CLOSE"}', {SESSION: ids[1]})[0] == 200
        time.sleep(1.0)  # ids[0] expires: the reaper logs it at INFO
        assert call(service, chat("after"), {SESSION: ids[0]})[0] == 404
    finally:
        engine.stop()
    expired = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert expired == [f"session {ids[0][:8]}... expired"]
    assert not any(sid in caplog.text for sid in ids)
