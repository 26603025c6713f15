"""launch/cluster.py: how many backends, their ports and per-backend settings; launch/torchserve.py and
launch/watchdog.py: a worker that fails to start stops the launch at once, never restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from launch import cluster, torchserve
from launch.cluster import Devices, backend_base_port, backend_env, num_backends, session_id_tag, write_admin_token
from launch.torchserve import TorchServe, WorkerInitError
from launch.watchdog import Watchdog
from session.errors import ConfigError

CUDA, NEURON, CPU = Devices("cuda", 2), Devices("neuron", 4), Devices("cpu", 1)


def test_num_backends():
    assert num_backends("3", CPU) == 3
    assert num_backends("auto", CUDA) == 2
    assert num_backends(" AUTO ", CPU) == 1
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ConfigError, match="BACKENDS"):
            num_backends(bad, CPU)


def test_backend_ports():
    assert backend_base_port(8080, {}) == 8090
    assert backend_base_port(8080, {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999"}) == 29000
    assert backend_base_port(8080, {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999", "RESIDENT_BACKEND_PORT": "7000"}) \
        == 7000


def settings(index, num, devices, environ):
    """backend_env without the session id tag (tested on its own below)."""
    env = backend_env(index, num, devices, environ)
    assert env.pop("RESIDENT_SESSION_ID_TAG") == session_id_tag(index, environ)
    return env


def test_a_cpu_quota_caps_the_backends_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("launch.cluster.usable_cores", lambda: 1)  # a container limited to 1 CPU on a big host
    assert settings(0, 2, CPU, {}) == {"RESIDENT_MAX_THREADS": "1"}
    monkeypatch.setattr("launch.cluster.usable_cores", lambda: 8)
    assert settings(1, 2, CPU, {}) == {"RESIDENT_MAX_THREADS": "4"}
    assert settings(0, 1, CPU, {}) == {"RESIDENT_MAX_THREADS": "8"}  # make serve: a ceiling, still tuned


def test_each_backend_gets_its_device_or_its_share_of_the_cores():
    assert [settings(i, 3, CUDA, {}) for i in range(3)] == [
        {"RESIDENT_DEVICE": "cuda:0"}, {"RESIDENT_DEVICE": "cuda:1"}, {"RESIDENT_DEVICE": "cuda:0"}]
    assert settings(1, 2, CUDA, {"RESIDENT_DEVICE": "cpu"}) == {}  # the caller's choice stands
    assert settings(3, 4, NEURON, {}) == {"NEURON_RT_VISIBLE_CORES": "3"}
    assert settings(0, 2, CPU, {}) == {"RESIDENT_MAX_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 2))}
    assert settings(0, 2, CPU, {"RESIDENT_THREADS": "8"}) == {}
    assert settings(0, 2, CPU, {"RESIDENT_MAX_THREADS": "2"}) == {}


def test_each_backend_gets_its_own_journal():
    env = {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident", "RESIDENT_THREADS": "1"}
    assert [settings(i, 2, CPU, env) for i in range(2)] == [
        {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident/backend-0"},
        {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident/backend-1"}]


def test_each_backend_tags_the_session_ids_it_creates():
    assert [backend_env(i, 3, CPU, {})["RESIDENT_SESSION_ID_TAG"] for i in range(3)] == ["b0", "b1", "b2"]
    assert session_id_tag(1, {"RESIDENT_INSTANCE_TAG": "ia"}) == "iab1"
    with pytest.raises(ConfigError, match="RESIDENT_INSTANCE_TAG"):
        session_id_tag(0, {"RESIDENT_INSTANCE_TAG": "a-b"})


def test_the_admin_token_is_written_for_the_operator_only(tmp_path):
    path = write_admin_token(tmp_path / "cluster-8080", "s3cret")
    assert path.read_text() == "s3cret\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert write_admin_token(tmp_path / "cluster-8080", "other").read_text() == "other\n"


def test_a_front_alone_shares_the_backends_admin_token(monkeypatch):
    seen = []
    monkeypatch.setattr(cluster, "_serve", lambda config, host, port: seen.append(config.admin_token) or 0)
    env = {"RESIDENT_FRONT_BACKENDS": "http://127.0.0.1:1"}
    assert cluster.run_front(8080, {**env, "RESIDENT_ADMIN_TOKEN": "shared"}) == 0
    assert cluster.run_front(8080, {**env, "RESIDENT_ADMIN_TOKEN": "shared", "RESIDENT_FRONT_ADMIN_TOKEN": "own"}) == 0
    assert cluster.run_front(8080, env) == 0
    assert seen == ["shared", "own", ""]


class FakeProcess:
    """A TorchServe frontend that keeps running (as it does while it retries a failing worker)."""

    pid = -1  # never signalled: the tests that stop one replace _stop_group
    returncode = None

    def poll(self):
        return None


class LoadingServer(TorchServe):
    """Its worker never becomes READY; the management API is not asked."""

    def worker_statuses(self) -> list[str]:
        return ["UNLOADING"]


def test_wait_ready_raises_the_workers_init_error_as_soon_as_its_log_has_it(tmp_path):
    """Raised once the file is written and the frontend has relayed the traceback's last line to the
    log the error points at (stopping TorchServe before that leaves the log without it)."""
    server = LoadingServer(process=FakeProcess(), port=1, run_dir=tmp_path)
    summary = "ConfigError: the model's chat template renders neither (list content: TemplateError: broken)"
    last = "session.errors.ConfigError: the model's chat template renders neither"
    (tmp_path / "logs").mkdir()

    def relay():
        (tmp_path / "logs" / "model_log.log").write_text(f"2026-12-05 [INFO ] W-9000 MODEL_LOG - {last}\n")

    writer = threading.Timer(0.3, lambda: server.init_error_file.write_text(f"{summary}\n\nTraceback ...\n{last}\n"))
    relayer = threading.Timer(1.5, relay)
    writer.start()
    relayer.start()
    started = time.monotonic()
    with pytest.raises(WorkerInitError) as raised:
        server.wait_ready(timeout_s=60)
    assert 1.5 <= time.monotonic() - started < 5  # after the log has it, not at the timeout
    assert raised.value.summary == summary
    assert raised.value.log == tmp_path / "logs" / "model_log.log"
    assert str(raised.value) == f"the model worker failed to start: {summary} (see {tmp_path}/logs/model_log.log)"
    writer.join()
    relayer.join()


def test_a_log_that_never_gets_the_traceback_delays_the_error_a_bounded_time(tmp_path, monkeypatch):
    import launch.torchserve as torchserve

    monkeypatch.setattr(torchserve, "LOG_RELAY_S", 0.5)
    server = LoadingServer(process=FakeProcess(), port=1, run_dir=tmp_path)
    server.init_error_file.write_text("TypeError: boom\n\nTraceback ...\nTypeError: boom\n")
    started = time.monotonic()
    failure = server.init_failure()
    assert failure.summary == "TypeError: boom" and 0.5 <= time.monotonic() - started < 3


def test_without_the_file_wait_ready_still_times_out(tmp_path):
    server = LoadingServer(process=FakeProcess(), port=1, run_dir=tmp_path)
    assert server.init_failure() is None
    with pytest.raises(TimeoutError):
        server.wait_ready(timeout_s=0.2)


def test_a_start_removes_a_previous_runs_init_error_and_tells_the_worker_where_to_write(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(torchserve, "check_ports_free", lambda host, port: None)
    monkeypatch.setattr(torchserve, "build_archive", lambda store, **kwargs: store / "llava")
    monkeypatch.setattr(torchserve, "_launch", lambda cmd, run_dir, env, stdout: launched.append(env) or FakeProcess())
    monkeypatch.setattr(torchserve, "_guard", lambda process, journal_dir: None)
    monkeypatch.setattr(torchserve, "_stop_group", lambda process, timeout_s: None)  # no group to signal
    (tmp_path / "init-error.txt").write_text("TypeError: from the run before\n")
    server = torchserve.start_torchserve(8080, run_dir=tmp_path)
    assert not server.init_error_file.exists() and server.init_failure() is None
    assert launched[0]["RESIDENT_INIT_ERROR_FILE"] == str(tmp_path.resolve() / "init-error.txt")
    server.init_error_file.write_text("TypeError: this run\n")
    server.restart()  # a watchdog restart starts afresh too
    assert not server.init_error_file.exists() and len(launched) == 2


class FailingServer:
    """wait_ready raises WorkerInitError; counts restarts."""

    port = 1
    num_restarts = 0

    def wait_ready(self, timeout_s):
        raise WorkerInitError("TypeError: broken", Path("logs/model_log.log"))

    def worker_statuses(self):
        return []

    def restart(self):
        self.num_restarts += 1


def test_the_watchdog_never_restarts_a_worker_that_failed_to_start():
    server = FailingServer()
    watchdog = Watchdog(server, interval_s=0.01, failures_to_restart=1).start()
    watchdog._thread.join(5)
    assert not watchdog._thread.is_alive()  # it stopped watching: the launcher stops the launch
    assert server.num_restarts == 0


def test_a_backends_init_error_stops_the_cluster(tmp_path):
    backends = [LoadingServer(process=FakeProcess(), port=p, run_dir=tmp_path / str(p)) for p in (1, 2)]
    for backend in backends:
        backend.run_dir.mkdir()
    cluster.raise_init_failure(backends)  # none yet
    backends[1].init_error_file.write_text("TypeError: broken\n")
    with pytest.raises(WorkerInitError, match="TypeError: broken"):
        cluster.raise_init_failure(backends)


def test_a_backend_that_served_and_fails_after_a_restart_stops_alone(tmp_path):
    backends = [LoadingServer(process=FakeProcess(), port=p, run_dir=tmp_path / str(p)) for p in (1, 2)]
    for backend in backends:
        backend.run_dir.mkdir()
    backends[1].ever_ready = True  # it served before its restart failed
    backends[1].init_error_file.write_text("OutOfMemoryError: CUDA out of memory\n")
    cluster.raise_init_failure(backends)  # the cluster goes on with backend 0
    backends[0].init_error_file.write_text("TypeError: broken\n")  # one that never started: fatal
    with pytest.raises(WorkerInitError, match="TypeError: broken"):
        cluster.raise_init_failure(backends)


def test_the_default_journal_is_made_ours_and_reused(tmp_path):
    path = torchserve.default_journal_dir(tmp_path, 8090)
    assert path == tmp_path / "resident-journal-8090"
    assert path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 == 0o700
    assert torchserve.default_journal_dir(tmp_path, 8090) == path  # a restart, or the next run: the same


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_default_journal_another_user_made_first_does_not_stop_the_start(tmp_path):
    """Issue #39: anyone may create /dev/shm/resident-journal-<port> before the server starts."""
    from session.state.journal import Journal

    taken = tmp_path / "resident-journal-8090"
    taken.mkdir(mode=0o777)
    os.chown(taken, 12345, 12345)
    path = torchserve.default_journal_dir(tmp_path, 8090)
    assert path != taken and path.parent == tmp_path and path.name.startswith("resident-journal-8090-")
    assert path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 == 0o700
    Journal(path).write_adapters({})  # the worker's journal opens there
    assert list(taken.iterdir()) == []
    (tmp_path / "resident-journal-8091").write_text("")  # not a directory: left alone too
    assert torchserve.default_journal_dir(tmp_path, 8091).name.startswith("resident-journal-8091-")


def test_a_stop_signal_held_while_a_backend_starts_unwinds_after_it():
    """A SIGTERM or SIGINT while a TorchServe starts waits for the start to end, then unwinds as a stop."""
    done = []
    with pytest.raises(KeyboardInterrupt):
        with cluster._stop_signals_held():
            cluster._interrupt(signal.SIGTERM, None)  # held: the block goes on
            done.append("started")
    assert done == ["started"]
    # the archiver died of the same Ctrl-C: the stop unwinds, its failure as the cause
    with pytest.raises(KeyboardInterrupt) as info:
        with cluster._stop_signals_held():
            cluster._interrupt(signal.SIGINT, None)
            raise subprocess.CalledProcessError(-2, ["torch-model-archiver"])
    assert isinstance(info.value.__cause__, subprocess.CalledProcessError)
    with pytest.raises(subprocess.CalledProcessError):  # no stop: the failure is the failure
        with cluster._stop_signals_held():
            raise subprocess.CalledProcessError(1, ["torch-model-archiver"])
    with pytest.raises(KeyboardInterrupt):  # outside the block a stop unwinds at once
        cluster._interrupt(signal.SIGTERM, None)
    assert not cluster._held and not cluster._pending


def test_the_front_stops_on_a_stop_signal_and_gives_the_launchers_handler_back(unused_tcp_port):
    """The front's run takes SIGTERM and SIGINT and, when it ends, puts the launcher's handler back with
    no moment at SIG_DFL. With the event loop's add_signal_handler, closing the loop reset both to
    SIG_DFL, and a SIGTERM before the launcher's clean-up killed it with its TorchServe instances running."""
    import asyncio

    from session.front.config import FrontConfig

    previous = {signum: signal.signal(signum, cluster._interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        async def run() -> bool:
            asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)
            config = FrontConfig(backends=("http://127.0.0.1:9",), drain_s=0.1)
            return await asyncio.wait_for(cluster.serve_front(config, "127.0.0.1", unused_tcp_port), 30)

        assert asyncio.run(run()) is True  # stopped by the signal, not by a dead backend
        assert signal.getsignal(signal.SIGTERM) is cluster._interrupt
        assert signal.getsignal(signal.SIGINT) is cluster._interrupt
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
