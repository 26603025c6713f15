"""TorchServe's management API, for this launcher alone, and the one read it relays.

TorchServe 0.12 answers its management API to whoever connects: ``POST /workflows?url=file://...``
starts a worker that imports the caller's handler, ``PUT /models/llava?min_worker=...`` scales
workers, and ``enable_model_api=false`` covers neither. There is no switch to turn the API off, so
launch/torchserve.py binds it to a Unix socket in the instance's private directory (0700): another
user's process cannot connect (TorchServe's gRPC ports, which cannot be turned off either, sit on an
address no TCP connection reaches: see ``_properties`` there).

Who reads it: ``describe`` (the launcher's ``wait_ready`` and the watchdog, through
``TorchServe.worker_statuses``). The front reads a backend's worker statuses over HTTP from its
``management_url``; a ``DescribeRelay`` answers that one read, ``GET /models/<model>``, on
``127.0.0.1:<port+1>`` and refuses everything else (404 for another path, 405 for another method).
"""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, NUL included


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout_s: float):
        super().__init__("localhost", timeout=timeout_s)
        self.socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def request(socket_path: str, method: str, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """One HTTP request to the management API on ``socket_path``: (status, body). Raises OSError or
    http.client.HTTPException when it cannot be asked."""
    connection = _UnixConnection(socket_path, timeout_s)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def describe(socket_path: str, model_name: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    return request(socket_path, "GET", f"/models/{model_name}", timeout_s)


class DescribeRelay:
    """``GET /models/<model>`` on TCP, read from the management socket; nothing else.

    Started by ``start_torchserve``, stopped by ``TorchServe.stop``; it outlives the instance's
    restarts (the socket path stays the same). Each request runs on its own thread."""

    def __init__(self, host: str, port: int, socket_path: str, model_name: str):
        self.socket_path = socket_path
        self.model_name = model_name
        self._server = ThreadingHTTPServer((host, port), _relay_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"describe-relay-{port}",
                                        daemon=True)

    def start(self) -> DescribeRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def answer(self, method: str, path: str) -> tuple[int, bytes]:
        if urlsplit(path).path != f"/models/{self.model_name}":  # a query is dropped: only the plain describe
            return 404, b'{"code": 404, "message": "not relayed: only GET /models/<model> is"}'
        if method != "GET":
            return 405, b'{"code": 405, "message": "the management API is not served here"}'
        try:
            return describe(self.socket_path, self.model_name)
        except (OSError, http.client.HTTPException):
            return 503, b'{"code": 503, "message": "TorchServe is not answering"}'


def _relay_handler(relay: DescribeRelay) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            status, body = relay.answer(self.command, self.path)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _reply  # any other method: 501

        def log_message(self, format, *args) -> None:  # the front probes every few seconds: no log line each
            pass

    return Handler
