"""session/front/connections.py through a real front: slow heads are closed, connections past the cap
are refused, a slow body is 408, and one client's requests in flight are capped (429)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from session.front.config import FrontConfig
from session.front.connections import ADDRESS_REFUSAL, REFUSAL, ClientLimiter
from session.front.server import Front
from session.serving.protocol import ADMIN_TOKEN_HEADER, REQUEST_ID_HEADER
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


PING = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
HEAD_BEGUN = b"POST /invocations HTTP/1.1\r\nHost: x\r\n"  # a request under way: its head not yet ended


async def open_from(port: int, address: str = "127.0.0.1", send: bytes = b""):
    """A connection from ``address`` (any of 127.0.0.0/8 is this host) that sends ``send``; after a
    ping it waits for the answer, so the connection is idle and kept alive."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
    writer.write(send)
    if send == PING:
        status, _ = await asyncio.wait_for(read_answer(reader), 2)
        assert status.startswith(b"HTTP/1.1 200")
    return reader, writer


async def chat_from(port: int, address: str = "127.0.0.1") -> int:
    reader, writer = await open_from(port, address)
    body = json.dumps(CHAT).encode()
    writer.write(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, _ = await asyncio.wait_for(read_answer(reader), 3)
    writer.close()
    return int(status.split()[1])


async def test_idle_kept_alive_connections_at_the_cap_make_room_oldest_first():
    # The report: 1024 kept-alive connections, a /ping each, then idle, and everyone else got 503.
    async with front_over_one_backend(max_connections=4, max_connections_per_address=0) as (front, _):
        idle = [await open_from(front.port, send=PING) for _ in range(4)]
        assert front.guard.num_open == 4
        for num_closed in range(1, 3):  # each newcomer is served and stays; the longest idle connection is closed
            idle.append(await open_from(front.port, send=PING))
            assert await closed_within(idle[num_closed - 1][0], 2.0) == b""
            assert front.guard.num_evicted == num_closed and front.guard.num_open == 4
        assert await chat_from(front.port) == 200  # an inference request too
        assert await closed_within(idle[2][0], 2.0) == b""
        assert front.guard.num_refused == 0 and front.guard.num_evicted == 3
        reader, writer = idle[3]  # the newer idle ones are still open and served
        writer.write(PING)
        status, _ = await asyncio.wait_for(read_answer(reader), 2)
        assert status.startswith(b"HTTP/1.1 200")


async def test_connections_past_the_cap_are_refused_with_a_503_only_when_none_is_idle():
    async with front_over_one_backend(max_connections=3, max_connections_per_address=0) as (front, _):
        busy = [await open_from(front.port, send=HEAD_BEGUN) for _ in range(3)]
        await asyncio.sleep(0.05)
        reader, _ = await asyncio.open_connection("127.0.0.1", front.port)
        refused = await closed_within(reader, 2.0)
        assert refused == REFUSAL and refused.startswith(b"HTTP/1.1 503 ")
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "capacity_exceeded"
        assert front.guard.num_refused == 1 and front.guard.num_open == 3 and front.guard.num_evicted == 0
        for _, writer in busy:
            writer.close()
        await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as client:  # room again once they are closed
            async with client.post(f"http://127.0.0.1:{front.port}/invocations", json=CHAT) as answer:
                assert answer.status == 200


async def test_one_address_is_capped_and_closes_its_own_idle_connections_not_others():
    async with front_over_one_backend(max_connections=10, max_connections_per_address=3) as (front, _):
        other = await open_from(front.port, "127.0.0.3", send=PING)  # the longest idle, another address's
        busy = [await open_from(front.port, "127.0.0.2", send=HEAD_BEGUN) for _ in range(2)]
        idle = await open_from(front.port, "127.0.0.2", send=PING)
        assert front.guard.open_by_address == {"127.0.0.2": 3, "127.0.0.3": 1}
        assert await chat_from(front.port, "127.0.0.2") == 200  # its own idle connection made room
        assert await closed_within(idle[0], 2.0) == b""
        assert front.guard.num_evicted == 1
        busy.append(await open_from(front.port, "127.0.0.2", send=HEAD_BEGUN))
        await asyncio.sleep(0.05)
        reader, _ = await open_from(front.port, "127.0.0.2")  # three in a request: refused
        assert await closed_within(reader, 2.0) == ADDRESS_REFUSAL
        assert b"RESIDENT_FRONT_MAX_CONNECTIONS_PER_ADDRESS" in ADDRESS_REFUSAL
        assert await chat_from(front.port, "127.0.0.4") == 200  # other addresses are served
        writer = other[1]  # and the other address's idle connection was never touched
        writer.write(PING)
        status, _ = await asyncio.wait_for(read_answer(other[0]), 2)
        assert status.startswith(b"HTTP/1.1 200")
        assert front.guard.num_refused == 1 and front.guard.num_evicted == 1
        for _, w in busy:
            w.close()


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


class FloodBackend(SessionBackend):
    """Answers "flood" with an SSE stream of ``max_tokens`` chunks of 64 KiB, written as fast as the front
    reads them; other requests as SessionBackend does."""

    CHUNK = b"data: " + b"x" * 65536 + b"\n\n"

    async def _chat(self, request: web.Request, body: dict) -> web.StreamResponse:
        if body["messages"][-1]["content"] != "flood":
            return await super()._chat(request, body)
        self.requests.append({"path": request.path, "request_id": request.headers[REQUEST_ID_HEADER], "body": body})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(body["max_tokens"]):
                await response.write(self.CHUNK)
            await response.write_eof()
        return response


def flood_request(num_chunks: int) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "flood"}], "max_tokens": num_chunks,
                       "stream": True}).encode()
    return (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def test_a_stream_its_client_does_not_read_is_cut_and_cancelled_on_its_backend():
    backend = await FloodBackend(0).start()
    config = FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, admin_token=TOKEN,
                                  write_timeout_s=0.5)
    front = Front(config)
    await front.start("127.0.0.1", 0)
    await front.check_health()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect(("127.0.0.1", front.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(flood_request(4096))  # 256 MiB, far more than every buffer between
        assert (await asyncio.wait_for(reader.readline(), 3)).startswith(b"HTTP/1.1 200")
        began = asyncio.get_running_loop().time()  # from here on the client reads nothing
        while not backend.cancels:
            assert asyncio.get_running_loop().time() - began < 10, "the stream was never cut"
            await asyncio.sleep(0.05)
        [request] = backend.requests
        assert backend.cancels == [request["request_id"]]
        assert front.guard.num_write_timeouts == 1 and front.guard.num_open == 0
        assert front.num_cancels_sent == 1
        writer.close()
    finally:
        await front.stop()
        await backend.stop()


async def test_a_long_stream_its_client_reads_is_never_cut():
    backend = await FloodBackend(0).start()
    config = FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, admin_token=TOKEN,
                                  write_timeout_s=0.5)
    front = Front(config)
    await front.start("127.0.0.1", 0)
    await front.check_health()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(flood_request(256))  # 16 MiB, read 64 KiB at a time with pauses: slower than it comes
        received, tail = 0, b""
        while not tail.endswith(b"\r\n0\r\n\r\n"):  # the chunked stream's end
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            assert chunk, "the front closed the stream"
            received, tail = received + len(chunk), (tail + chunk)[-16:]
            await asyncio.sleep(0.002)
        assert received > 256 * len(FloodBackend.CHUNK)  # every chunk, and the head
        assert front.guard.num_write_timeouts == 0 and backend.cancels == []
        writer.close()
    finally:
        await front.stop()
        await backend.stop()
