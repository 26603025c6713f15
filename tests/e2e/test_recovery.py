"""Crash recovery through a real TorchServe: kill -9 the worker mid-conversation; the watchdog
restarts the instance, the journal brings the session back, and its next answer is unchanged."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from launch.torchserve import start_torchserve
from launch.watchdog import Watchdog
from tests.conftest import free_port, image_url
from tests.e2e.test_torchserve import metric_values

pytestmark = pytest.mark.e2e

SESSION = "X-Amzn-SageMaker-Session-Id"
QUESTIONS = ["What is in this image?", "What colour is it?", "Where could it be?"]


def ask(server, session, text, image_seed=None):
    content = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url(image_seed)}})
    response = requests.post(f"{server.url}/predictions/llava", headers={SESSION: session}, timeout=60,
                             json={"messages": [{"role": "user", "content": content}], "max_tokens": 12})
    assert response.status_code == 200, response.text
    new_id = response.headers.get("X-Amzn-SageMaker-New-Session-Id")
    return (new_id.split(";")[0] if new_id else session), response.json()


def test_kill_9_mid_conversation_loses_nothing(tiny_model_path, tmp_path):
    port = free_port(5)
    server = start_torchserve(port, run_dir=tmp_path / "run", stdout=open(tmp_path / "ts.log", "w"),
                              extra_env={"RESIDENT_JOURNAL_DIR": str(tmp_path / "journal")})
    watchdog = None
    try:
        server.wait_ready(240)
        reference, answers = "NEW_SESSION", []
        for step, question in enumerate(QUESTIONS):
            reference, body = ask(server, reference, question, image_seed=5 if step == 0 else None)
            answers.append(body["choices"][0]["message"]["content"])

        session, _ = ask(server, "NEW_SESSION", QUESTIONS[0], image_seed=5)
        ask(server, session, QUESTIONS[1])
        assert len(list((tmp_path / "journal" / "sessions").glob("*.json"))) == 2

        watchdog = Watchdog(server, interval_s=1.0, failures_to_restart=2, stall_s=5).start()
        [worker] = server.worker_pids()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while server.num_restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.num_restarts == 1
        server.wait_ready(240)
        assert server.worker_pids() != [worker]

        _, body = ask(server, session, QUESTIONS[2])
        assert body["choices"][0]["message"]["content"] == answers[2]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed from the journal
        # The worker's metric lines reach TorchServe's endpoint through its log reader: poll briefly.
        deadline = time.monotonic() + 15
        while True:
            events = metric_values(server, "SessionEvents")
            restored = [v for k, v in events.items() if 'Event="restored_from_journal"' in k]
            recomputed = [v for k, v in events.items() if 'Event="recomputed"' in k]
            if (restored, recomputed) == ([2.0], [1.0]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert restored == [2.0] and recomputed == [1.0]
        live = metric_values(server, "LiveSessions")
        assert list(live.values()) == [2.0]
        # latency in seconds, as the histogram's default buckets (5 ms to 10 s) count it: these short turns
        # land below 10 s (in milliseconds every turn fell past the last bucket); admin calls take ~1 ms
        buckets = metric_values(server, "RequestLatencySeconds_bucket")
        turns = {k: v for k, v in buckets.items() if 'Kind="admin"' not in k}
        within_10_s = sum(v for k, v in turns.items() if 'le="10.0"' in k)
        assert 1 <= within_10_s <= sum(v for k, v in turns.items() if 'le="+Inf"' in k)
    finally:
        if watchdog is not None:
            watchdog.stop()
        server.stop()
