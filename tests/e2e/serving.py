"""``python -m launch serve`` (``make serve``) as a test fixture: started on free ports, ready once it
says "serving ", stopped by SIGTERM (exit 0 asserted), else killed by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO, free_port

READY_S = 240.0  # generous for a loaded 2-core machine
STOP_S = 30.0
# Settings of the caller's environment that would change what the test starts.
_OWN = ("PORT", "SAGEMAKER_BIND_TO_PORT", "HOST", "MODEL", "BACKENDS", "RESIDENT_BACKEND_PORT",
        "RESIDENT_SERVED_MODEL_NAME", "RESIDENT_MAX_CONTEXT_TOKENS")


@contextlib.contextmanager
def launched_serve(log_dir: Path, **environ: str) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:<port>``) of a running ``launch serve`` with ``environ`` set."""
    port = free_port(15)  # the front on port, its backend on port+10 .. +14
    env = {k: v for k, v in os.environ.items() if k not in _OWN}
    env.update(environ, PORT=str(port))
    log_path = log_dir / "serve.log"
    with open(log_path, "w") as log:  # a file, not a pipe: TorchServe's logs must never block on a reader
        launcher = subprocess.Popen([sys.executable, "-m", "launch", "serve"], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while "serving " not in log_path.read_text():
            assert launcher.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time: " + log_path.read_text()[-3000:]
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(STOP_S) == 0
    finally:
        if launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
