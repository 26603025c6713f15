"""``python -m launch serve``: one TorchServe instance in the foreground (``make serve``).

PORT (default 8080) sets the inference port, SAGEMAKER_BIND_TO_PORT wins when set; MODEL names a
Hugging Face checkpoint directory (default: the demo LLaVA, built on first use); HOST the bind
address (default 127.0.0.1). Ctrl-C or SIGTERM stops everything it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from launch.torchserve import DEFAULT_MODEL, REPO, ensure_demo_models, start_torchserve


def serve_port() -> int:
    return int(os.environ.get("SAGEMAKER_BIND_TO_PORT") or os.environ.get("PORT") or 8080)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch")
    parser.add_argument("command", choices=["serve"])
    parser.parse_args(argv)
    model = Path(os.environ["MODEL"]) if os.environ.get("MODEL") else DEFAULT_MODEL
    if not os.environ.get("MODEL"):
        ensure_demo_models()
    port = serve_port()
    server = start_torchserve(port, run_dir=REPO / "build" / f"serve-{port}", model_path=model,
                              host=os.environ.get("HOST", "127.0.0.1"))

    def shutdown(signum, frame):
        server.stop()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(f"serving {model} on {server.url} (logs: {server.run_dir}/logs); Ctrl-C stops", flush=True)
    server.process.wait()
    server.stop()
    return server.process.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
