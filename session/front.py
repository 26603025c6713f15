"""The front door: an aiohttp server that sends each session's requests to the backend holding it.

One front stands before N backends (TorchServe instances running our handler, one worker per
device; or, in docker/compose.yaml, other fronts standing in for SageMaker instances). It serves:

  GET  /ping                                            200 while a backend is healthy, else 503
  GET  /backends                                        each backend's health and counters (JSON)
  POST /invocations, /predictions/{model}               forwarded as they are (SSE streams relayed)
  POST /endpoints/{name}/invocations                    SageMaker InvokeEndpoint
  GET  /adapters, POST /adapters {"name", "src"}, DELETE /adapters/{name}
                                                        LoRA adapters on every backend at once (below)
  POST /endpoints/{name}/invocations-response-stream    SageMaker InvokeEndpointWithResponseStream:
       forwarded with "stream": true; each SSE chunk becomes a PayloadPart event as it arrives.
       It continues an existing session or serves a stateless request; it never opens a session.

Routing is ``session/router.py``. ``X-Amzn-SageMaker-*`` headers pass both ways; answers carry
``X-Resident-Backend: <backend index>``. Errors are ``{"error": {"type", "message"}}`` with their
status; on the ``/endpoints/...`` paths they also carry ``X-Amzn-ErrorType`` and a top-level
``message``, so that botocore's ClientError shows the type and message. A session whose backend is
down gets 410 ``session_backend_unavailable`` (open a new session); a stateless or new-session
request goes to another healthy backend when the first refuses the connection.

A request abandoned by the front on timeout keeps running on the backend (TorchServe's async mode
does not signal disconnects); the backend's own queue limit bounds that.

Adapters: the front sends an admin request (``X-Resident-Admin-Token``, a secret shared with its
backends) to every backend. Registering validates on each and rolls back where it succeeded if
one refuses; unregistering first asks every backend whether it may (a dry run: 409 while live
sessions use the adapter), then does it everywhere.

Settings: ``FrontConfig`` from ``RESIDENT_FRONT_*`` environment variables. Never imports ``ts``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from multidict import CIMultiDict

from session.errors import (
    BackendError, BackendTimeout, BadRequest, ConfigError, PayloadTooLarge, ResidentError,
)
from session.event_stream import CONTENT_TYPE as EVENT_STREAM, model_stream_error, payload_part
from session.protocol import (
    ADMIN_TOKEN_HEADER, NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER, header, load_json_object, sse, validate_session_id,
)
from session.router import Backend, Router

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("resident.front.access")

ENV_PREFIX = "RESIDENT_FRONT_"
BACKEND_HEADER = "X-Resident-Backend"  # which backend answered: its index in RESIDENT_FRONT_BACKENDS
ERROR_TYPE_HEADER = "X-Amzn-ErrorType"  # botocore reads an error's code from it
PAYLOAD_CONTENT_TYPE_HEADER = "X-Amzn-SageMaker-Content-Type"  # the streamed payload's own type
VARIANT_HEADER = "x-Amzn-Invoked-Production-Variant"
VARIANT = "AllTraffic"  # SageMaker's default production variant name
SSE_CONTENT_TYPE = "text/event-stream"
JSON_CONTENT_TYPE = "application/json"


@dataclass(frozen=True)
class FrontConfig:
    """Every field is set by ``RESIDENT_FRONT_<FIELD>``; lists are comma-separated."""

    backends: tuple[str, ...] = ()  # inference base URLs, e.g. http://127.0.0.1:9000
    management_urls: tuple[str, ...] = ()  # TorchServe management URLs, same order; empty: health = /ping
    model_name: str = "llava"  # the TorchServe model whose workers must be READY for a backend to be healthy
    timeout_s: float = 60.0  # an answer (a stream: its first and each next chunk) must come within this
    max_request_bytes: int = 6 * 1024 * 1024  # SageMaker's payload limit; larger requests get 413
    health_interval_s: float = 5.0  # between health probes of every backend
    health_timeout_s: float = 5.0  # for one probe, and for connecting to a backend
    unhealthy_after: int = 3  # failed probes in a row before a backend is taken out
    drain_s: float = 10.0  # on shutdown, how long requests in flight may finish (SIGKILL comes at 30 s)
    default_session_ttl_s: float = 1200.0  # pin lifetime when a backend's New-Session-Id has no Expires
    admin_token: str = ""  # shared with the backends (RESIDENT_ADMIN_TOKEN) for the /adapters API

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "FrontConfig":
        """Called once at start-up by the launcher (and by tests): environment, then overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if name in env:
                values[f.name] = _parse_setting(f.type, env[name], name)
        config = cls(**{**values, **overrides})
        config.validate()
        return config

    def validate(self) -> None:
        if not self.backends:
            raise ConfigError(f"set {ENV_PREFIX}BACKENDS to the backends' URLs, comma-separated")
        for url in self.backends + self.management_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{url!r} in {ENV_PREFIX}BACKENDS/MANAGEMENT_URLS is not an http(s) URL")
        if self.management_urls and len(self.management_urls) != len(self.backends):
            raise ConfigError(f"{ENV_PREFIX}MANAGEMENT_URLS has {len(self.management_urls)} URLs for "
                              f"{len(self.backends)} backends; give one per backend or none")
        for name in ("timeout_s", "max_request_bytes", "health_interval_s", "health_timeout_s", "unhealthy_after",
                     "default_session_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be > 0, got {getattr(self, name)}")
        if self.drain_s < 0:
            raise ConfigError(f"{ENV_PREFIX}DRAIN_S must be >= 0, got {self.drain_s}")


def _parse_setting(kind: str, raw: str, name: str) -> Any:
    if kind.startswith("tuple"):
        return tuple(part.strip().rstrip("/") for part in raw.split(",") if part.strip())
    try:
        return {"str": str, "int": int, "float": float}[kind](raw)
    except ValueError:
        raise ConfigError(f"{name} must be {kind}, got {raw!r}") from None


def split_sse(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events (each with its closing blank line) and the incomplete rest."""
    *events, rest = buffer.split(b"\n\n")
    return [event + b"\n\n" for event in events], rest


class _Unreachable(Exception):
    """The backend is not listening (refused, or reset and then failed a fresh probe)."""


class Front:
    """The front door. Built once by the launcher (``launch/cluster.py``) or a test; ``start`` binds
    and begins health checks, ``stop`` stops listening, lets requests in flight finish (up to
    ``drain_s``) and closes the connections to the backends."""

    def __init__(self, config: FrontConfig):
        self.config = config
        management = config.management_urls or (None,) * len(config.backends)
        self.router = Router([Backend(index=i, url=url, management_url=mgmt)
                              for i, (url, mgmt) in enumerate(zip(config.backends, management))],
                             unhealthy_after=config.unhealthy_after, default_ttl_s=config.default_session_ttl_s)
        # aiohttp refuses a body of client_max_size bytes or more; we allow exactly max_request_bytes.
        self.app = web.Application(client_max_size=config.max_request_bytes + 1, middlewares=[self._errors])
        self.app.router.add_get("/ping", self.ping)
        self.app.router.add_get("/backends", self.describe_backends)
        self.app.router.add_post("/invocations", self.invoke)
        self.app.router.add_post("/predictions/{model}", self.invoke)
        self.app.router.add_post("/endpoints/{endpoint}/invocations", self.invoke)
        self.app.router.add_post("/endpoints/{endpoint}/invocations-response-stream", self.invoke_stream)
        self.app.router.add_get("/adapters", self.list_adapters)
        self.app.router.add_post("/adapters", self.register_adapter)
        self.app.router.add_delete("/adapters/{name}", self.unregister_adapter)
        self._http: aiohttp.ClientSession | None = None  # requests to backends, kept alive
        self._probe_http: aiohttp.ClientSession | None = None  # health probes, a fresh connection each
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        self._probe_http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self._runner = web.AppRunner(self.app, access_log_class=AccessLogger, access_log=access_logger)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, shutdown_timeout=self.config.drain_s).start()
        self._health_task = asyncio.create_task(self._health_loop())
        logger.info("front listening on %s:%d for %d backend(s)", host, port, len(self.router.backends))

    @property
    def port(self) -> int:
        """The bound port (useful after ``start(host, 0)``)."""
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        for client in (self._http, self._probe_http):
            if client is not None:
                await client.close()

    # ------------------------------------------------------------ handlers

    async def ping(self, request: web.Request) -> web.Response:
        num_healthy = len(self.router.healthy_backends)
        status = 200 if num_healthy else 503
        return web.json_response({"status": "Healthy" if num_healthy else "Unhealthy",
                                  "healthy_backends": num_healthy, "backends": len(self.router.backends)},
                                 status=status)

    async def describe_backends(self, request: web.Request) -> web.Response:
        return web.json_response({"backends": [asdict(b) for b in self.router.backends],
                                  "num_sessions": len(self.router.pins)})

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        path = request.path if request.path.startswith("/predictions/") else "/invocations"
        return await self._forward(request, body, path, events=False)

    async def invoke_stream(self, request: web.Request) -> web.StreamResponse:
        data = load_json_object(await self._read_body(request))
        if _session_id(request) == NEW_SESSION or data.get("requestType") == NEW_SESSION:
            raise BadRequest("invocations-response-stream cannot open a session: open it with InvokeEndpoint "
                             f"({SESSION_HEADER}: {NEW_SESSION}), then stream within it")
        body = json.dumps({**data, "stream": True}).encode()
        return await self._forward(request, body, "/invocations", events=True)

    # ------------------------------------------------------------ adapters

    async def list_adapters(self, request: web.Request) -> web.Response:
        [(status, body)] = await self._admin_all({"adapters": "list"}, self.router.healthy_backends[:1])
        return web.json_response(body, status=status)

    async def register_adapter(self, request: web.Request) -> web.Response:
        data = load_json_object(await self._read_body(request))
        if set(data) - {"name", "src", "pinned"} or not isinstance(data.get("name"), str) \
                or not isinstance(data.get("src"), str):
            raise BadRequest('POST /adapters takes {"name": str, "src": "<PEFT adapter directory>", '
                             '"pinned": bool (optional)}')
        backends = self.router.healthy_backends
        answers = await self._admin_all({"adapters": "register", **data}, backends)
        failed = [(status, body) for status, body in answers if status != 200]
        if failed:  # keep every backend alike: undo where it worked
            done = [b for b, (status, _) in zip(backends, answers) if status == 200]
            if done:
                await self._admin_all({"adapters": "unregister", "name": data["name"]}, done)
            return web.json_response(failed[0][1], status=failed[0][0])
        return web.json_response({**answers[0][1], "backends": len(backends)})

    async def unregister_adapter(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        backends = self.router.healthy_backends
        for dry_run in (True, False):
            answers = await self._admin_all({"adapters": "unregister", "name": name, "dry_run": dry_run}, backends)
            failed = [(status, body) for status, body in answers if status != 200]
            if failed:
                return web.json_response(failed[0][1], status=failed[0][0])
        return web.json_response({"unregistered": name, "backends": len(backends)})

    async def _admin_all(self, payload: dict, backends: list[Backend]) -> list[tuple[int, dict]]:
        """One admin request to each backend, in parallel: [(status, JSON body)] in backend order."""
        if not self.config.admin_token:
            raise BadRequest(f"the adapter API is off: set {ENV_PREFIX}ADMIN_TOKEN and the backends' "
                             "RESIDENT_ADMIN_TOKEN to one secret (make cluster does)")
        if not backends:
            raise BackendError("no healthy backend to manage adapters on")
        headers = {"Content-Type": JSON_CONTENT_TYPE, ADMIN_TOKEN_HEADER: self.config.admin_token}
        body = json.dumps(payload).encode()

        async def one(backend: Backend) -> tuple[int, dict]:
            async with await self._send(backend, f"/predictions/{self.config.model_name}", body, headers) as upstream:
                payload = await upstream.read()
                return upstream.status, (json.loads(payload) if upstream.status == 200 else {"error": _error_of(payload)})

        return list(await asyncio.gather(*(one(b) for b in backends)))

    # ------------------------------------------------------------ forwarding

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_request_bytes
        too_large = PayloadTooLarge(f"request body is larger than {limit} bytes, the endpoint's payload limit "
                                    f"({ENV_PREFIX}MAX_REQUEST_BYTES)")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    async def _forward(self, request: web.Request, body: bytes, path: str, *, events: bool) -> web.StreamResponse:
        session_id = _session_id(request)
        pinned = session_id not in (None, NEW_SESSION)
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-amzn-sagemaker-")}
        headers["Content-Type"] = JSON_CONTENT_TYPE if events else request.headers.get("Content-Type",
                                                                                      JSON_CONTENT_TYPE)
        refused: list[Backend] = []
        while True:
            # A pinned session whose backend just went down makes route() raise SessionBackendUnavailable;
            # other requests try the next healthy backend until none is left (BackendUnavailable).
            backend = self.router.route(session_id) if pinned else self.router.pick(exclude=refused)
            self.router.acquire(backend)
            try:
                return await self._exchange(request, backend, path, body, headers, session_id, events)
            except _Unreachable:
                refused.append(backend)
            finally:
                self.router.release(backend)

    async def _exchange(self, request: web.Request, backend: Backend, path: str, body: bytes,
                        headers: dict[str, str], session_id: str | None, events: bool) -> web.StreamResponse:
        """One request to one backend, its answer relayed to the client; raises _Unreachable."""
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        async with await self._send(backend, path, body, headers) as upstream:
            if upstream.status == 200 and upstream.content_type == SSE_CONTENT_TYPE:
                self.router.record_answer(backend, session_id, upstream.status, upstream.headers)
                return await self._relay_stream(request, upstream, backend, events)
            payload = await self._read_answer(upstream, backend, deadline)
            error = _error_of(payload) if upstream.status >= 400 else None
            self.router.record_answer(backend, session_id, upstream.status, upstream.headers,
                                      error["type"] if error else None)
            out_headers = self._answer_headers(request, upstream, backend)
            if error is not None:
                return self._error_response(request, upstream.status, {"error": error}, out_headers)
            if events and upstream.status == 200:  # a JSON answer on the stream path (a CLOSE): one part
                return await self._single_part(request, payload, out_headers, upstream.content_type)
            return web.Response(status=upstream.status, body=payload, headers=out_headers)

    async def _send(self, backend: Backend, path: str, body: bytes,
                    headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST to the backend; returns once its status and headers are in."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.health_timeout_s,
                                        sock_read=self.config.timeout_s)
        try:
            return await self._http.post(backend.url + path, data=body, headers=headers, timeout=timeout)
        except asyncio.TimeoutError:
            raise BackendTimeout(f"backend {backend.index} did not answer within {self.config.timeout_s:g} s") \
                from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A kept-alive connection to a backend that has died fails as a reset, not a refusal.
            if not await self._alive(backend):
                if self.router.mark_down(backend):
                    logger.warning("backend %d (%s) is down: %s", backend.index, backend.url, exc)
                raise _Unreachable() from exc
            raise BackendError(f"backend {backend.index} dropped the connection: {exc}") from None

    async def _read_answer(self, upstream: aiohttp.ClientResponse, backend: Backend, deadline: float) -> bytes:
        """The whole body of a non-streamed answer, by the request's deadline."""
        try:
            remaining = deadline - asyncio.get_running_loop().time()
            return await asyncio.wait_for(upstream.read(), timeout=max(remaining, 0.001))
        except asyncio.TimeoutError:
            raise BackendTimeout(f"backend {backend.index} did not answer within {self.config.timeout_s:g} s") \
                from None
        except aiohttp.ClientError as exc:
            raise BackendError(f"backend {backend.index} broke off its answer: {exc}") from None

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: Backend,
                            events: bool) -> web.StreamResponse:
        """Relay an SSE answer chunk by chunk: as SSE, or as one PayloadPart event per SSE event."""
        headers = self._answer_headers(request, upstream, backend)
        if events:
            headers["Content-Type"] = EVENT_STREAM
            headers[PAYLOAD_CONTENT_TYPE_HEADER] = SSE_CONTENT_TYPE
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        rest = b""
        try:
            async for chunk in upstream.content.iter_any():
                if not events:
                    await response.write(chunk)
                    continue
                parts, rest = split_sse(rest + chunk)
                for part in parts:
                    await response.write(payload_part(part))
            if rest:
                await response.write(payload_part(rest))
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # The status line is gone already: end the stream with an error in its own format.
            error = (BackendTimeout(f"backend {backend.index} sent nothing for {self.config.timeout_s:g} s")
                     if isinstance(exc, asyncio.TimeoutError)
                     else BackendError(f"backend {backend.index} broke off its stream: {exc}"))
            logger.warning("stream from backend %d ended early: %s", backend.index, error.message)
            await response.write(model_stream_error(error.message, error.type) if events
                                 else sse(error.to_body()).encode())
        await response.write_eof()
        return response

    async def _single_part(self, request: web.Request, payload: bytes, headers: CIMultiDict,
                           content_type: str) -> web.StreamResponse:
        headers["Content-Type"] = EVENT_STREAM
        headers[PAYLOAD_CONTENT_TYPE_HEADER] = content_type
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        await response.write(payload_part(payload))
        await response.write_eof()
        return response

    def _answer_headers(self, request: web.Request, upstream: aiohttp.ClientResponse,
                        backend: Backend) -> CIMultiDict:
        headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if _passes_back(k))
        headers["Content-Type"] = upstream.headers.get("Content-Type", JSON_CONTENT_TYPE)
        headers[BACKEND_HEADER] = str(backend.index)  # replaces an inner front's, in a front of fronts
        if _is_sagemaker_path(request):
            headers[VARIANT_HEADER] = VARIANT
        return headers

    # ------------------------------------------------------------ errors

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ResidentError as exc:
            return self._error_response(request, exc.status, exc.to_body(), CIMultiDict(exc.headers))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "invalid_request_error")
            body = {"error": {"type": kind, "message": f"{exc.reason}: {request.method} {request.path}"}}
            return self._error_response(request, exc.status, body, CIMultiDict())
        except ConnectionResetError:  # the client went away mid-answer
            raise
        except Exception:
            logger.exception("front: %s %s (session %s) failed", request.method, request.path,
                             header(request.headers, SESSION_HEADER))
            body = {"error": {"type": "internal_error", "message": "internal error in the front"}}
            return self._error_response(request, 500, body, CIMultiDict())

    @staticmethod
    def _error_response(request: web.Request, status: int, body: dict, headers: CIMultiDict) -> web.Response:
        if _is_sagemaker_path(request):
            headers[ERROR_TYPE_HEADER] = body["error"]["type"]
            body = {**body, "message": body["error"]["message"]}
        headers["Content-Type"] = JSON_CONTENT_TYPE
        return web.Response(status=status, body=json.dumps(body).encode(), headers=headers)

    # ------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            for session_id in self.router.expire():
                logger.info("session %s expired; its pin is forgotten", session_id)
            await asyncio.sleep(self.config.health_interval_s)

    async def check_health(self) -> None:
        """Probe every backend once: GET /ping, and its model's workers READY when it has a management URL."""
        await asyncio.gather(*(self._probe(backend) for backend in self.router.backends))

    async def _probe(self, backend: Backend) -> None:
        ok = await self._alive(backend) and await self._workers_ready(backend)
        if self.router.record_probe(backend, ok):
            logger.log(logging.INFO if backend.healthy else logging.WARNING, "backend %d (%s) is now %s",
                       backend.index, backend.url, "healthy" if backend.healthy else "unhealthy")

    async def _alive(self, backend: Backend) -> bool:
        return await self._get_json(backend.url + "/ping") is not None

    async def _workers_ready(self, backend: Backend) -> bool:
        if backend.management_url is None:
            return True
        described = await self._get_json(f"{backend.management_url}/models/{self.config.model_name}")
        if not isinstance(described, list) or not described:
            return False
        statuses = [w.get("status") for w in described[0].get("workers", [])]
        return bool(statuses) and all(s == "READY" for s in statuses)

    async def _get_json(self, url: str) -> Any:
        """The JSON of a 200 answer, or None on any failure."""
        try:
            async with self._probe_http.get(url, timeout=aiohttp.ClientTimeout(
                    total=self.config.health_timeout_s)) as response:
                if response.status != 200:
                    return None
                return await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None


class AccessLogger(AbstractAccessLogger):
    """One line per request, with the session id (for an open: the new id) and the backend."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        session_id = header(request.headers, SESSION_HEADER)
        opened = response.headers.get(NEW_SESSION_HEADER)
        if opened:
            session_id = opened.split(";", 1)[0]
        self.logger.info('%s "%s %s" %d %d %.3fs session=%s backend=%s', request.remote, request.method,
                         request.path, response.status, response.body_length, time, session_id or "-",
                         response.headers.get(BACKEND_HEADER, "-"))


def _session_id(request: web.Request) -> str | None:
    """The request's session header: None, NEW_SESSION or a valid id (else InvalidSessionId, 400)."""
    value = header(request.headers, SESSION_HEADER)
    if value is None:
        return None
    value = value.strip()
    return value if value == NEW_SESSION else validate_session_id(value)


def _passes_back(name: str) -> bool:
    """Backend answer headers the client sees (not TorchServe's own, such as ts_stream_next)."""
    lowered = name.lower()
    return lowered.startswith(("x-amzn-sagemaker-", "x-resident-")) or lowered == "retry-after"


def _is_sagemaker_path(request: web.Request) -> bool:
    return request.path.startswith("/endpoints/")


def _error_of(payload: bytes) -> dict:
    """An error answer's ``{"type", "message"}``: ours (``{"error": {...}}``), TorchServe's own
    (``{"code", "type", "message"}``), or, for anything else, the text as a ``backend_error``."""
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and isinstance(error.get("type"), str) and isinstance(error.get("message"), str):
            return {"type": error["type"], "message": error["message"]}
    return {"type": BackendError.type, "message": payload[:1000].decode("utf-8", "replace")}
