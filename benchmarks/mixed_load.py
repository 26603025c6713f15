"""Mixed load (``python -m benchmarks.load --mixed``): many clients for a fixed time, every kind of request.

Each of ``--clients`` clients loops until ``--duration`` is over: a stateless question or a turn of
its own session (opened with an image, closed now and then), ``max_tokens`` drawn from 1..128, half
of them streamed. 10% of the streamed ones disconnect after the first chunk and cancel their request
as the front does (TorchServe itself does not tell a worker that a client left); some sessions are
closed by a second connection while a turn is in flight. The server runs with invariant checks on.

Reported: completed, failed (by status), cancelled, lost (no answer within --timeout: must be 0),
p50/p99 latency of completed requests, and the server's own counts (invariant violations: must be 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter

import aiohttp

from benchmarks.common import image_data_url, percentile

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"


class Tally:
    def __init__(self):
        self.outcomes: Counter = Counter()  # completed | cancelled | lost | failed-<status>
        self.latencies: list[float] = []


async def one_request(http, url, body, headers, tally: Tally, rng: random.Random, timeout_s: float,
                      disconnect: bool) -> aiohttp.ClientResponse | None:
    request_id = uuid.uuid4().hex
    headers = {**headers, "X-Resident-Request-Id": request_id, "Content-Type": "application/json"}
    began = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(url, data=json.dumps(body), headers=headers) as response:
                if response.status != 200:
                    error = json.loads(await response.read() or b"{}").get("error", {}).get("type", "?")
                    cancelled = error == "request_cancelled"  # its session was closed under it
                    tally.outcomes["cancelled (closed)" if cancelled else f"failed-{response.status} {error}"] += 1
                    return response
                if disconnect:
                    await response.content.readline()
                    response.close()  # the client goes away mid-answer
                    async with http.post(url, data=b"{}", headers={"X-Resident-Cancel": request_id}) as cancel:
                        await cancel.read()
                    tally.outcomes["cancelled (disconnected)"] += 1
                    return None
                payload = await response.read()
                if body.get("stream") and b"[DONE]" not in payload:
                    cancelled = b"request_cancelled" in payload
                    tally.outcomes["cancelled (closed)" if cancelled else "failed-stream"] += 1
                    return response
                tally.outcomes["completed"] += 1
                tally.latencies.append(time.perf_counter() - began)
                return response
    except TimeoutError:
        tally.outcomes["lost"] += 1
    except aiohttp.ClientError:
        tally.outcomes["failed-connection"] += 1
    return None


async def client(index: int, http, url: str, deadline: float, tally: Tally, timeout_s: float) -> None:
    rng = random.Random(index)
    session_id = None
    while time.monotonic() < deadline:
        stream = rng.random() < 0.5
        body = {"messages": [{"role": "user", "content": f"client {index} asks {rng.randrange(10**6)}"}],
                "max_tokens": rng.randint(1, 128), "stream": stream}
        headers = {}
        if rng.random() < 0.6:  # a session turn
            if session_id is None:
                headers[SESSION] = "NEW_SESSION"
                body["stream"] = stream = False  # the open is never streamed (SageMaker's rule)
                body["messages"][0]["content"] = [
                    {"type": "image_url", "image_url": {"url": image_data_url(index, size=48)}},
                    {"type": "text", "text": "What is this?"}]
            else:
                headers[SESSION] = session_id
        disconnect = stream and rng.random() < 0.1
        closer = None
        if session_id is not None and rng.random() < 0.05:  # close it while this turn runs
            closer = asyncio.create_task(_close_later(http, url, session_id, rng.uniform(0.0, 0.3)))
        response = await one_request(http, url, body, headers, tally, rng, timeout_s, disconnect)
        if closer is not None:
            await closer
            session_id = None
        elif response is not None and response.status == 200 and headers.get(SESSION) == "NEW_SESSION":
            session_id = response.headers[NEW_SESSION_ID].split(";")[0]
        elif response is not None and response.status in (400, 404):
            session_id = None  # full (context_length_exceeded), expired or closed: open another
        if session_id is not None and rng.random() < 0.05:
            await _close_later(http, url, session_id, 0.0)
            session_id = None


async def _close_later(http, url: str, session_id: str, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    async with http.post(url, data=json.dumps({"requestType": "CLOSE"}),
                         headers={SESSION: session_id, "Content-Type": "application/json"}) as response:
        await response.read()


async def run_mixed(url: str, clients: int, duration_s: float, timeout_s: float) -> dict:
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=clients * 2)
    async with aiohttp.ClientSession(connector=connector) as http:
        deadline = time.monotonic() + duration_s
        began = time.perf_counter()
        await asyncio.gather(*(client(i, http, url, deadline, tally, timeout_s) for i in range(clients)))
        wall = time.perf_counter() - began
    return {"outcomes": dict(tally.outcomes), "wall_s": wall,
            "p50_s": percentile(tally.latencies, 50), "p99_s": percentile(tally.latencies, 99)}
