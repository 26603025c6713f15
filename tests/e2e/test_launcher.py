"""`make serve`'s launcher (the front on PORT before one TorchServe on PORT+10 .. +14): SIGTERM stops
everything it started, at any moment (docs/DESIGN.md, "Interfaces")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.e2e


def leftovers(marker: str) -> list[int]:
    """PIDs of processes whose command line names this instance's run directory."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in process.info["cmdline"] or []):
                found.append(process.info["pid"])
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("moment", ["while loading", "when serving"])
def test_sigterm_stops_everything(tiny_model_path, moment):
    port = free_port(15)
    marker = f"serve-{port}"
    launcher = subprocess.Popen([sys.executable, "-m", "launch", "serve"], cwd=REPO,
                                env={**os.environ, "PORT": str(port)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not leftovers(marker):  # TorchServe has been started
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
        if moment == "when serving":
            line = launcher.stdout.readline()
            while line and not line.startswith("serving"):
                line = launcher.stdout.readline()
            assert line.startswith("serving")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        deadline = time.monotonic() + 10
        while leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leftovers(marker) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in leftovers(marker):
            os.kill(pid, signal.SIGKILL)


def _ports_free(port: int, count: int) -> bool:
    import socket

    for candidate in range(port, port + count):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


def _traffic(url: str, num_sessions: int = 8, num_turns: int = 3) -> None:
    """Real traffic first: sessions with several turns, concurrently (a light test did not reproduce
    TorchServe outliving the launcher)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    def converse(i: int) -> int:
        headers = {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION", "Content-Type": "application/json"}
        for turn in range(num_turns):
            body = {"messages": [{"role": "user", "content": f"question {i}.{turn}"}], "max_tokens": 16}
            answer = requests.post(f"{url}/invocations", json=body, headers=headers, timeout=120)
            assert answer.status_code == 200, answer.text
            if turn == 0:
                headers["X-Amzn-SageMaker-Session-Id"] = answer.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        return num_turns

    with ThreadPoolExecutor(num_sessions) as pool:
        assert sum(pool.map(converse, range(num_sessions))) == num_sessions * num_turns


def _wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/ping", timeout=5).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError(f"{url} never became healthy")


STOP_CASES = [("SIGINT", "group"), ("SIGTERM", "group"), ("SIGINT", "launcher"), ("SIGTERM", "launcher"),
              ("SIGKILL", "launcher")]


@pytest.mark.parametrize("target", ["serve", "cluster"])
@pytest.mark.parametrize("signame,whom", STOP_CASES)
def test_stop_matrix_after_traffic(tiny_model_path, tmp_path, target, signame, whom):
    """`make serve` / `make cluster`: whatever signal reaches the process group or the launcher alone,
    no TorchServe outlives the launcher by more than its stop timeout, the ports are free and the
    instances' journals are gone."""
    from launch.torchserve import STOP_TIMEOUT_S

    port = free_port(20)
    backend_port = port + 10  # make serve's one backend, make cluster's first
    env = {**os.environ, "PORT": str(port), "BACKENDS": "1", "RESIDENT_WATCHDOG_INTERVAL_S": "0"}
    marker = f"serve-{port}" if target == "serve" else f"cluster-{port}"
    log = tmp_path / "launcher.log"  # a file, not a pipe: TorchServe's logs must never block on a reader
    with open(log, "w") as out:
        make = subprocess.Popen(["make", "-s", target], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    ts_port = backend_port
    journal = f"/dev/shm/resident-journal-{ts_port}"
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        _traffic(f"http://127.0.0.1:{port}")
        assert leftovers(marker) and os.path.isdir(journal)
        launcher = next(p for p in psutil.Process(make.pid).children(recursive=True)
                        if "launch" in " ".join(p.cmdline()))
        sig = getattr(signal, signame)
        if whom == "group":
            os.killpg(make.pid, sig)
        else:
            launcher.send_signal(sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S + 15
        while (leftovers(marker) or not _ports_free(ts_port, 5) or os.path.exists(journal)) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert leftovers(marker) == [], f"{target}: TorchServe outlived {signame} to the {whom}"
        assert _ports_free(ts_port, 5) and _ports_free(port, 1)
        assert not os.path.exists(journal)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(make.pid, signal.SIGKILL)
        for pid in leftovers(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("offset,role", [(0, "the front's, PORT="), (11, "management")])
def test_a_port_in_use_fails_start_up_naming_it(tiny_model_path, offset, role):
    """The front's port, or one of its backend's (PORT+10 ..), taken: refused before any model loads."""
    import socket

    port = free_port(15)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port + offset))
        squatter.listen()
        done = subprocess.run([sys.executable, "-m", "launch", "serve"], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PORT": str(port)}, timeout=120)
    assert done.returncode == 1
    assert f"port {port + offset} on 127.0.0.1 ({role}" in done.stderr and "already in use" in done.stderr
    assert f"by pid {os.getpid()}" in done.stderr
    assert leftovers(f"serve-{port}") == []
