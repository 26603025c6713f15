"""``python -m launch cluster``: N TorchServe backends behind the front, in the foreground
(``make cluster``, and the container's ``serve``). ``python -m launch serve`` (``make serve``): the
same with one backend, run in build/serve-<PORT>, and the front listening once it is ready.
``python -m launch front``: the front alone, before backends listed in RESIDENT_FRONT_BACKENDS
(docker/compose.yaml's router).

Environment (besides RESIDENT_FRONT_* for the front, session/front/server.py, and RESIDENT_* for the engine):
  PORT, SAGEMAKER_BIND_TO_PORT  the front's port (default 8080; SAGEMAKER_BIND_TO_PORT wins)
  HOST                          the front's bind address (default 127.0.0.1; 0.0.0.0 in a container)
  BACKENDS                      number of backends (default 2), or "auto": one per visible device
  MODEL                         a Hugging Face checkpoint directory (default: the demo LLaVA)
  RESIDENT_BACKEND_PORT         backend i listens on this + 10*i (using 5 ports from there) on
                                127.0.0.1; default: the start of SAGEMAKER_SAFE_PORT_RANGE, else PORT+10
  RESIDENT_INSTANCE_TAG         letters/digits put before every backend's session id tag, so that a
                                router before several instances can tell them apart (docker/compose.yaml)
Backend i creates session ids ``<uuid4>-<instance tag>b<i>`` (RESIDENT_SESSION_ID_TAG), so that any
front, restarted or a replica, routes a session by its id alone (docs/ROUTING.md).
On a CUDA machine backend i gets RESIDENT_DEVICE=cuda:<i mod #GPUs>; on a Neuron one
NEURON_RT_VISIBLE_CORES=<i mod #cores>; on CPU the cores are shared out with RESIDENT_MAX_THREADS (each
backend's thread tuner measures 1 thread and its share, so it falls back to 1 when a neighbour takes a
core). RESIDENT_DEVICE / RESIDENT_THREADS / RESIDENT_MAX_THREADS set by the caller are passed to every
backend unchanged; a RESIDENT_JOURNAL_DIR becomes <dir>/backend-<i>, one journal per backend.

The front's ``GET /v1/models`` lists the model under the name the backends serve it
(RESIDENT_SERVED_MODEL_NAME, else the checkpoint's folder name) with its context length
(RESIDENT_MAX_CONTEXT_TOKENS, at most the checkpoint's max_position_embeddings), read here from the
checkpoint's config as the engine reads them.

The admin token the front and its backends share (RESIDENT_ADMIN_TOKEN, else a fresh one per run) is
written to build/cluster-<PORT>/admin-token (``serve``: build/serve-<PORT>/admin-token; mode 0600)
for ``POST /backends/{i}/drain`` and ``/restart`` (docs/ROUTING.md). ``python -m launch front`` takes it from RESIDENT_FRONT_ADMIN_TOKEN,
else from RESIDENT_ADMIN_TOKEN.

Ctrl-C or SIGTERM: the front stops listening and lets requests in flight finish
(RESIDENT_FRONT_DRAIN_S, 10 s), then every backend's process group is stopped by PID, in parallel,
within SageMaker's 30 s grace. Should every backend process exit, the front stops too (status 1), so
that a supervisor (SageMaker, compose) sees the failure rather than a front answering 503 forever.
Should a backend's model worker fail to start (it raised in ``initialize``) before it ever served,
everything stops at once (status 1, the worker's exception on stderr): the other backends load the
same checkpoint. One that served and fails only after a restart is left down alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from launch.torchserve import (
    DEFAULT_MODEL,
    MODEL_NAME,
    REPO,
    PortInUse,
    TorchServe,
    WorkerInitError,
    check_port_free,
    ensure_demo_models,
    start_torchserve,
)
from launch.watchdog import watch
from session.checkpoints import locate, reading_once
from session.config import EngineConfig
from session.errors import ConfigError
from session.families.support import check_checkpoint
from session.front.config import FrontConfig
from session.front.server import Front
from session.model.cpu_quota import usable_cores

logger = logging.getLogger("resident.cluster")

BACKEND_PORT_STRIDE = 10  # each TorchServe takes 5 ports (inference, management, metrics, 2 gRPC)
BACKEND_STOP_S = 12.0  # SIGTERM, then SIGKILL; drain (10 s) + this stays under SageMaker's 30 s


@dataclass(frozen=True)
class Devices:
    kind: str  # cuda | neuron | cpu
    count: int


def visible_devices() -> Devices:
    """The accelerators this process may use; called once at start-up."""
    if shutil.which("nvidia-smi"):  # the NVIDIA container runtime mounts it with the driver
        probe = _run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"])
        if probe and probe.strip().isdigit() and int(probe) > 0:
            return Devices("cuda", int(probe))
    if shutil.which("neuron-ls"):
        probe = _run(["neuron-ls", "--json-output"])
        try:
            num_cores = sum(int(device.get("nc_count", 0)) for device in json.loads(probe or "[]"))
        except (ValueError, TypeError, AttributeError):
            num_cores = 0
        if num_cores > 0:
            return Devices("neuron", num_cores)
    return Devices("cpu", 1)


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def num_backends(value: str, devices: Devices) -> int:
    if value.strip().lower() == "auto":
        return devices.count
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"BACKENDS must be a positive number or 'auto', got {value!r}")
    return int(value)


def admin_token(environ: Mapping[str, str]) -> str:
    """The secret the front and its backends share for the adapter API (one per cluster run)."""
    global _ADMIN_TOKEN
    if environ.get("RESIDENT_ADMIN_TOKEN"):
        return environ["RESIDENT_ADMIN_TOKEN"]
    if _ADMIN_TOKEN is None:
        _ADMIN_TOKEN = secrets.token_hex(16)
    return _ADMIN_TOKEN


_ADMIN_TOKEN: str | None = None


def session_id_tag(index: int, environ: Mapping[str, str]) -> str:
    """Backend ``index``'s RESIDENT_SESSION_ID_TAG: ``<RESIDENT_INSTANCE_TAG>b<index>``."""
    prefix = environ.get("RESIDENT_INSTANCE_TAG", "")
    if not re.fullmatch(r"[A-Za-z0-9]*", prefix):
        raise ConfigError(f"RESIDENT_INSTANCE_TAG must be letters and digits, got {prefix!r}")
    return f"{prefix}b{index}"


def backend_env(index: int, num: int, devices: Devices, environ: Mapping[str, str]) -> dict[str, str]:
    """Settings for backend ``index`` of ``num``: the tag its session ids carry, its device, or its
    share of the CPU cores, and its own crash-recovery journal (a restarted backend must restore its
    own sessions, not all of them)."""
    env: dict[str, str] = {"RESIDENT_SESSION_ID_TAG": session_id_tag(index, environ)}
    if environ.get("RESIDENT_JOURNAL_DIR"):
        env["RESIDENT_JOURNAL_DIR"] = str(Path(environ["RESIDENT_JOURNAL_DIR"]) / f"backend-{index}")
    if devices.kind == "cuda" and "RESIDENT_DEVICE" not in environ:
        env["RESIDENT_DEVICE"] = f"cuda:{index % devices.count}"
    elif devices.kind == "neuron":
        env["NEURON_RT_VISIBLE_CORES"] = str(index % devices.count)
    elif devices.kind == "cpu" and not {"RESIDENT_THREADS", "RESIDENT_MAX_THREADS"} & environ.keys():
        # a ceiling, not a count: a fixed count cannot leave a core a neighbour took (the tuner does)
        env["RESIDENT_MAX_THREADS"] = str(max(1, usable_cores() // num))  # affinity and container quota
    return env


def backend_base_port(front_port: int, environ: Mapping[str, str]) -> int:
    if environ.get("RESIDENT_BACKEND_PORT"):
        return int(environ["RESIDENT_BACKEND_PORT"])
    safe_range = environ.get("SAGEMAKER_SAFE_PORT_RANGE")  # e.g. "29000-29999": ports we may bind
    if safe_range:
        return int(safe_range.split("-")[0])
    return front_port + BACKEND_PORT_STRIDE


def served_model(model: Path, environ: Mapping[str, str]) -> tuple[str, int]:
    """(The name the backends serve ``model`` under, its context length in tokens; 0 where the config
    gives none), for the front's ``/v1/models``: worked out as the engine does (``EngineConfig.model_name``;
    session/engine/assembly.py's ``max_context``) from the settings and the checkpoint's config alone."""
    import yaml
    from transformers import AutoConfig

    section = yaml.safe_load((REPO / "model_store" / "model-config.yaml").read_text()).get("handler", {})
    config = EngineConfig.from_sources(section, {**environ, "RESIDENT_MODEL_PATH": str(model.resolve())})
    checkpoint = locate(config.model_path)
    text_config = AutoConfig.from_pretrained(checkpoint.folder, **checkpoint.kwargs).get_text_config()
    max_positions = getattr(text_config, "max_position_embeddings", None) or 0
    if not max_positions:
        return config.model_name, config.max_context_tokens
    return config.model_name, min(config.max_context_tokens or max_positions, max_positions)


def start_backends(devices: Devices, *, front_port: int, model: Path, environ: Mapping[str, str],
                   run_dirs: list[Path], started: list[TorchServe]) -> None:
    """One backend per run directory, backend i on RESIDENT_BACKEND_PORT (else PORT+10) + 10*i, each
    appended to ``started`` as soon as it runs. The caller stops what ``started`` holds,
    whatever interrupts the start: a list of its own here would be lost with the exception that
    interrupted it, and a stop made here could itself be cut short by a second signal."""
    base = backend_base_port(front_port, environ)
    num = len(run_dirs)
    for i, run_dir in enumerate(run_dirs):
        env = {**backend_env(i, num, devices, environ), "RESIDENT_ADMIN_TOKEN": admin_token(environ)}
        with _stop_signals_held():  # the instance is in ``started`` before a stop can unwind past it
            started.append(start_torchserve(base + BACKEND_PORT_STRIDE * i, run_dir=run_dir,
                                            model_path=model, extra_env=env))
        logger.info("backend %d: %s on %s %s (logs: %s/logs)", i, started[-1].url, devices.kind,
                    " ".join(f"{k}={v}" for k, v in env.items() if "TOKEN" not in k), started[-1].run_dir)


def raise_init_failure(backends: list[TorchServe]) -> None:
    """Raise the first WorkerInitError of a backend that never started, if any: called every second
    while the front runs (through its ``backends_alive``), so that a checkpoint no worker can load
    stops the whole cluster within seconds of the first failure. A backend that served and then fails
    to come back from a restart (a one-off: out of memory, say) stops alone: its watchdog gives up on
    it, the front takes it out of rotation, and the others keep serving."""
    for backend in backends:
        if not backend.ever_ready and (failure := backend.init_failure()) is not None:
            raise failure


def stop_backends(backends: list[TorchServe]) -> None:
    """Stop every backend's process group (by PID), all at once."""
    if backends:
        with ThreadPoolExecutor(len(backends)) as pool:
            list(pool.map(lambda b: b.stop(timeout_s=BACKEND_STOP_S), backends))


class BackendRestarter:
    """Restarts one backend of a running cluster, for the front's ``POST /backends/{i}/restart`` (which
    drains it first and resumes it after). Its watchdog is stopped first, so that it does not restart
    the backend too; a new one watches it once TorchServe is ready again (same ports and journal)."""

    def __init__(self, backends: list[TorchServe], environ: Mapping[str, str]):
        self.backends = backends
        self.environ = environ
        self.watchdogs = {i: watch(b, environ) for i, b in enumerate(backends)}  # index -> Watchdog | None
        self._lock = threading.Lock()  # one restart at a time: a rolling restart, never two backends down

    def restart(self, index: int) -> None:
        """Blocking (minutes for a large model): the front runs it in a thread."""
        with self._lock:
            watchdog = self.watchdogs.pop(index, None)
            if watchdog is not None:
                watchdog.stop()
            backend = self.backends[index]
            try:
                logger.info("restarting backend %d (%s)", index, backend.url)
                backend.restart()
                backend.wait_ready(timeout_s=float(self.environ.get("RESIDENT_STARTUP_TIMEOUT_S", "900")))
            finally:
                self.watchdogs[index] = watch(backend, self.environ)

    @property
    def restarting(self) -> bool:
        return self._lock.locked()

    def stop(self) -> None:
        """Called before the backends are stopped: no watchdog restarts one after this."""
        with self._lock:
            for watchdog in self.watchdogs.values():
                if watchdog is not None:
                    watchdog.stop()


def write_admin_token(run_root: Path, token: str) -> Path:
    """The token where the operator (and only they) can read it: build/cluster-<PORT>/admin-token."""
    run_root.mkdir(parents=True, exist_ok=True)
    path = run_root / "admin-token"
    path.unlink(missing_ok=True)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return path


async def serve_front(config: FrontConfig, host: str, port: int,
                      backends_alive: Callable[[], bool] = lambda: True,
                      restart_backend: Callable[[int], None] | None = None, banner: str = "") -> bool:
    """Run the front until SIGTERM or SIGINT (True), or until no backend process is left (False). What
    ``backends_alive`` raises (a backend's WorkerInitError) stops the front and is raised here. The
    ``banner`` is printed once the front listens and has probed its backends."""
    front = Front(config, restart_backend=restart_backend)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Not loop.add_signal_handler: closing the loop resets what it took to SIG_DFL, and a SIGTERM
    # between then and the launcher's clean-up killed it with its TorchServe instances left running.
    # Replacing the handler and putting the previous one back leaves no moment without one.
    previous = {signum: signal.signal(signum, lambda *_: loop.call_soon_threadsafe(stop.set))
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        await front.start(host, port)
        if banner:
            await front.check_health()
            print(banner, flush=True)
        while not stop.is_set():
            if not backends_alive():
                logger.error("every backend process has exited; stopping (see the backends' logs)")
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
        logger.info("stopping: draining the front for up to %g s", config.drain_s)
        return True
    finally:
        await front.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve(config: FrontConfig, host: str, port: int, backends_alive: Callable[[], bool] = lambda: True,
           restart_backend: Callable[[int], None] | None = None, banner: str = "") -> int:
    """The front in the foreground; the exit status."""
    try:
        return 0 if asyncio.run(serve_front(config, host, port, backends_alive, restart_backend, banner)) else 1
    except OSError as exc:  # the port is taken, most often
        print(f"error: the front cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1


_held = False  # inside _stop_signals_held: a stop signal waits for the block to end
_pending = False  # one arrived meanwhile


def _interrupt(signum, frame):
    """SIGTERM or SIGINT before the front runs: unwind through the finally blocks, which stop what was
    started; inside ``_stop_signals_held``, once its block is done."""
    global _pending
    if _held:
        _pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_signals_held():
    """Hold a stop signal back until the block ends, then unwind from there. Around starting a
    TorchServe: raised between its spawn (inside ``Popen`` even, after the fork) and its place in the
    list the clean-up stops, the KeyboardInterrupt would lose the instance, and it would keep loading
    with no one to stop it (no guard either, when the guard was not spawned yet). Held for well
    under a second: the start spawns processes and returns, it does not wait for the model."""
    global _held, _pending
    _held, _pending = True, False
    try:
        yield
    except BaseException as exc:
        if not _pending:
            raise
        # the stop came first: a terminal's Ctrl-C reaches the whole group, so the archiver this block
        # runs may have died of the same signal; the stop, not its failure, is what unwinds
        raise KeyboardInterrupt from exc
    finally:
        _held = False
        pending, _pending = _pending, False
    if pending:
        raise KeyboardInterrupt


def run_cluster(port: int, environ: Mapping[str, str] = os.environ, *, single: bool = False) -> int:
    """Called by ``python -m launch cluster``, and with ``single`` by ``python -m launch serve``: one
    backend whatever BACKENDS says, in build/serve-<PORT> (its logs in build/serve-<PORT>/logs), and the
    front listens once that backend is ready. Returns the exit status."""
    _configure_logging()
    for signum in (signal.SIGTERM, signal.SIGINT):  # the front's event loop takes them over while it runs
        signal.signal(signum, _interrupt)
    backends: list[TorchServe] = []
    restarter: BackendRestarter | None = None
    try:
        model = Path(environ["MODEL"]) if environ.get("MODEL") else DEFAULT_MODEL
        if not environ.get("MODEL"):
            ensure_demo_models()
        with reading_once():  # a GGUF file: its header parsed once for both
            check_checkpoint(model)  # fail here, naming the feature, not in a TorchServe worker's crash loop
            served_name, max_model_len = served_model(model, environ)
        host = environ.get("HOST", "127.0.0.1")
        check_port_free(host, port, f"the front's, PORT={port}")  # now, not after the model loaded
        devices = visible_devices()
        num = 1 if single else num_backends(environ.get("BACKENDS", "2"), devices)
        run_root = REPO / "build" / f"{'serve' if single else 'cluster'}-{port}"
        run_dirs = [run_root] if single else [run_root / f"backend-{i}" for i in range(num)]
        start_backends(devices, front_port=port, model=model, environ=environ, run_dirs=run_dirs, started=backends)
        with _stop_signals_held():  # its watchdog threads run once made: the clean-up must know to stop them
            restarter = BackendRestarter(backends, environ)
        token_file = write_admin_token(run_root, admin_token(environ))
        config = FrontConfig.from_env(environ, backends=tuple(b.url for b in backends),
                                      management_urls=tuple(b.management_url for b in backends),
                                      model_name=MODEL_NAME, admin_token=admin_token(environ),
                                      backend_tags=tuple(session_id_tag(i, environ) for i in range(num)),
                                      served_model_name=served_name, max_model_len=max_model_len)
        if single:
            backends[0].wait_ready(timeout_s=float(environ.get("RESIDENT_STARTUP_TIMEOUT_S", "900")))
            banner = (f"serving {model} as {served_name!r} on http://{host}:{port} (the front before one "
                      f"TorchServe backend, {backends[0].url}; logs: {run_root}/logs); Ctrl-C stops")
        else:
            banner = (f"front on http://{host}:{port} before {num} backend(s) serving {model} as {served_name!r} "
                      f"(admin token in {token_file}); Ctrl-C stops")

        def alive() -> bool:  # a backend being restarted counts as alive
            raise_init_failure(backends)
            return restarter.restarting or any(b.process.poll() is None for b in backends)

        return _serve(config, host, port, alive, restarter.restart, banner)
    except KeyboardInterrupt:
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerInitError as exc:  # TorchServe would start the worker again and again: stop instead
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except PortInUse as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        if restarter is not None:
            restarter.stop()
        stop_backends(backends)
        logger.info("stopped")


def run_front(port: int, environ: Mapping[str, str] = os.environ) -> int:
    """Called by ``python -m launch front``: the front alone, backends from RESIDENT_FRONT_BACKENDS."""
    _configure_logging()
    shared = {"admin_token": environ["RESIDENT_ADMIN_TOKEN"]} \
        if environ.get("RESIDENT_ADMIN_TOKEN") and not environ.get("RESIDENT_FRONT_ADMIN_TOKEN") else {}
    try:
        config = FrontConfig.from_env(environ, **shared)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _serve(config, environ.get("HOST", "127.0.0.1"), port)


def _configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("RESIDENT_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
