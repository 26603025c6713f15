"""``python -m launch serve``: the front before one TorchServe backend, in the foreground (``make serve``).
``python -m launch cluster``: the front before N backends (``make cluster``; launch/cluster.py).
``python -m launch front``: the front alone, before RESIDENT_FRONT_BACKENDS.

PORT (default 8080) sets the front's port, SAGEMAKER_BIND_TO_PORT wins when set; the backends listen
on 127.0.0.1 from RESIDENT_BACKEND_PORT (default PORT+10). MODEL names a Hugging Face checkpoint
directory or a GGUF file (default: the demo LLaVA, built on first use); HOST the front's bind address
(default 127.0.0.1). Ctrl-C or SIGTERM stops everything it started; so does a model worker that fails
to start (status 1, its exception on stderr), at once rather than after RESIDENT_STARTUP_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import os
import sys

from launch.cluster import run_cluster, run_front


def serve_port() -> int:
    return int(os.environ.get("SAGEMAKER_BIND_TO_PORT") or os.environ.get("PORT") or 8080)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch")
    parser.add_argument("command", choices=["serve", "cluster", "front"])
    command = parser.parse_args(argv).command
    if command == "front":
        return run_front(serve_port())
    return run_cluster(serve_port(), single=command == "serve")


if __name__ == "__main__":
    sys.exit(main())
