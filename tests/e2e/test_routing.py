"""End to end: routing that survives its own processes, with two real TorchServe backends on
127.0.0.1 (tagged b0, b1) and fronts as real processes (``python -m launch front``).

- kill -9 a front, start it again: every session continues on its backend with its cached KV, and
  a second front serves interleaved follow-ups of the same sessions;
- a client that leaves, or a front timeout, cancels the turn on the backend (rolled back);
- drain backend 0: its sessions move to backend 1 under the same ids, answers equal those of
  sessions never moved, both fronts follow them, and backend 0 then stops with no session lost;
- the generated nginx before the same backends finds the moved sessions, skips the stopped backend.
Runs in file order; the drain test stops backend 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import requests

from launch.nginx import render_main, site_from_config
from launch.torchserve import REPO, start_torchserve
from session.front.answers import BACKEND_HEADER
from session.front.config import FrontConfig
from session.serving.protocol import ADMIN_TOKEN_HEADER, NEW_SESSION_HEADER, REQUEST_ID_HEADER, SESSION_HEADER
from tests.conftest import free_port, image_url
from tests.e2e.test_front import FrontThread
from tests.e2e.test_nginx import running_nginx

pytestmark = pytest.mark.e2e

TOKEN = "e2e-admin-token"
MOVED: list[str] = []  # sessions the drain test moved off backend 0 (the nginx test follows them)
TIMEOUT = 120
QUESTIONS = ["What colour is it?", "Is it large?"]


class FrontProcess:
    """``python -m launch front`` on its own port; stopped (or killed) by PID."""

    def __init__(self, backends, port: int, log_path):
        self.port = port
        self.env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1",
                    "RESIDENT_FRONT_BACKENDS": ",".join(b.url for b in backends),
                    "RESIDENT_FRONT_MANAGEMENT_URLS": ",".join(b.management_url for b in backends),
                    "RESIDENT_FRONT_ADMIN_TOKEN": TOKEN, "RESIDENT_FRONT_HEALTH_INTERVAL_S": "0.5",
                    "RESIDENT_FRONT_TIMEOUT_S": str(TIMEOUT)}
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FrontProcess:
        log = open(self.log_path, "a")
        self.process = subprocess.Popen([sys.executable, "-m", "launch", "front"], cwd=REPO, env=self.env,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, open(self.log_path).read()[-3000:]
            with contextlib.suppress(requests.ConnectionError):
                ping = requests.get(self.url + "/ping", timeout=5)
                if ping.status_code == 200 and ping.json()["healthy_backends"] == ping.json()["backends"]:
                    return self
            assert time.monotonic() < deadline, "front not ready"
            time.sleep(0.2)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    """Two tagged backends and two fronts over them: (backends, [front A, front B])."""
    backends, fronts = [], []
    try:
        for i in range(2):
            run = tmp_path_factory.mktemp(f"routing-b{i}")
            backends.append(start_torchserve(free_port(5), run_dir=run, stdout=open(run / "ts.log", "w"), extra_env={
                "RESIDENT_THREADS": "1", "RESIDENT_ADMIN_TOKEN": TOKEN, "RESIDENT_SESSION_ID_TAG": f"b{i}",
                "RESIDENT_JOURNAL_DIR": str(run / "journal")}))
        for backend in backends:
            backend.wait_ready(timeout_s=240)
        logs = tmp_path_factory.mktemp("routing-fronts")
        fronts = [FrontProcess(backends, free_port(), logs / f"front-{name}.log").start() for name in "AB"]
        yield backends, fronts
    finally:
        for front in fronts:
            front.stop()
        for backend in backends:
            backend.stop()


def chat(text, image_seed=None, max_tokens=8, **extra):
    content = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url(image_seed)}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def post(url, body, session=None, **headers):
    if session:
        headers[SESSION_HEADER] = session
    response = requests.post(url + "/invocations", json=body, headers=headers, timeout=TIMEOUT)
    return response


def open_session(url, seed):
    response = post(url, chat("What is in this image?", image_seed=seed), session="NEW_SESSION")
    assert response.status_code == 200, response.text
    return response.headers[NEW_SESSION_HEADER].split(";")[0], response


def turn(url, session_id, question):
    """(answer, cached prompt tokens, backend index, prompt tokens) of one follow-up."""
    response = post(url, chat(question), session=session_id)
    assert response.status_code == 200, response.text
    body = response.json()
    return (body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"],
            response.headers[BACKEND_HEADER], body["usage"]["prompt_tokens"])


def reference(url, seed):
    """The follow-ups' (answer, cached tokens, prompt tokens) in a session nothing happens to; closed after."""
    session_id, _ = open_session(url, seed)
    answers = [(a, cached, prompt) for a, cached, _, prompt in (turn(url, session_id, q) for q in QUESTIONS)]
    post(url, {"requestType": "CLOSE"}, session=session_id)
    return answers


def test_sessions_survive_a_killed_front_and_two_fronts_serve_them(cluster):
    backends, (front_a, front_b) = cluster
    seeds = [60, 61, 62]
    expected = {seed: reference(front_a.url, seed) for seed in seeds}
    sessions = []
    for i in range(6):
        session_id, opened = open_session(front_a.url, seeds[i % 3])
        sessions.append((session_id, seeds[i % 3], opened.headers[BACKEND_HEADER]))
    assert sorted(b for _, _, b in sessions) == ["0", "0", "0", "1", "1", "1"]
    assert all(sid.endswith(f"-b{b}") for sid, _, b in sessions)

    front_a.kill()  # kill -9: its memory, pins included, is gone
    front_a.start()
    for t, question in enumerate(QUESTIONS):
        for i, (session_id, seed, backend) in enumerate(sessions):
            front = (front_a, front_b)[(i + t) % 2]  # interleaved between the restarted front and the other
            answer, cached, answered_by, prompt = turn(front.url, session_id, question)
            assert (answer, cached, prompt) == expected[seed][t]  # the same answer, from the session's cached KV
            assert cached > 0 and answered_by == backend


def test_a_client_that_leaves_or_a_timeout_cancels_the_turn(cluster):
    backends, (front_a, front_b) = cluster
    expected = reference(front_a.url, 63)
    left, _ = open_session(front_a.url, 63)
    streamed = requests.post(front_a.url + "/invocations", stream=True, timeout=TIMEOUT,
                             json=chat("Tell me a very long story.", max_tokens=900, stream=True),
                             headers={SESSION_HEADER: left, REQUEST_ID_HEADER: "e2e-leaves-1"})
    assert streamed.headers[REQUEST_ID_HEADER] not in ("e2e-leaves-1", "")  # the front's own id, not the client's
    assert next(streamed.iter_lines()).startswith(b"data: ")
    streamed.close()  # the client leaves after the first chunk

    # The front's timeout is a fifth of what the whole long turn takes on these backends, so the cancel
    # reaches the engine while the turn still decodes, however fast the machine (a fixed 0.5 s raced a
    # 900-token turn that took about as long on a fast CPU, and the turn then committed).
    measured, _ = open_session(front_a.url, 63)
    began = time.monotonic()
    assert post(front_a.url, chat("Tell me a very long story.", max_tokens=900), session=measured).status_code == 200
    whole_turn_s = time.monotonic() - began
    post(front_a.url, {"requestType": "CLOSE"}, session=measured)
    config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), admin_token=TOKEN,
                                  timeout_s=whole_turn_s / 5, health_interval_s=0.5)
    impatient = FrontThread(config).start(free_port())
    try:
        deadline = time.monotonic() + 30
        while len(impatient.front.router.healthy_backends) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        url = f"http://127.0.0.1:{impatient.front.port}"
        timed_out, _ = open_session(front_a.url, 63)
        slow = post(url, chat("Tell me a very long story.", max_tokens=900), session=timed_out)
        assert (slow.status_code, slow.json()["error"]["type"]) == (504, "backend_timeout")
        assert slow.json()["error"]["may_have_committed"] is False  # the cancel was confirmed before the 504
        assert impatient.front.num_cancels_sent == 1
    finally:
        impatient.stop()
    time.sleep(1.0)  # the cancels reach the engine's next step
    for session_id in (left, timed_out):  # the cancelled turn left no trace: as if it was never asked
        after = [turn(front_b.url, session_id, q) for q in QUESTIONS]
        # The same answers over the same transcript (prompt tokens); the KV cache may hold one token
        # more than in a session never cancelled (the rolled-back turn's prefill kept its first token).
        assert [(a[0], a[3]) for a in after] == [(e[0], e[2]) for e in expected]
        assert all(a[1] > 0 for a in after)
    described = requests.get(front_a.url + "/backends", headers={ADMIN_TOKEN_HEADER: TOKEN}, timeout=TIMEOUT).json()
    assert described["num_cancels_sent"] == 1  # the stream the client left


def test_the_openai_client_through_the_front(cluster):
    backends, (front_a, front_b) = cluster
    expected = reference(front_a.url, 64)
    client = openai.OpenAI(base_url=front_a.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    opening = chat("What is in this image?", image_seed=64)
    raw = client.chat.completions.with_raw_response.create(
        model="llava", messages=opening["messages"], max_tokens=8, extra_headers={SESSION_HEADER: "NEW_SESSION"})
    session_id = raw.headers[NEW_SESSION_HEADER].split(";")[0]
    assert raw.parse().model_extra["session_id"] == session_id
    follow = client.chat.completions.create(model="llava", messages=chat(QUESTIONS[0])["messages"], max_tokens=8,
                                            extra_headers={SESSION_HEADER: session_id})
    assert (follow.choices[0].message.content, follow.usage.prompt_tokens) == (expected[0][0], expected[0][2])
    assert follow.usage.prompt_tokens_details.cached_tokens == expected[0][1]
    stream = client.chat.completions.create(model="llava", messages=chat(QUESTIONS[1])["messages"], max_tokens=8,
                                            stream=True, extra_headers={SESSION_HEADER: session_id})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected[1][0]
    assert [m.id for m in client.models.list()][0] == "llava"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="llava", messages=chat("x")["messages"],
                                       extra_headers={SESSION_HEADER: session_id[:-2] + "b7"})


def test_drain_moves_every_session_and_backend_0_stops_with_none_lost(cluster):
    """Runs last: stops backend 0."""
    backends, (front_a, front_b) = cluster
    seeds = [70, 71, 72, 73]
    expected = {seed: reference(front_a.url, seed) for seed in seeds}
    sessions = []
    for seed in seeds:
        session_id, opened = open_session(front_a.url, seed)
        sessions.append((session_id, seed, opened.headers[BACKEND_HEADER]))
    admin = {ADMIN_TOKEN_HEADER: TOKEN}
    listed = requests.post(backends[0].url + "/predictions/llava", json={"sessions": "list"}, headers=admin,
                           timeout=TIMEOUT).json()["sessions"]
    on_0 = {s["session_id"] for s in listed}
    assert {sid for sid, _, b in sessions if b == "0"} <= on_0

    drained = requests.post(front_a.url + "/backends/0/drain", headers=admin, timeout=TIMEOUT)
    report = drained.json()
    assert drained.status_code == 200, report
    assert (report["moved"], report["failed"], report["remaining"]) == (len(on_0), {}, 0)
    assert {s["session_id"] for s in report["sessions"]} == on_0
    assert {s["to"] for s in report["sessions"]} == {1}
    print("\nmigration:", json.dumps({k: report[k] for k in ("moved", "seconds", "per_session_ms")}))

    for t, question in enumerate(QUESTIONS):
        for i, (session_id, seed, _) in enumerate(sessions):
            front = (front_a, front_b)[(i + t) % 2]  # B never saw the drain: it finds them by asking
            answer, cached, backend, prompt = turn(front.url, session_id, question)
            assert (answer, prompt) == (expected[seed][t][0], expected[seed][t][2])  # as if never moved
            assert backend == "1"
    backends[0].stop()
    for session_id, _seed, _ in sessions:
        assert turn(front_b.url, session_id, "And now?")[2] == "1"
    new_id, opened = open_session(front_a.url, 74)
    assert opened.headers[BACKEND_HEADER] == "1" and new_id.endswith("-b1")
    MOVED.extend(sid for sid, _, backend in sessions if backend == "0")


def test_nginx_before_the_real_backends_finds_the_moved_sessions(cluster, tmp_path):
    """Runs after the drain: backend 0 is stopped, its sessions live on backend 1 under their "-b0" ids."""
    if not MOVED:
        pytest.skip("needs the sessions the drain test moved")
    backends, (front_a, front_b) = cluster
    port = free_port()
    config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), timeout_s=TIMEOUT)
    tmp_path.chmod(0o755)
    with running_nginx(render_main(site_from_config(config, f"127.0.0.1:{port}"), tmp_path), tmp_path, port):
        url = f"http://127.0.0.1:{port}"
        alive = backends[1].url.split("//")[1]
        for session_id in MOVED:  # tagged b0, whose backend is gone: nginx searches and finds them on b1
            response = post(url, chat("Still there?"), session=session_id)
            assert response.status_code == 200, response.text
            assert response.headers["X-Resident-Upstream"].endswith(alive)
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        new_id, opened = open_session(url, 75)  # the dead backend is skipped
        assert new_id.endswith("-b1") and opened.headers["X-Resident-Upstream"].endswith(alive)
        via_front = turn(front_b.url, new_id, QUESTIONS[0])  # fronts and nginx serve the same sessions
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        stream = client.chat.completions.create(model="llava", messages=chat(QUESTIONS[1])["messages"], max_tokens=8,
                                                stream=True, extra_headers={SESSION_HEADER: new_id})
        assert "".join(c.choices[0].delta.content or "" for c in stream)
        assert via_front[2] == "1"
