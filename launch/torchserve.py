"""Start one TorchServe instance serving the resident handler, and stop everything it started.

Used by ``make serve``, by end-to-end tests and by benchmarks. Each instance gets its own run
directory: its config.properties (addresses on 127.0.0.1 by default), logs, and TMPDIR, because
TorchServe keeps a pid file in the temp directory and refuses to start a second instance that
shares it. Stopping kills the instance's whole process group by PID: TorchServe's async workers
can outlive ``torchserve --stop``.

No instance outlives its launcher: a guard process (launch/guard.py) stops the group as soon as the
launcher is gone, even after SIGKILL. A clean stop removes the instance's journal (the default one
under /dev/shm); a watchdog restart keeps it, so the sessions come back. A port already in use
fails the start at once, naming the port and, where it can be seen, the process holding it. A
worker whose ``initialize`` raises writes the exception to RESIDENT_INIT_ERROR_FILE (see
handlers/resident_handler.py); ``wait_ready`` raises it as WorkerInitError at once rather than
wait out its timeout while TorchServe starts the worker again and again.

What listens (docs/DEPLOY.md, "what is exposed where"): inference on ``host:port``, metrics on
``port+2``; the management API on a Unix socket in the instance's private temp dir, read by us
alone, with ``GET /models/llava`` relayed on ``port+1`` (launch/management.py); both gRPC ports on
an address no TCP connection can reach (TorchServe 0.12 cannot turn them off).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.management import MAX_SOCKET_PATH, DescribeRelay, describe

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "llava"
DEFAULT_MODEL = REPO / "models" / "llava-tiny"


def bin_path(name: str) -> str:
    """A console script of the running interpreter's environment (the venv), else PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def ensure_demo_models(models_dir: Path = REPO / "models", only: list[str] | None = None) -> None:
    names = only or ["tiny"]
    if all((models_dir / f"llava-{n}" / "config.json").exists() for n in names):
        return
    args = [sys.executable, "-m", "model_store.build_models", "--out", str(models_dir)]
    for name in names:
        args += ["--only", name]
    subprocess.run(args, check=True, cwd=REPO)


def build_archive(store: Path, config_file: Path = REPO / "model_store" / "model-config.yaml") -> Path:
    """A no-archive model folder for TorchServe: the handler and the model config, no weights."""
    store.mkdir(parents=True, exist_ok=True)
    subprocess.run([
        bin_path("torch-model-archiver"), "--model-name", MODEL_NAME, "--version", "1.0",
        "--handler", str(REPO / "handlers" / "resident_handler.py"), "--config-file", str(config_file),
        "--archive-format", "no-archive", "--export-path", str(store), "--force",
    ], check=True)
    return store / MODEL_NAME


STOP_TIMEOUT_S = 20.0  # SIGTERM, then SIGKILL
LOG_RELAY_S = 10.0  # the frontend writes the worker's traceback to model_log.log a moment after the worker
INIT_ERROR_FILE = "init-error.txt"  # in the run dir: the worker's exception line, then its traceback


# TorchServe 0.12 always starts its gRPC servers (no setting turns them off). Bound to the limited
# broadcast address they listen where no TCP connection arrives: Linux refuses to connect a TCP
# socket to a broadcast or multicast address (ENETUNREACH), for every user, root included.
UNREACHABLE_ADDRESS = "255.255.255.255"
MANAGEMENT_SOCKET = "management.sock"  # in the run dir's tmp/, which is 0700


class PortInUse(RuntimeError):
    pass


class WorkerInitError(RuntimeError):
    """The model's worker raised in ``initialize``: ``summary`` is its exception line, ``log`` the log
    with the whole traceback. TorchServe would retry it forever; the launchers stop instead."""

    def __init__(self, summary: str, log: Path):
        super().__init__(f"the model worker failed to start: {summary} (see {_shown(log)})")
        self.summary = summary
        self.log = log


def _shown(path: Path) -> Path:
    """``path`` relative to the working directory when under it (build/serve-8080/...), else whole."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


PORT_ROLES = ("inference", "management (describe relay)", "metrics", "gRPC inference", "gRPC management")


def check_ports_free(host: str, port: int) -> None:
    """Raise PortInUse naming the first of ``port .. port+4`` that cannot be bound (the gRPC ones on
    UNREACHABLE_ADDRESS, where TorchServe binds them)."""
    for offset, role in enumerate(PORT_ROLES):
        address = UNREACHABLE_ADDRESS if role.startswith("gRPC") else host
        check_port_free(address, port + offset, f"{role}, PORT={port} uses {port}..{port + 4}")


def check_port_free(address: str, port: int, what: str) -> None:
    """Raise PortInUse naming ``port``, ``what`` it is for, and the process holding it, if it cannot be bound."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            raise PortInUse(f"port {port} on {address} ({what}) is already in use{_holder(port)}: {exc.strerror}; "
                            "stop that process or set PORT to a free range") from None


def _holder(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" by pid {conn.pid} ({' '.join(psutil.Process(conn.pid).cmdline()[:3])})"
    except Exception:  # best effort: the message names the port either way
        pass
    return ""


@dataclass
class TorchServe:
    """A running instance. ``port`` serves inference; the describe relay, metrics and gRPC use port+1 .. port+4;
    the management API is the Unix socket ``management_socket``."""

    process: subprocess.Popen
    port: int
    run_dir: Path
    host: str = "127.0.0.1"
    env: dict = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    stdout: object = None
    num_restarts: int = 0
    guard: subprocess.Popen | None = None  # launch/guard.py: stops this instance if the launcher dies
    journal_dir: str = ""  # removed on a clean stop (the launcher chose it)
    ever_ready: bool = False  # its worker was READY once (set by wait_ready): it started, whatever comes later
    relay: DescribeRelay | None = None  # GET /models/llava on management_url; stopped with the instance

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def management_url(self) -> str:
        """The describe relay (the front reads worker statuses there); not TorchServe's management API."""
        return f"http://{self.host}:{self.port + 1}"

    @property
    def management_socket(self) -> Path:
        return self.run_dir / "tmp" / MANAGEMENT_SOCKET

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.port + 2}"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Block until the model's worker is READY (TorchServe's /ping says Healthy before that).
        Raises WorkerInitError as soon as the worker reports that ``initialize`` raised."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (failure := self.init_failure()) is not None:
                raise failure
            if self.process.poll() is not None:
                raise RuntimeError(f"TorchServe exited with {self.process.returncode}; see {self.run_dir}/logs")
            if self.worker_statuses() == ["READY"]:
                self.ever_ready = True
                return
            time.sleep(0.5)
        raise TimeoutError(f"TorchServe on port {self.port} not ready after {timeout_s}s; see {self.run_dir}/logs")

    def worker_statuses(self) -> list[str]:
        """Status of each worker of the model, from the management API ([] while unreachable)."""
        try:
            status, body = describe(str(self.management_socket), MODEL_NAME)
            described = json.loads(body) if status == 200 else []
        except (OSError, http.client.HTTPException, ValueError):
            return []
        return [w.get("status", "") for w in described[0].get("workers", [])] if described else []

    def worker_pids(self) -> list[int]:
        """PIDs of the Python workers (children of the Java frontend)."""
        import psutil

        try:
            return [p.pid for p in psutil.Process(self.process.pid).children(recursive=True)
                    if "model_service_worker" in " ".join(p.cmdline())]
        except psutil.Error:
            return []

    @property
    def heartbeat_file(self) -> Path:
        return self.run_dir / "heartbeat"

    def heartbeat_age_s(self) -> float | None:
        """Seconds since the engine loop last touched its heartbeat file (None: not yet)."""
        try:
            return time.time() - self.heartbeat_file.stat().st_mtime
        except FileNotFoundError:
            return None

    @property
    def init_error_file(self) -> Path:
        return self.run_dir / INIT_ERROR_FILE

    def init_failure(self) -> WorkerInitError | None:
        """The worker's start-up failure since this instance (re)started, else None. Polled by
        ``wait_ready`` and, for failures after a watchdog restart, by the launchers' wait loops."""
        try:
            text = self.init_error_file.read_text()
        except FileNotFoundError:
            return None
        log = self.run_dir / "logs" / "model_log.log"
        lines = [line for line in text.splitlines() if line.strip()]
        _await_line(log, lines[-1] if lines else "", LOG_RELAY_S)  # before anyone stops the frontend
        return WorkerInitError(text.split("\n", 1)[0], log)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the instance's process group, then SIGKILL what is left; remove its journal. Idempotent."""
        _stop_group(self.process, timeout_s)
        self._release_guard(keep_journal=False)
        if self.relay is not None:
            self.relay.stop()

    def restart(self) -> None:
        """Stop everything and start the same instance again (same ports, run dir and journal)."""
        _stop_group(self.process, STOP_TIMEOUT_S)
        self._release_guard(keep_journal=True)
        self.heartbeat_file.unlink(missing_ok=True)
        self.init_error_file.unlink(missing_ok=True)
        self.process = _launch(self.cmd, self.run_dir, self.env, self.stdout)
        self.guard = _guard(self.process, self.journal_dir)
        self.num_restarts += 1

    def _release_guard(self, keep_journal: bool) -> None:
        guard, self.guard = self.guard, None
        if guard is None:
            return
        try:
            guard.stdin.write(b"keep" if keep_journal else b"stop")
            guard.stdin.close()
        except OSError:
            pass
        try:
            guard.wait(10)
        except subprocess.TimeoutExpired:
            guard.kill()


def _await_line(log: Path, line: str, timeout_s: float) -> bool:
    """Wait until ``log`` holds ``line`` (the worker's traceback, relayed by the frontend: stopping
    TorchServe before then leaves the log the launcher points at without it); whether it did."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if line in log.read_text(errors="replace"):
                return True
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def start_torchserve(port: int, *, run_dir: Path, model_path: Path | str = DEFAULT_MODEL, host: str = "127.0.0.1",
                     extra_env: dict[str, str] | None = None, config_file: Path | None = None,
                     stdout=None) -> TorchServe:
    check_ports_free(host, port)
    run_dir = Path(run_dir).resolve()
    tmp_dir, workflow_store = _private_dir(run_dir / "tmp"), _private_dir(run_dir / "workflows")
    socket_path = tmp_dir / MANAGEMENT_SOCKET
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise ValueError(f"the management socket {socket_path} is longer than {MAX_SOCKET_PATH} bytes, the most a "
                         "Unix socket path may have; use a shorter run directory")
    store = run_dir / "model_store"
    build_archive(store, **({"config_file": config_file} if config_file else {}))
    props = run_dir / "config.properties"
    props.write_text(_properties(host, port, store, tmp_dir, workflow_store))
    env = {**os.environ, **(extra_env or {})}
    # Journal per instance, kept across restarts of that instance (crash recovery); /dev/shm is RAM.
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else run_dir
    own_journal = "RESIDENT_JOURNAL_DIR" not in env
    if own_journal:
        env["RESIDENT_JOURNAL_DIR"] = str(default_journal_dir(shm, port))
    env.update({
        "RESIDENT_HEARTBEAT_FILE": str(run_dir / "heartbeat"),  # the watchdog's liveness signal
        "RESIDENT_INIT_ERROR_FILE": str(run_dir / INIT_ERROR_FILE),  # wait_ready's start-up failure signal
        "TMPDIR": str(run_dir / "tmp"),  # TorchServe's pid file lives here: one per instance
        "LOG_LOCATION": str(run_dir / "logs"), "METRICS_LOCATION": str(run_dir / "logs"),
        "RESIDENT_MODEL_PATH": str(Path(model_path).resolve()),
        "TS_DECODE_INPUT_REQUEST": "false",  # hand the handler raw bytes; it parses and reports bad JSON
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    cmd = [bin_path("torchserve"), "--start", "--foreground", "--ncs", "--disable-token-auth",
           "--ts-config", str(props), "--model-store", str(store), "--models", f"{MODEL_NAME}={MODEL_NAME}"]
    for stale in ("heartbeat", INIT_ERROR_FILE):  # a previous run's, in the same run dir
        (run_dir / stale).unlink(missing_ok=True)
    relay = DescribeRelay(host, port + 1, str(socket_path), MODEL_NAME).start()
    process = _launch(cmd, run_dir, env, stdout)
    journal_dir = env["RESIDENT_JOURNAL_DIR"] if own_journal else ""
    return TorchServe(process=process, port=port, run_dir=run_dir, host=host, env=env, cmd=cmd, stdout=stdout,
                      guard=_guard(process, journal_dir), journal_dir=journal_dir, relay=relay)


def _private_dir(path: Path) -> Path:
    """``path``, made if missing, readable by us alone: it holds the management socket and the worker
    sockets (tmp/) or stays empty (the workflow store, so no workflow can be found in it)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def default_journal_dir(root: Path, port: int) -> Path:
    """The instance's journal when RESIDENT_JOURNAL_DIR is not set: ``<root>/resident-journal-<port>``, made
    here (0700) so that no one can make it first before the worker opens it. Anyone may create names in
    /dev/shm: what another user (or anything but our own directory) holds at that name is left alone and
    a fresh private directory beside it is used, with a warning, rather than fail the start."""
    path = root / f"resident-journal-{port}"
    try:
        path.mkdir(mode=0o700)
        return path
    except FileExistsError:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            return path  # ours: kept by a restart, or left by an earlier run
    fresh = Path(tempfile.mkdtemp(prefix=f"resident-journal-{port}-", dir=root))
    logger.warning("%s is not a directory of ours (uid %d owns it); journaling to %s instead", path, info.st_uid,
                   fresh)
    return fresh


def _guard(process: subprocess.Popen, journal_dir: str) -> subprocess.Popen:
    """launch/guard.py for this instance: its own session, our pipe on its stdin."""
    return subprocess.Popen([sys.executable, "-m", "launch.guard", str(process.pid), str(STOP_TIMEOUT_S), journal_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _launch(cmd: list[str], run_dir: Path, env: dict, stdout) -> subprocess.Popen:
    # A new session: the instance is its own process group, which stop() kills as a whole.
    return subprocess.Popen(cmd, cwd=run_dir, env=env, start_new_session=True,
                            stdout=stdout, stderr=subprocess.STDOUT if stdout else None)


def _properties(host: str, port: int, store: Path, tmp_dir: Path, workflow_store: Path) -> str:
    base = (REPO / "config.properties").read_text().splitlines()
    overrides = {
        "inference_address": f"http://{host}:{port}",
        "management_address": f"unix:{tmp_dir / MANAGEMENT_SOCKET}",  # our uid alone: launch/management.py
        "metrics_address": f"http://{host}:{port + 2}",
        "grpc_inference_address": UNREACHABLE_ADDRESS,
        "grpc_inference_port": str(port + 3),
        "grpc_management_address": UNREACHABLE_ADDRESS,
        "grpc_management_port": str(port + 4),
        "model_store": str(store),
        "workflow_store": str(workflow_store),
        "metrics_config": str(REPO / "model_store" / "metrics.yaml"),
        # Java's temp dir holds the worker sockets (/.ts.sock.<n>): one per instance, or two clash.
        "vmargs": f"-Djava.io.tmpdir={tmp_dir}",
    }
    lines = [line for line in base if line.split("=", 1)[0].strip() not in overrides]
    return "\n".join(lines + [f"{k}={v}" for k, v in overrides.items()]) + "\n"


def _stop_group(process: subprocess.Popen, timeout_s: float) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Workers may linger after the frontend exits: kill whatever is left in the group.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if process.poll() is None:
        process.wait(5)
