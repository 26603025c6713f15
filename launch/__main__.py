"""``python -m launch serve``: one TorchServe instance in the foreground (``make serve``).
``python -m launch cluster``: N backends behind the front (``make cluster``; launch/cluster.py).
``python -m launch front``: the front alone, before RESIDENT_FRONT_BACKENDS.

PORT (default 8080) sets the inference port, SAGEMAKER_BIND_TO_PORT wins when set; MODEL names a
Hugging Face checkpoint directory (default: the demo LLaVA, built on first use); HOST the bind
address (default 127.0.0.1). Ctrl-C or SIGTERM stops everything it started; so does a model worker
that fails to start (status 1, its exception on stderr), at once rather than after
RESIDENT_STARTUP_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from launch.cluster import run_cluster, run_front
from launch.torchserve import (
    DEFAULT_MODEL,
    REPO,
    PortInUse,
    TorchServe,
    WorkerInitError,
    ensure_demo_models,
    start_torchserve,
)
from launch.watchdog import watch
from session.errors import ConfigError
from session.families.support import check_checkpoint


def serve_port() -> int:
    return int(os.environ.get("SAGEMAKER_BIND_TO_PORT") or os.environ.get("PORT") or 8080)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch")
    parser.add_argument("command", choices=["serve", "cluster", "front"])
    command = parser.parse_args(argv).command
    if command != "serve":
        return run_cluster(serve_port()) if command == "cluster" else run_front(serve_port())
    model = Path(os.environ["MODEL"]) if os.environ.get("MODEL") else DEFAULT_MODEL
    if not os.environ.get("MODEL"):
        ensure_demo_models()
    try:  # a checkpoint the engine cannot serve stops here, named, not in a TorchServe worker's crash loop
        check_checkpoint(model)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    port = serve_port()

    def shutdown(signum, frame):
        # Ignore further signals first: Ctrl-C in a terminal or a supervisor's group signal often comes
        # twice (make forwards it too), and a second SystemExit would cut the clean-up below short.
        for other in (signal.SIGTERM, signal.SIGINT):
            signal.signal(other, signal.SIG_IGN)
        raise SystemExit(0)  # unwinds through the finally below, whatever the launcher was doing

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        server = start_torchserve(port, run_dir=REPO / "build" / f"serve-{port}", model_path=model,
                                  host=os.environ.get("HOST", "127.0.0.1"))
    except PortInUse as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    watchdog = None
    try:
        server.wait_ready(timeout_s=float(os.environ.get("RESIDENT_STARTUP_TIMEOUT_S", "900")))
        watchdog = watch(server, os.environ)
        print(f"serving {model} on {server.url} (logs: {server.run_dir}/logs); Ctrl-C stops", flush=True)
        return wait_for_exit(server)
    except WorkerInitError as exc:  # TorchServe would start the worker again and again: stop instead
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        if watchdog is not None:
            watchdog.stop()
        server.stop()


def wait_for_exit(server: TorchServe) -> int:
    """Until TorchServe exits (its status) or a watchdog restart's worker fails to start (raises
    WorkerInitError). The watchdog may replace the process: wait for whichever is current."""
    while True:
        process = server.process
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            if (failure := server.init_failure()) is not None:
                raise failure from None
            continue
        if process is server.process:
            return process.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
