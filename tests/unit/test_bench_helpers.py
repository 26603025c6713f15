"""Small benchmark helpers whose mistakes would skew or hang a run: the burst's wait for its streams,
and the load client's count of failures."""

import threading
import time

import pytest

from benchmarks.burst import still_starting
from benchmarks.load import failures


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
