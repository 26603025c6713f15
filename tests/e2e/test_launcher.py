"""`make serve`'s launcher: SIGTERM stops everything it started, at any moment (DESIGN §8)."""

from __future__ import annotations

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
    port = free_port(5)
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
