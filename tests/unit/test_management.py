"""launch/management.py and the TorchServe settings that close what we do not use (issue #39): the
management API on a private Unix socket, relayed for describe only; gRPC where nothing connects."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import requests

from launch import management, torchserve
from launch.management import DescribeRelay
from tests.conftest import free_port


class _UnixHTTPServer(HTTPServer):
    address_family = socket.AF_UNIX

    def server_bind(self):
        self.socket.bind(self.server_address)

    def get_request(self):
        request, _ = self.socket.accept()
        return request, ("local", 0)


@pytest.fixture
def fake_management(tmp_path):
    """A stand-in for TorchServe's management socket: answers every request 200 and records it."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            seen.append((self.command, self.path))
            body = b'[{"workers": [{"status": "READY"}]}]'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args):
            pass

    path = str(tmp_path / "management.sock")
    server = _UnixHTTPServer(path, Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield path, seen
    server.shutdown()
    server.server_close()


def test_the_relay_forwards_describe_alone(fake_management):
    path, seen = fake_management
    port = free_port()
    relay = DescribeRelay("127.0.0.1", port, path, "llava").start()
    try:
        url = f"http://127.0.0.1:{port}"
        described = requests.get(f"{url}/models/llava", timeout=5)
        assert described.status_code == 200 and described.json()[0]["workers"][0]["status"] == "READY"
        assert requests.get(f"{url}/models/llava?customized=true", timeout=5).status_code == 200
        assert requests.put(f"{url}/models/llava?min_worker=2", timeout=5).status_code == 405
        assert requests.delete(f"{url}/models/llava", timeout=5).status_code == 405
        assert requests.post(f"{url}/workflows?url=file:///tmp/evil.war", timeout=5).status_code == 404
        assert requests.post(f"{url}/models?url=evil.mar", timeout=5).status_code == 404
        assert requests.get(f"{url}/models", timeout=5).status_code == 404
        assert requests.get(f"{url}/models/llava/1.0", timeout=5).status_code == 404
    finally:
        relay.stop()
    assert seen == [("GET", "/models/llava")] * 2  # the query is not forwarded


def test_the_relay_answers_503_while_torchserve_is_down(tmp_path):
    port = free_port()
    relay = DescribeRelay("127.0.0.1", port, str(tmp_path / "absent.sock"), "llava").start()
    try:
        assert requests.get(f"http://127.0.0.1:{port}/models/llava", timeout=5).status_code == 503
    finally:
        relay.stop()
        relay.stop()  # idempotent


def test_describe_reads_the_socket(fake_management):
    path, seen = fake_management
    assert management.describe(path, "llava") == (200, b'[{"workers": [{"status": "READY"}]}]')
    assert seen == [("GET", "/models/llava")]


def test_worker_statuses_read_the_management_socket(fake_management, tmp_path):
    path, _ = fake_management
    server = torchserve.TorchServe(process=None, port=1, run_dir=tmp_path)
    (tmp_path / "tmp").mkdir()
    Path(path).rename(server.management_socket)
    assert server.worker_statuses() == ["READY"]
    server.management_socket.unlink()
    assert server.worker_statuses() == []


def test_the_properties_close_management_grpc_and_workflows(tmp_path):
    props = dict(line.split("=", 1) for line in torchserve._properties(
        "127.0.0.1", 8090, tmp_path / "store", tmp_path / "tmp", tmp_path / "workflows").splitlines()
        if line and not line.startswith("#"))
    assert props["inference_address"] == "http://127.0.0.1:8090"
    assert props["management_address"] == f"unix:{tmp_path / 'tmp' / 'management.sock'}"
    assert props["metrics_address"] == "http://127.0.0.1:8092"
    assert (props["grpc_inference_address"], props["grpc_inference_port"]) == ("255.255.255.255", "8093")
    assert (props["grpc_management_address"], props["grpc_management_port"]) == ("255.255.255.255", "8094")
    assert props["workflow_store"] == str(tmp_path / "workflows")
    assert props["allowed_urls"] == "(?!)"
    assert props["enable_model_api"] == "false"
    assert props["use_native_io"] == "true"


def test_no_tcp_connection_reaches_the_grpc_address():
    """Why gRPC is bound there: the kernel refuses to connect TCP to a broadcast address."""
    with socket.socket() as listener:
        listener.bind((torchserve.UNREACHABLE_ADDRESS, 0))
        listener.listen()
        with socket.socket() as client, pytest.raises(OSError):
            client.settimeout(5)
            client.connect(listener.getsockname())


def test_private_dirs_are_ours_alone(tmp_path):
    made = torchserve._private_dir(tmp_path / "run" / "tmp")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o777)
    assert torchserve._private_dir(made).stat().st_mode & 0o777 == 0o700


def test_a_run_dir_too_long_for_the_socket_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(torchserve, "check_ports_free", lambda host, port: None)
    with pytest.raises(ValueError, match="shorter run directory"):
        torchserve.start_torchserve(8090, run_dir=tmp_path / ("x" * 120))
