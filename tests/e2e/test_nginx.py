"""The generated nginx configuration (launch/nginx.py), run by a real nginx on 127.0.0.1 before fake
session backends (tests/fake_backend.py): follow-ups reach their backend by the tag in their id,
new sessions the least busy backend, moved sessions are found, streams pass as they come.

nginx runs in the foreground with its own prefix, config, pid and logs in a temp dir, and is
stopped by PID. Without an nginx binary the tests skip, unless RESIDENT_REQUIRE_NGINX=1 (.ci/run)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from launch.nginx import main as nginx_main, render_http, render_main, site_from_config
from session.front.config import FrontConfig
from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    CANCEL_HEADER,
    CLOSED_SESSION_HEADER,
    COMPLETIONS_ENDPOINT,
    ENDPOINT_HEADER,
    NEW_SESSION_HEADER,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
    TENANT_HEADER,
)
from tests.conftest import free_port
from tests.fake_backend import TOKEN, LoopThread, SessionBackend

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
TIMEOUT = 10


def require_nginx() -> str:
    if NGINX is None:
        if os.environ.get("RESIDENT_REQUIRE_NGINX") == "1":
            pytest.fail("nginx is required here (RESIDENT_REQUIRE_NGINX=1): apt-get install -y nginx")
        pytest.skip("nginx is not installed (apt-get install -y nginx; .ci/run does)")
    return NGINX


@contextlib.contextmanager
def running_nginx(config_text: str, prefix: Path, port: int):
    """nginx in the foreground on 127.0.0.1:port; stopped by PID (SIGQUIT, then SIGKILL)."""
    (prefix / "nginx.conf").write_text(config_text)
    cmd = [require_nginx(), "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")]
    if os.geteuid() == 0:
        cmd += ["-g", "user root;"]  # workers must reach the temp dir, which only its owner may enter
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            with contextlib.suppress(requests.ConnectionError):
                requests.get(f"http://127.0.0.1:{port}/nowhere", timeout=1)
                break
            assert time.monotonic() < deadline, "nginx did not start listening"
            time.sleep(0.05)
        yield process
    finally:
        process.send_signal(signal.SIGQUIT)  # graceful: workers finish, the master exits
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


@pytest.fixture
def proxy(tmp_path):
    """Three fake backends, nginx before them: (base URL, backends, loop thread)."""
    require_nginx()
    thread = LoopThread()
    backends = [thread.call(SessionBackend(i).start()) for i in range(3)]
    port = free_port()
    config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), timeout_s=10, header_timeout_s=1,
                                  max_requests_per_client=8)
    site = site_from_config(config, f"127.0.0.1:{port}")
    tmp_path.chmod(0o755)
    try:
        with running_nginx(render_main(site, tmp_path), tmp_path, port):
            yield f"http://127.0.0.1:{port}", backends, thread
    finally:
        for backend in backends:
            thread.loop.call_soon_threadsafe(backend.release.set)
            thread.call(backend.stop())
        thread.close()


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def post(url: str, text: str, session: str | None = None, path: str = "/invocations", **extra):
    headers = {SESSION_HEADER: session} if session else {}
    return requests.post(url + path, json=chat(text, **extra), headers=headers, timeout=TIMEOUT)


def open_session(url: str) -> tuple[str, int]:
    response = post(url, "hi", session="NEW_SESSION")
    assert response.status_code == 200, response.text
    session_id = response.headers[NEW_SESSION_HEADER].split(";")[0]
    return session_id, int(response.json()["choices"][0]["message"]["content"].split()[1])


def test_follow_ups_reach_their_backend_by_the_tag_in_their_id(proxy):
    url, backends, thread = proxy
    opened = [open_session(url) for _ in range(6)]
    assert sorted(b for _, b in opened) == [0, 0, 1, 1, 2, 2]  # all idle: least_conn takes turns
    assert all(sid.endswith(f"-b{b}") for sid, b in opened)
    for turn in (2, 3):
        for sid, backend in opened:
            response = post(url, "more", session=sid)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == f"backend {backend} turn {turn}"
            assert response.headers["X-Resident-Upstream"] == backends[backend].url.split("//")[1]
    sid, backend = opened[0]
    streamed = requests.post(url + "/invocations", json=chat("again", stream=True), headers={SESSION_HEADER: sid},
                             timeout=TIMEOUT, stream=True)
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in streamed.iter_lines() if line]
    assert events[-1] == b"data: [DONE]" and len(events) == 4 + 1  # one per word, then [DONE]
    closed = post(url, "x", session=sid, requestType="CLOSE")
    assert closed.headers[CLOSED_SESSION_HEADER] == sid
    gone = post(url, "still?", session=sid)
    assert (gone.status_code, gone.json()["error"]["type"]) == (404, "session_not_found")
    # open, 2 follow-ups each, stream, close; the last 404: its home, then the search asked all three
    assert sum(len(b.requests) for b in backends) == 6 + 12 + 1 + 1 + 1 + 3


def test_a_moved_session_is_found_on_its_new_backend(proxy):
    url, backends, thread = proxy
    opened = [open_session(url) for _ in range(3)]
    sid, home = next((s, b) for s, b in opened if b == 0)

    async def move():  # what a front's drain does: export on the home backend, import on another, confirm
        exported = backends[0]._admin({"sessions": "export", "session_id": sid})
        backends[2]._admin({"sessions": "import", "session": json.loads(exported.body)["session"]})
        backends[0]._admin({"sessions": "forget", "session_id": sid})

    thread.call(move())
    for turn in (2, 3):
        response = post(url, "more", session=sid)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == f"backend 2 turn {turn}"
        assert backends[0].requests[-1]["session"] == sid  # asked at home first: 404 there, then the search


def test_new_sessions_go_to_the_least_busy_backend_and_skip_a_dead_one(proxy):
    url, backends, thread = proxy
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(post, url, "hold") for _ in range(2)]  # stateless, held: two backends busy
        deadline = time.monotonic() + 5
        while sum(len(b.requests) for b in backends) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy = {i for i, b in enumerate(backends) if b.requests}
        assert len(busy) == 2
        idle = ({0, 1, 2} - busy).pop()
        assert [open_session(url)[1] for _ in range(3)] == [idle] * 3
        for backend in backends:
            thread.loop.call_soon_threadsafe(backend.release.set)
        assert [f.result(TIMEOUT).status_code for f in held] == [200, 200]
    thread.call(backends[idle].stop())
    assert {open_session(url)[1] for _ in range(4)} <= {0, 1, 2} - {idle}


def test_the_openai_path_through_nginx(proxy):
    url, backends, thread = proxy
    llm = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    raw = llm.chat.completions.with_raw_response.create(model="llava", messages=[{"role": "user", "content": "hi"}],
                                                        extra_headers={SESSION_HEADER: "NEW_SESSION"})
    sid = raw.headers[NEW_SESSION_HEADER].split(";")[0]
    backend = int(raw.parse().choices[0].message.content.split()[1])
    stream = llm.chat.completions.create(model="llava", messages=[{"role": "user", "content": "more"}], stream=True,
                                         extra_headers={SESSION_HEADER: sid})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == f"backend {backend} turn 2 "
    assert backends[backend].requests[-1]["path"] == "/invocations"
    assert ENDPOINT_HEADER not in backends[backend].requests[-1]["headers"]


def test_completions_reach_invocations_marked_so_also_when_searched(proxy):
    """/v1/completions goes to /invocations with X-Resident-Endpoint: completions, on the tagged backend
    and on every backend the search of a moved session asks."""
    url, backends, thread = proxy
    sid, home = open_session(url)
    elsewhere = (home + 1) % 3

    async def move():  # as in the test above
        exported = backends[home]._admin({"sessions": "export", "session_id": sid})
        backends[elsewhere]._admin({"sessions": "import", "session": json.loads(exported.body)["session"]})
        backends[home]._admin({"sessions": "forget", "session_id": sid})

    thread.call(move())
    prompt = {"prompt": "Once upon a time"}  # the fakes answer its messages; a backend reads the prompt
    for session in ("NEW_SESSION", sid):
        answer = post(url, "hi", session=session, path="/v1/completions", **prompt)
        assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == f"backend {elsewhere} turn 2"
    marked = [r for b in backends for r in b.requests if "prompt" in r["body"]]
    assert any(r["session"] == sid for r in backends[home].requests if "prompt" in r["body"])  # asked first: 404
    assert {r["path"] for r in marked} == {"/invocations"}
    assert [r["headers"].get(ENDPOINT_HEADER) for r in marked] == [COMPLETIONS_ENDPOINT] * len(marked)


def test_control_headers_never_reach_a_backend(proxy):
    url, backends, _ = proxy
    answer = requests.post(url + "/invocations", json=chat("hi"), timeout=TIMEOUT,
                           headers={CANCEL_HEADER: "victim-1", ADMIN_TOKEN_HEADER: TOKEN, REQUEST_ID_HEADER: "victim-1",
                                    ENDPOINT_HEADER: COMPLETIONS_ENDPOINT, TENANT_HEADER: "acme"})
    assert answer.status_code == 200, answer.text  # an ordinary turn: the cancel never got through
    [sent] = [r["headers"] for b in backends for r in b.requests]
    assert not {CANCEL_HEADER, ADMIN_TOKEN_HEADER, REQUEST_ID_HEADER, ENDPOINT_HEADER} & set(sent)
    assert sent[TENANT_HEADER] == "addr:127.0.0.1"  # the client's address, never the tenant it claims
    assert all(b.cancels == [] and b.admin_bodies == [] for b in backends)


def test_a_slow_request_head_is_cut_off_and_one_client_holds_few_connections(proxy):
    url, _, _ = proxy
    port = int(url.rsplit(":", 1)[1])
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    slow.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\n")  # and nothing more
    began, received = time.monotonic(), b""
    while chunk := slow.recv(4096):
        received += chunk
    assert time.monotonic() - began < 4  # closed after client_header_timeout (1 s), not nginx's default 60 s
    assert received == b"" or received.startswith(b"HTTP/1.1 408")
    slow.close()
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
    for conn in held:  # each one mid-request, so each is a connection limit_conn counts
        conn.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
    time.sleep(0.2)
    refused = requests.post(url + "/invocations", json=chat("hi"), timeout=TIMEOUT)
    assert refused.status_code == 429
    for conn in held:
        conn.close()
    time.sleep(0.2)
    assert requests.post(url + "/invocations", json=chat("hi"), timeout=TIMEOUT).status_code == 200


def test_the_shipped_snippet_is_what_the_generator_writes(capsys):
    shipped = (REPO / "docker" / "nginx" / "resident.conf").read_text()
    assert nginx_main(["--backends", "http://127.0.0.1:8090,http://127.0.0.1:8100", "--listen", "0.0.0.0:8080",
                       "--snippet"], environ={}) == 0
    assert capsys.readouterr().out == shipped
    config = FrontConfig.from_env({}, backends=("http://a:1", "http://b:2"), backend_tags=("ia*", "ib*"))
    text = render_http(site_from_config(config, "8080"))
    assert '"~^[0-9a-fA-F-]{36}-ia[A-Za-z0-9]*$" resident_b0;' in text
    assert nginx_main(["--backends", "http://a:1/x"], environ={}) == 2
