"""Small benchmark helpers whose mistakes would skew or hang a run: the burst's wait for its streams,
and the load client's count of failures."""

import asyncio
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from benchmarks import load
from benchmarks.burst import still_starting
from benchmarks.load import failures
from tests.fake_backend import FakeServer


def stream(pieces: int, ended: bool = False) -> dict:
    done = threading.Event()
    if ended:
        done.set()
    return {"id": f"s{pieces}", "times": [0.0] * pieces, "done": done}


def test_the_burst_waits_until_every_stream_has_streamed_four_pieces():
    now = time.perf_counter()
    assert still_starting([stream(4), stream(3)], since=now)
    assert not still_starting([stream(4), stream(9, ended=True)], since=now)


def test_a_stream_that_ended_early_or_never_started_stops_the_wait():
    with pytest.raises(RuntimeError, match=r"\['s2'\] ended before streaming 4 pieces"):
        still_starting([stream(5), stream(2, ended=True)], since=time.perf_counter())
    with pytest.raises(TimeoutError, match="1 stream"):
        still_starting([stream(0)], since=time.perf_counter() - 601)


def test_a_503_given_up_on_is_a_failure_and_one_backed_off_from_is_not():
    errors = [{"status": 503, "turn": 0}, {"status": 503, "turn": 1, "gave_up": True}, {"status": 500, "turn": 2}]
    assert [e["turn"] for e in failures(errors)] == [1, 2]


class Overloaded(FakeServer):
    """Answers every request 503 with ``Retry-After: 0``, counting them."""

    posts = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.posts += 1
        return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "0"})


def test_a_session_refused_every_time_counts_each_back_off_once_and_the_give_up_once(monkeypatch):
    """Against a real aiohttp server that answers every turn 503: MAX_RETRIES back-offs, then one give-up
    (the last 503 was once counted as both)."""
    monkeypatch.setattr(load, "MAX_RETRIES", 3)
    server = Overloaded()

    async def run() -> list[dict]:
        await server.start()
        errors: list[dict] = []
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                await load.converse(http, f"{server.url}/invocations", 0, 2, 4, [], errors)
        finally:
            await server.stop()
        return errors

    errors = asyncio.run(run())
    assert server.posts == 4
    assert [e.get("gave_up", False) for e in errors] == [False, False, False, True]
    assert [e["turn"] for e in failures(errors)] == [0]
