"""End to end through a real TorchServe: cancellation rolls a turn back, CLOSE stops the request in
flight, a saturated instance is never restarted by its watchdog and /ping stays fast, a body nested
100,000 levels deep is a 400, and the journal is private and gone after a clean stop."""

from __future__ import annotations

import json
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from launch.watchdog import Watchdog
from tests.e2e.test_torchserve import NEW_SESSION_ID, SESSION, chat, start

pytestmark = pytest.mark.e2e

REQUEST_ID = "X-Resident-Request-Id"
CANCEL = "X-Resident-Cancel"
TOKEN = "X-Resident-Admin-Token"
ADMIN_TOKEN = "life-admin-token"


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    ts = start(tmp_path_factory, "life", RESIDENT_MAX_NEW_TOKENS=2000, RESIDENT_CHECK_INVARIANTS="true",
               RESIDENT_ADMIN_TOKEN=ADMIN_TOKEN)
    yield ts
    ts.stop()


def invoke(server, body, session=None, headers=None, stream=False, timeout=120):
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if session:
        hdrs[SESSION] = session
    return requests.post(f"{server.url}/invocations", data=json.dumps(body), headers=hdrs, stream=stream,
                         timeout=timeout)


def open_session(server, question="What is this?"):
    answer = invoke(server, chat(question, image_seed=7), session="NEW_SESSION")
    assert answer.status_code == 200, answer.text
    return answer.headers[NEW_SESSION_ID].split(";")[0], answer.json()


def running_stream(server, session, request_id, max_tokens=600):
    """A streamed follow-up that is surely generating: its first text chunk has arrived."""
    response = invoke(server, chat("Tell me everything, at length.", max_tokens=max_tokens, stream=True),
                      session=session, headers={REQUEST_ID: request_id}, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith(b"data: ") and b'"content": ""' not in line:
            return response, lines
    raise AssertionError("the stream ended before any text")


def cancel(server, request_id, token=ADMIN_TOKEN):
    headers = {CANCEL: request_id} if token is None else {CANCEL: request_id, TOKEN: token}
    return requests.post(f"{server.url}/invocations", data="{}", headers=headers, timeout=30)


def test_cancel_rolls_the_turn_back_and_a_retry_answers_the_same(server):
    cancelled_session, _ = open_session(server)
    reference_session, _ = open_session(server)
    follow_up = chat("And the colours?", max_tokens=12)
    response, lines = running_stream(server, cancelled_session, "cancel-me-1")
    # Without the admin token (or with a wrong one) a cancel is refused: a request id is no secret.
    for token in (None, "wrong", "n\u00e4me"):
        refused = cancel(server, "cancel-me-1", token=token)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "forbidden", refused.text
    answer = cancel(server, "cancel-me-1")
    assert answer.status_code == 200 and answer.json() == {"cancelled": True}
    rest = b"\n".join(lines)
    assert b"request_cancelled" in rest and b"[DONE]" not in rest
    # The session is as before the cancelled turn: the same follow-up answers as on the reference.
    retried = invoke(server, follow_up, session=cancelled_session)
    expected = invoke(server, follow_up, session=reference_session)
    assert retried.status_code == expected.status_code == 200
    assert retried.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
    got, want = retried.json()["usage"], expected.json()["usage"]
    assert (got["prompt_tokens"], got["completion_tokens"]) == (want["prompt_tokens"], want["completion_tokens"])
    # The rolled-back turn had already fed the previous answer's last token: one more is cached.
    assert got["prompt_tokens_details"]["cached_tokens"] == want["prompt_tokens_details"]["cached_tokens"] + 1
    # Cancelling what is no longer running is a no-op, and a malformed id a 400.
    again = cancel(server, "cancel-me-1")
    assert again.json() == {"cancelled": False}
    bad = cancel(server, "no spaces!")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_close_stops_the_request_in_flight(server):
    session, _ = open_session(server)
    response, lines = running_stream(server, session, "closed-under-me")
    closed = invoke(server, {"requestType": "CLOSE"}, session=session)
    assert closed.status_code == 200 and closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session
    rest = b"\n".join(lines)
    assert b"request_cancelled" in rest and b"was closed while this request ran" in rest and b"[DONE]" not in rest
    gone = invoke(server, chat("Still there?"), session=session)
    assert gone.status_code == 404 and "was closed" in gone.json()["error"]["message"]


def test_deeply_nested_json_is_a_400(server):
    body = "[" * 100_000 + "]" * 100_000
    answer = requests.post(f"{server.url}/invocations", data=body, headers={"Content-Type": "application/json"},
                           timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"] == {"type": "invalid_request_error",
                                      "message": "request body is not valid JSON: nested too deeply",
                                      "code": "invalid_request_error"}
    assert invoke(server, chat("hello")).status_code == 200


def test_journal_is_private(server):
    session, _ = open_session(server)
    journal = Path(server.journal_dir)
    entry = journal / "sessions" / f"{session}.json"
    assert entry.exists()
    for path in (journal, journal / "sessions", journal / "images"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [entry, *(journal / "images").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_saturated_instance_is_never_restarted(tiny_model_path, tmp_path_factory):
    server = start(tmp_path_factory, "busy", RESIDENT_MAX_NEW_TOKENS=2000, RESIDENT_MAX_BATCH_SIZE=2)
    # stall_s: a loaded 2-core CI machine has stalled the loop for over 1.5 s once (a KV pool growth
    # while the test's 40 client threads, TorchServe and pytest share the cores), which is no hang.
    watchdog = Watchdog(server, interval_s=0.5, failures_to_restart=2, stall_s=3.0).start()
    journal = Path(server.journal_dir)
    try:
        ping_ms, stop = [], threading.Event()

        def ping():
            while not stop.is_set():
                began = time.perf_counter()
                assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200
                ping_ms.append((time.perf_counter() - began) * 1000)
                time.sleep(0.1)

        pinger = threading.Thread(target=ping)
        pinger.start()
        began = time.monotonic()
        with ThreadPoolExecutor(40) as pool:  # 40 long answers, 2 decode at a time: a deep queue
            answers = list(pool.map(lambda i: invoke(server, chat(f"story {i}", max_tokens=900), timeout=300),
                                    range(40)))
        busy_s = time.monotonic() - began
        stop.set()
        pinger.join()
        # Saturated for longer than the watchdog's whole failure window, twice over.
        assert busy_s > 2 * (watchdog.stall_s + watchdog.failures_to_restart * watchdog.interval_s), busy_s
        assert [a.status_code for a in answers] == [200] * 40
        assert server.num_restarts == 0 and watchdog.num_failures == 0
        ping_ms.sort()
        print(f"saturated {busy_s:.1f} s: {len(ping_ms)} pings, p50 {ping_ms[len(ping_ms) // 2]:.1f} ms, "
              f"p99 {ping_ms[int(len(ping_ms) * 0.99)]:.1f} ms, max {ping_ms[-1]:.1f} ms; restarts 0")
        assert ping_ms[len(ping_ms) // 2] < 100, ping_ms  # the median /ping under full load
    finally:
        watchdog.stop()
        server.stop()
    assert not journal.exists()  # a clean stop removes the instance's journal


def test_a_stuck_worker_is_restarted(tiny_model_path, tmp_path_factory):
    """A worker whose loop stops turning (SIGSTOP: still READY to TorchServe) is told from a busy one by
    its heartbeat, and restarted; its sessions come back from the journal."""
    import os
    import signal

    server = start(tmp_path_factory, "stuck")
    watchdog = Watchdog(server, interval_s=0.5, failures_to_restart=2, stall_s=2.0).start()
    try:
        session, first = open_session(server)
        [pid] = server.worker_pids()
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while server.num_restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.num_restarts == 1
        server.wait_ready(240)
        assert server.worker_pids() != [pid]
        again = invoke(server, chat("And now?"), session=session)
        assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        watchdog.stop()
        server.stop()


def test_a_bad_request_id_is_a_400_and_a_reused_live_one_is_replaced(server):
    bad = invoke(server, chat("hi"), headers={REQUEST_ID: "spaces are not allowed"})
    assert bad.status_code == 400
    assert bad.json()["error"] == {"type": "invalid_request_error",
                                   "message": "X-Resident-Request-Id must match [A-Za-z0-9][A-Za-z0-9-]{0,63}",
                                   "code": "invalid_request_error"}
    session, _ = open_session(server)
    response, lines = running_stream(server, session, "twice-1")
    # Reusing a live id neither fails nor tells the caller it is live: the second request runs under
    # an id of the server's, and a cancel of the id stops only the first.
    again = invoke(server, chat("hi", max_tokens=2), headers={REQUEST_ID: "twice-1"})
    assert again.status_code == 200, again.text
    assert again.headers[REQUEST_ID] != "twice-1" and len(again.headers[REQUEST_ID]) == 32
    cancelled = cancel(server, "twice-1")
    assert cancelled.json() == {"cancelled": True}
    response.close()
