"""Start one TorchServe instance serving the resident handler, and stop everything it started.

Used by ``make serve``, by end-to-end tests and by benchmarks. Each instance gets its own run
directory: its config.properties (addresses on 127.0.0.1 by default), logs, and TMPDIR, because
TorchServe keeps a pid file in the temp directory and refuses to start a second instance that
shares it. Stopping kills the instance's whole process group by PID: TorchServe's async workers
can outlive ``torchserve --stop``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class TorchServe:
    """A running instance. ``port`` serves inference; management, metrics and gRPC use port+1 .. port+4."""

    process: subprocess.Popen
    port: int
    run_dir: Path
    host: str = "127.0.0.1"
    env: dict = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    stdout: object = None
    num_restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def management_url(self) -> str:
        return f"http://{self.host}:{self.port + 1}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.port + 2}"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Block until the model's worker is READY (TorchServe's /ping says Healthy before that)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"TorchServe exited with {self.process.returncode}; see {self.run_dir}/logs")
            if self.worker_statuses() == ["READY"]:
                return
            time.sleep(0.5)
        raise TimeoutError(f"TorchServe on port {self.port} not ready after {timeout_s}s; see {self.run_dir}/logs")

    def worker_statuses(self) -> list[str]:
        """Status of each worker of the model, from the management API ([] while unreachable)."""
        try:
            with urllib.request.urlopen(f"{self.management_url}/models/{MODEL_NAME}", timeout=2) as response:
                described = json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return []
        return [w.get("status", "") for w in described[0].get("workers", [])]

    def worker_pids(self) -> list[int]:
        """PIDs of the Python workers (children of the Java frontend)."""
        import psutil

        try:
            return [p.pid for p in psutil.Process(self.process.pid).children(recursive=True)
                    if "model_service_worker" in " ".join(p.cmdline())]
        except psutil.Error:
            return []

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the instance's process group, then SIGKILL what is left. Idempotent."""
        _stop_group(self.process, timeout_s)

    def restart(self) -> None:
        """Stop everything and start the same instance again (same ports, run dir and journal)."""
        self.stop()
        self.process = _launch(self.cmd, self.run_dir, self.env, self.stdout)
        self.num_restarts += 1


def start_torchserve(port: int, *, run_dir: Path, model_path: Path | str = DEFAULT_MODEL, host: str = "127.0.0.1",
                     extra_env: dict[str, str] | None = None, config_file: Path | None = None,
                     stdout=None) -> TorchServe:
    run_dir = Path(run_dir).resolve()
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    store = run_dir / "model_store"
    build_archive(store, **({"config_file": config_file} if config_file else {}))
    props = run_dir / "config.properties"
    props.write_text(_properties(host, port, store, run_dir / "tmp"))
    env = {**os.environ, **(extra_env or {})}
    # Journal per instance, kept across restarts of that instance (crash recovery); /dev/shm is RAM.
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else run_dir
    env.setdefault("RESIDENT_JOURNAL_DIR", str(shm / f"resident-journal-{port}"))
    env.update({
        "TMPDIR": str(run_dir / "tmp"),  # TorchServe's pid file lives here: one per instance
        "LOG_LOCATION": str(run_dir / "logs"), "METRICS_LOCATION": str(run_dir / "logs"),
        "RESIDENT_MODEL_PATH": str(Path(model_path).resolve()),
        "TS_DECODE_INPUT_REQUEST": "false",  # hand the handler raw bytes; it parses and reports bad JSON
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    cmd = [bin_path("torchserve"), "--start", "--foreground", "--ncs", "--disable-token-auth",
           "--ts-config", str(props), "--model-store", str(store), "--models", f"{MODEL_NAME}={MODEL_NAME}"]
    return TorchServe(process=_launch(cmd, run_dir, env, stdout), port=port, run_dir=run_dir, host=host, env=env,
                      cmd=cmd, stdout=stdout)


def _launch(cmd: list[str], run_dir: Path, env: dict, stdout) -> subprocess.Popen:
    # A new session: the instance is its own process group, which stop() kills as a whole.
    return subprocess.Popen(cmd, cwd=run_dir, env=env, start_new_session=True,
                            stdout=stdout, stderr=subprocess.STDOUT if stdout else None)


def _properties(host: str, port: int, store: Path, tmp_dir: Path) -> str:
    base = (REPO / "config.properties").read_text().splitlines()
    overrides = {
        "inference_address": f"http://{host}:{port}",
        "management_address": f"http://{host}:{port + 1}",
        "metrics_address": f"http://{host}:{port + 2}",
        "grpc_inference_address": host,
        "grpc_inference_port": str(port + 3),
        "grpc_management_address": host,
        "grpc_management_port": str(port + 4),
        "model_store": str(store),
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
