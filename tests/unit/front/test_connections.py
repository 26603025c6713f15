"""session/front/connections.py through a real front: slow heads are closed, connections past the cap
are refused, a slow body is 408, and one client's requests in flight are capped (429)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from session.front.config import FrontConfig
from session.front.connections import REFUSAL, ClientLimiter
from session.front.server import Front
from session.serving.protocol import ADMIN_TOKEN_HEADER
from tests.fake_backend import TOKEN, SessionBackend

pytestmark = pytest.mark.asyncio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
HOLD = {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 3}


@contextlib.asynccontextmanager
async def front_over_one_backend(**settings):
    backend = await SessionBackend(0).start()
    config = FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, admin_token=TOKEN,
                                  **settings)
    front = Front(config)
    await front.start("127.0.0.1", 0)
    await front.check_health()
    try:
        yield front, backend
    finally:
        backend.release.set()
        await front.stop()
        await backend.stop()


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """What the server sent before it closed the connection (fails if it stays open past ``timeout_s``)."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP answer with a Content-Length: (status line, body)."""
    status, length = await reader.readline(), 0
    while (line := await reader.readline()) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return status, await reader.readexactly(length)


async def test_a_head_sent_a_byte_at_a_time_is_cut_off_while_a_prompt_one_is_served():
    async with front_over_one_backend(header_timeout_s=0.5) as (front, _):
        loop = asyncio.get_running_loop()
        began = loop.time()  # before the first accept: each deadline starts at its connection's accept
        slow = [await asyncio.open_connection("127.0.0.1", front.port) for _ in range(20)]

        async def trickle(writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                for byte in b"POST /invocations HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.05)

        trickles = [asyncio.ensure_future(trickle(w)) for _, w in slow]
        async with aiohttp.ClientSession() as client:  # an ordinary client is served meanwhile
            async with client.post(f"http://127.0.0.1:{front.port}/invocations", json=CHAT) as answer:
                assert answer.status == 200
        received = await asyncio.gather(*(closed_within(r, 3.0) for r, _ in slow))
        took = loop.time() - began
        for task in trickles:
            task.cancel()
        assert received == [b""] * 20  # closed without an answer: the head never ended
        assert 0.5 <= took < 2.5
        assert front.guard.num_timed_out == 20 and front.guard.num_open == 0


async def test_a_kept_alive_connection_gets_a_fresh_deadline_for_each_head():
    async with front_over_one_backend(header_timeout_s=0.5) as (front, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        body = json.dumps(CHAT).encode()
        request = (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        for _ in range(3):  # 1.2 s in all on one connection: more than one deadline, each head inside its own
            writer.write(request)
            status, answer = await asyncio.wait_for(read_answer(reader), 2)
            assert status.startswith(b"HTTP/1.1 200")
            assert json.loads(answer)["choices"][0]["message"]["content"] == "backend 0"
            await asyncio.sleep(0.4)
        assert front.guard.num_timed_out == 0 and front.guard.num_open == 1
        writer.close()


async def test_connections_past_the_cap_are_refused_with_a_503():
    async with front_over_one_backend(max_connections=3) as (front, _):
        idle = [await asyncio.open_connection("127.0.0.1", front.port) for _ in range(3)]
        await asyncio.sleep(0.05)
        reader, _ = await asyncio.open_connection("127.0.0.1", front.port)
        refused = await closed_within(reader, 2.0)
        assert refused == REFUSAL and refused.startswith(b"HTTP/1.1 503 ")
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "capacity_exceeded"
        assert front.guard.num_refused == 1 and front.guard.num_open == 3
        for _, writer in idle:
            writer.close()
        await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as client:  # room again once they are closed
            async with client.post(f"http://127.0.0.1:{front.port}/invocations", json=CHAT) as answer:
                assert answer.status == 200


async def test_a_body_slower_than_its_deadline_is_408():
    async with front_over_one_backend(body_timeout_s=0.4) as (front, backend):
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"messages\"")
        status, body = await asyncio.wait_for(read_answer(reader), 3)
        assert status.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"]["type"] == "request_timeout"
        assert backend.requests == []
        writer.close()


async def test_one_clients_requests_in_flight_are_capped_with_a_429():
    async with front_over_one_backend(max_requests_per_client=2) as (front, backend):
        url = f"http://127.0.0.1:{front.port}"
        async with aiohttp.ClientSession() as client:
            held = [asyncio.ensure_future(client.post(f"{url}/invocations", json=HOLD)) for _ in range(2)]
            while len(backend.requests) < 2:
                await asyncio.sleep(0.01)
            third = await client.post(f"{url}/invocations", json=CHAT)
            assert third.status == 429 and third.headers["Retry-After"] == "1"
            assert (await third.json())["error"]["type"] == "too_many_requests"
            ping = await client.get(f"{url}/ping")  # health checks are never counted
            assert ping.status == 200
            backend.release.set()
            assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
            after = await client.post(f"{url}/invocations", json=CHAT)
            assert after.status == 200
            described = await (await client.get(f"{url}/backends", headers={ADMIN_TOKEN_HEADER: TOKEN})).json()
            assert described["num_client_limit_refusals"] == 1
            assert front.limiter.in_flight == {}


async def test_a_request_with_too_many_headers_is_400_and_reaches_no_backend():
    async with front_over_one_backend() as (front, backend):
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n")
        status, _ = await asyncio.wait_for(read_answer(reader), 3)
        assert status.split()[1] == b"400"
        assert backend.requests == []
        writer.close()
        async with aiohttp.ClientSession() as client:  # 100 headers are fine
            async with client.get(f"http://127.0.0.1:{front.port}/ping",
                                  headers={f"X-{i}": "y" for i in range(100)}) as answer:
                assert answer.status == 200


async def test_the_limiter_counts_each_client_alone():
    limiter = ClientLimiter(1)
    with limiter.admit("10.0.0.1"):
        with limiter.admit("10.0.0.2"):
            assert limiter.in_flight == {"10.0.0.1": 1, "10.0.0.2": 1}
        with pytest.raises(Exception) as refused:
            with limiter.admit("10.0.0.1"):
                pass
        assert refused.value.status == 429
    assert limiter.in_flight == {} and limiter.num_refused == 1
    with ClientLimiter(0).admit("10.0.0.1"):  # 0: no limit
        pass
