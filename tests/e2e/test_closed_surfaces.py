"""End to end: TorchServe's surfaces we do not use are closed to every other local process (issue #39).

A real TorchServe on 127.0.0.1; the attacker is another process, run as another user (``nobody``)
where the test runs as root. It tries what worked before: register a workflow whose archive names
its own handler, register a model, scale our model's workers, reach gRPC. Each is refused or
unreachable, while /ping and /predictions still answer and the model keeps its one worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import psutil
import pytest
import requests

from launch import management
from launch.torchserve import MODEL_NAME, start_torchserve
from tests.conftest import free_port, image_url

pytestmark = pytest.mark.e2e

TIMEOUT = 60
NOBODY = 65534

# Run as the other local process: prints {attempt: HTTP status or the OSError's name}.
ATTACKER = r"""
import http.client, json, socket, sys

args = json.loads(sys.argv[1])

def http_status(port, method, path):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        return connection.getresponse().status
    except OSError as exc:
        return type(exc).__name__
    finally:
        connection.close()

def connect(family, address):
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(address)
        return "connected"
    except OSError as exc:
        return type(exc).__name__
    finally:
        sock.close()

results = {}
for name, port in (("management", args["port"] + 1), ("inference", args["port"])):
    results[name + " POST /workflows"] = http_status(port, "POST", "/workflows?url=file://" + args["war"])
    results[name + " POST /models"] = http_status(port, "POST", "/models?url=file://" + args["war"] + "&model_name=evil")
    results[name + " PUT scale"] = http_status(port, "PUT", "/models/llava?min_worker=2&max_worker=2")
    results[name + " DELETE model"] = http_status(port, "DELETE", "/models/llava")
results["management socket"] = connect(socket.AF_UNIX, args["socket"])
for host, port in args["listeners"]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    results["listener %s:%d" % (host, port)] = connect(family, (host, port))
for port in (args["port"] + 3, args["port"] + 4):
    results["gRPC 127.0.0.1:%d" % port] = connect(socket.AF_INET, ("127.0.0.1", port))
print(json.dumps(results))
"""


def evil_workflow(directory) -> tuple[str, str]:
    """A workflow archive whose handler would write a marker file: (archive path, marker path)."""
    directory.mkdir()
    marker = directory / "handler-ran"
    war = directory / "evil.war"
    with zipfile.ZipFile(war, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"workflow": {"workflowName": "evil",
                                                                          "specFile": "spec.yaml",
                                                                          "handler": "handler.py"}}))
        archive.writestr("spec.yaml", "models:\n  evil:\n    url: evil.mar\ndag:\n  evil: []\n")
        archive.writestr("handler.py", f"open({str(marker)!r}, 'w').write('ran')\n")
    return str(war), str(marker)


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """Every TCP address the TorchServe process tree listens on."""
    root = psutil.Process(pid)
    return sorted({(c.laddr.ip, c.laddr.port) for p in [root, *root.children(recursive=True)]
                   for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def attacker() -> tuple[str, dict]:
    """The attacker's interpreter and user: the system's python3 as ``nobody`` where we are root (the
    venv may not be readable by nobody), else ourselves."""
    system_python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if os.geteuid() == 0 and system_python:
        return system_python, {"user": NOBODY, "group": NOBODY}
    return sys.executable, {}


def attack(args: dict) -> dict:
    python, as_other_user = attacker()
    done = subprocess.run([python, "-c", ATTACKER, json.dumps(args)], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd="/", **as_other_user)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_no_other_process_registers_scales_or_reaches_grpc(tiny_model_path, tmp_path):
    port = free_port(5)
    war, marker = evil_workflow(tmp_path / "attacker")
    with open(tmp_path / "torchserve.log", "w") as log:
        server = start_torchserve(port, run_dir=tmp_path / "run", stdout=log)
        try:
            server.wait_ready(timeout_s=240)
            listeners = tcp_listeners(server.process.pid)
            exposed = [(ip, p) for ip, p in listeners if p not in (port, port + 2)]  # not inference, metrics
            assert {p for _, p in exposed} == {port + 3, port + 4}  # gRPC; management is a Unix socket
            results = attack({"port": port, "war": war, "socket": str(server.management_socket),
                              "listeners": exposed})

            for name in ("management", "inference"):
                assert results[f"{name} POST /workflows"] in (404, 405), results
                assert results[f"{name} POST /models"] in (404, 405), results
                assert results[f"{name} PUT scale"] in (404, 405), results
                assert results[f"{name} DELETE model"] in (404, 405), results
            for ip, p in exposed:
                assert results[f"listener {ip}:{p}"] == "OSError", results  # ENETUNREACH
            assert results[f"gRPC 127.0.0.1:{port + 3}"] == "ConnectionRefusedError", results
            assert results[f"gRPC 127.0.0.1:{port + 4}"] == "ConnectionRefusedError", results
            if attacker()[1]:  # the attacker ran as another user
                assert results["management socket"] == "PermissionError", results

            # Our own uid, on the socket: still no workflow (no URL is allowed, the store is empty)
            # and no model registration.
            status, _ = management.request(str(server.management_socket), "POST", f"/workflows?url=file://{war}")
            assert status == 404
            status, _ = management.request(str(server.management_socket), "POST", "/workflows?url=evil.war")
            assert status == 404
            status, _ = management.request(str(server.management_socket), "POST", f"/models?url=file://{war}")
            assert status == 405

            # What we use still works: ping, predictions, the describe the front and watchdog read.
            ping = requests.get(f"{server.url}/ping", timeout=TIMEOUT)
            assert ping.status_code == 200 and ping.json()["status"] == "Healthy"
            content = [{"type": "image_url", "image_url": {"url": image_url(1)}}, {"type": "text", "text": "Hi"}]
            answer = requests.post(f"{server.url}/predictions/{MODEL_NAME}", timeout=TIMEOUT,
                                   json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            described = requests.get(f"{server.management_url}/models/{MODEL_NAME}", timeout=TIMEOUT).json()
            assert described[0]["minWorkers"] == 1 and len(described[0]["workers"]) == 1
            assert server.worker_statuses() == ["READY"]
            assert not os.path.exists(marker)
        finally:
            server.stop()
