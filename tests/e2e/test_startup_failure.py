"""A model worker that raises in ``initialize`` stops ``make serve`` and ``make cluster`` within seconds,
with the worker's exception on stderr and a non-zero status, and leaves no TorchServe process behind
(TorchServe itself would start the worker again and again, and the launcher wait out
RESIDENT_STARTUP_TIMEOUT_S). The checkpoint is broken on purpose: its chat template raises on render,
which the launchers' config.json check cannot see and the engine's start-up does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.e2e

EXIT_BOUND_S = 120.0  # generous for a loaded 2-core machine; without the fix it waits out 900 s
PREFIX = "error: the model worker failed to start: "


@pytest.fixture
def broken_model(tiny_model_path, tmp_path) -> Path:
    """The tiny LLaVA whose chat template (its chat_template.jinja) raises whatever it renders."""
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_path, model)
    (model / "chat_template.jinja").write_text("{{ raise_exception('broken on purpose') }}")
    return model


@dataclass
class Run:
    status: int
    stderr: str
    elapsed_s: float
    started: dict[int, psutil.Process] = field(default_factory=dict)  # pid -> every process the launcher started
    commands: dict[int, str] = field(default_factory=dict)  # pid -> its command line, as last read
    parents: dict[int, int] = field(default_factory=dict)  # pid -> its parent's pid


def launch(command: str, env: dict[str, str], tmp_path: Path) -> Run:
    """Run ``python -m launch <command>`` until it exits, recording its descendants while it runs.
    Whatever of them is left at the end is killed by PID."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("PORT", "SAGEMAKER_BIND_TO_PORT", "BACKENDS", "MODEL", "HOST", "RESIDENT_BACKEND_PORT")}
    # Files, not pipes: TorchServe writes its logs to the launcher's stdout and stderr, and a full pipe blocks it.
    log, errors = open(tmp_path / "launcher.log", "w"), open(tmp_path / "launcher.err", "w")
    started = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "launch", command], cwd=REPO, env={**base, **env},
                                stdout=log, stderr=errors, start_new_session=True)
    run = Run(status=-1, stderr="", elapsed_s=0.0)
    try:
        while launcher.poll() is None and time.monotonic() - started < EXIT_BOUND_S:
            record_descendants(launcher.pid, run)
            time.sleep(0.2)
        run.elapsed_s = time.monotonic() - started
        assert launcher.poll() is not None, f"still running after {EXIT_BOUND_S}s; see {tmp_path}/launcher.log"
        run.status, run.stderr = launcher.returncode, (tmp_path / "launcher.err").read_text()
        print(f"python -m launch {command} exited with {run.status} after {run.elapsed_s:.1f}s")
        return run
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        for process in run.started.values():
            if process.is_running():  # false for a pid reused since: psutil compares start times
                process.kill()
        log.close()
        errors.close()


def record_descendants(pid: int, run: Run) -> None:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # exiting just now
        return
    for child in children:
        try:
            # read again at every sample: a child seen between fork and exec still carries its parent's
            # command line (the Java frontend, first seen so, would read as the ``torchserve`` wrapper)
            command = " ".join(child.cmdline())
            parent = run.parents.get(child.pid) or child.ppid()
        except psutil.Error:
            continue
        run.commands[child.pid], run.parents[child.pid] = command, parent
        run.started.setdefault(child.pid, child)


def error_line(run: Run) -> str:
    """The launcher's one line naming the worker's failure."""
    lines = [line for line in run.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


def assert_it_started_torchserve_and_left_nothing(run: Run, num_instances: int,
                                                  at_least: int | None = None) -> None:
    """``num_instances`` frontends started (``at_least``: at least that many and at most ``num_instances``:
    a later backend may still be preparing when the first failure stops them all), none left running."""
    # a frontend's own children (its Python workers) carry its command line between fork and exec: not counted
    frontends = [pid for pid, cmd in run.commands.items() if "org.pytorch.serve.ModelServer" in cmd
                 and "org.pytorch.serve.ModelServer" not in run.commands.get(run.parents[pid], "")]
    lowest = num_instances if at_least is None else at_least
    assert lowest <= len(frontends) <= num_instances, run.commands
    # The worker itself is not asserted seen: it may start and die between two samples of the process
    # tree (its error line and traceback, asserted by the callers, are what it leaves).
    gone, alive = psutil.wait_procs(list(run.started.values()), timeout=5)
    assert alive == [], [(p.pid, run.commands[p.pid]) for p in alive]


def test_serve_exits_at_once_with_the_workers_error(broken_model, tmp_path):
    port = free_port(15)  # the front on port, its backend on port+10 .. +14, run in build/serve-<port>
    run_dir = REPO / "build" / f"serve-{port}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "init-error.txt").write_text("StaleError: a previous run's, removed when the instance starts\n")
    run = launch("serve", {"MODEL": str(broken_model), "PORT": str(port)}, tmp_path)
    assert run.status == 1, run.stderr[-3000:]
    line = error_line(run)
    assert line.startswith(PREFIX + "ConfigError: the model's chat template renders neither list nor string")
    assert "TemplateError: broken on purpose" in line and "StaleError" not in line
    assert line.endswith(f"(see build/serve-{port}/logs/model_log.log)")
    assert "broken on purpose" in (run_dir / "logs" / "model_log.log").read_text()  # and the traceback
    assert "Traceback" in (run_dir / "init-error.txt").read_text()
    assert_it_started_torchserve_and_left_nothing(run, num_instances=1)


def test_cluster_stops_every_backend_at_the_first_failure(broken_model, tmp_path):
    port = free_port(30)  # the front on port, backend i on port+10+10*i .. +4
    run = launch("cluster", {"MODEL": str(broken_model), "PORT": str(port), "BACKENDS": "2",
                             "RESIDENT_THREADS": "1"}, tmp_path)
    assert run.status == 1, run.stderr[-3000:]
    line = error_line(run)
    assert "TemplateError: broken on purpose" in line, line
    assert f"(see build/cluster-{port}/backend-" in line and line.endswith("/logs/model_log.log)")
    # backend 1 may still be archiving its model when backend 0's worker fails: its frontend never starts
    assert_it_started_torchserve_and_left_nothing(run, num_instances=2, at_least=1)
