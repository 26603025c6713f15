"""End to end, as a new user would: ``python -m launch cluster`` (``make cluster``) with two backends,
sessions opened through its front, then a second front started over the same backends
(``python -m launch front`` with RESIDENT_FRONT_BACKENDS): every session continues through it.
Then a rolling restart through the cluster's front (``POST /backends/{i}/restart`` for each
backend): every session continues, answers unchanged, through both fronts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from launch.torchserve import REPO
from session.front.answers import BACKEND_HEADER
from session.serving.protocol import ADMIN_TOKEN_HEADER, NEW_SESSION_HEADER, SESSION_HEADER
from tests.conftest import free_port, image_url

pytestmark = pytest.mark.e2e
TIMEOUT = 120
QUESTIONS = ["What colour is it?", "Is it large?"]


def launch(command: str, env: dict[str, str], log_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launch", command], cwd=REPO, env={**os.environ, **env},
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(process: subprocess.Popen, url: str, log_path, num: int = 2, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, open(log_path).read()[-3000:]
        assert time.monotonic() < deadline, "not ready: " + open(log_path).read()[-3000:]
        try:
            ping = requests.get(url + "/ping", timeout=2)
            if ping.status_code == 200 and ping.json()["healthy_backends"] == num:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.3)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM by PID; whatever is left of its process group (the backends) is killed after."""
    if process.poll() is None:
        children = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        for child in psutil.wait_procs(children, timeout=5)[1]:
            child.kill()


def chat(text, image_seed=None):
    content = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url(image_seed)}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8}


def post(url, body, session):
    return requests.post(url + "/invocations", json=body, headers={SESSION_HEADER: session}, timeout=TIMEOUT)


def turn(url, session_id, question):
    response = post(url, chat(question), session_id)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"], response.headers[BACKEND_HEADER]


def test_a_second_front_and_a_rolling_restart_lose_no_session(tiny_model_path, tmp_path):
    port = free_port()
    base = free_port(20)
    cluster_url = f"http://127.0.0.1:{port}"
    cluster = launch("cluster", {"PORT": str(port), "BACKENDS": "2", "RESIDENT_BACKEND_PORT": str(base),
                                 "RESIDENT_THREADS": "1", "RESIDENT_FRONT_HEALTH_INTERVAL_S": "0.5",
                                 "RESIDENT_JOURNAL_DIR": str(tmp_path / "journal")}, tmp_path / "cluster.log")
    second = None
    try:
        wait_healthy(cluster, cluster_url, tmp_path / "cluster.log")
        sessions, expected = [], {}
        for i in range(6):
            opened = post(cluster_url, chat("What is in this image?", image_seed=80 + i), "NEW_SESSION")
            assert opened.status_code == 200, opened.text
            sessions.append((opened.headers[NEW_SESSION_HEADER].split(";")[0], opened.headers[BACKEND_HEADER]))
        assert sorted(b for _, b in sessions) == ["0", "0", "0", "1", "1", "1"]
        token = (REPO / "build" / f"cluster-{port}" / "admin-token").read_text().strip()
        backend_urls = [b["url"] for b in requests.get(cluster_url + "/backends", headers={ADMIN_TOKEN_HEADER: token},
                                                       timeout=10).json()["backends"]]

        second_port = free_port()
        second_url = f"http://127.0.0.1:{second_port}"
        second = launch("front", {"PORT": str(second_port), "RESIDENT_FRONT_BACKENDS": ",".join(backend_urls),
                                  "RESIDENT_ADMIN_TOKEN": token, "RESIDENT_FRONT_HEALTH_INTERVAL_S": "0.5"},
                        tmp_path / "front.log")
        wait_healthy(second, second_url, tmp_path / "front.log")
        for session_id, backend in sessions:  # the case: 0 of 6 continued before
            answer, prompt_tokens, answered_by = turn(second_url, session_id, QUESTIONS[0])
            assert answered_by == backend
            expected[session_id] = [(answer, prompt_tokens)]

        admin = {ADMIN_TOKEN_HEADER: token}
        for index in (0, 1):  # a rolling restart: each backend drained, restarted, resumed in turn
            restarted = requests.post(f"{cluster_url}/backends/{index}/restart", headers=admin, timeout=600)
            report = restarted.json()
            assert restarted.status_code == 200, report
            assert (report["healthy"], report["drain"]["failed"], report["drain"]["remaining"]) == (True, {}, 0)
            print(f"\nbackend {index}: moved {report['drain']['moved']} in {report['drain']['seconds']} s "
                  f"({report['drain']['per_session_ms']} ms per session), restarted in {report['restart_s']} s")
        for i, (session_id, _) in enumerate(sessions):
            url = (cluster_url, second_url)[i % 2]
            answer, prompt_tokens, _ = turn(url, session_id, QUESTIONS[1])
            expected[session_id].append((answer, prompt_tokens))
        # The same turns in sessions nothing happened to, on the same images: the same answers.
        for i, (session_id, _) in enumerate(sessions):
            twin = post(cluster_url, chat("What is in this image?", image_seed=80 + i), "NEW_SESSION")
            twin_id = twin.headers[NEW_SESSION_HEADER].split(";")[0]
            assert [turn(cluster_url, twin_id, q)[:2] for q in QUESTIONS] == expected[session_id]
    finally:
        if second is not None:
            stop(second)
        stop(cluster)
