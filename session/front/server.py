"""The front door: an aiohttp server that sends each session's requests to the backend holding it.

One front stands before N backends (TorchServe instances running our handler, one worker per
device; or, in docker/compose.yaml, other fronts standing in for SageMaker instances). It serves:

  GET  /ping                                            200 while a backend is healthy, else 503
  GET  /backends                                        each backend's health and counters (JSON)
  POST /backends/{i}/drain, /backends/{i}/resume        move every session off backend i (admin token),
                                                        put it back into rotation (session/front/migration.py)
  POST /backends/{i}/restart                            drain, restart (make cluster only), resume
  POST /invocations, /predictions/{model}               forwarded as they are (SSE streams relayed)
  POST /v1/chat/completions, GET /v1/models             the OpenAI API (the openai client), sessions by
                                                        the same SageMaker headers
  POST /endpoints/{name}/invocations                    SageMaker InvokeEndpoint
  GET  /adapters, POST /adapters {"name", "src"}, DELETE /adapters/{name}
                                                        LoRA adapters on every backend at once (below)
  POST /endpoints/{name}/invocations-response-stream    SageMaker InvokeEndpointWithResponseStream:
       forwarded with "stream": true; each SSE chunk becomes a PayloadPart event as it arrives.
       It continues an existing session or serves a stateless request; it never opens a session.

Routing is ``session/front/router.py``: a follow-up goes to the backend its pin, else its id's tag, names;
when that backend does not hold the session (a 404, or it is down) the front asks every backend
(``{"sessions": "list"}``) before it answers 404 or 410, so no front keeps state another needs.
``X-Amzn-SageMaker-*`` headers pass both ways; answers carry ``X-Resident-Backend: <backend index>``
and ``X-Resident-Request-Id``. Errors are ``{"error": {"type", "message"}}`` with their
status; on the ``/endpoints/...`` paths they also carry ``X-Amzn-ErrorType`` and a top-level
``message``, so that botocore's ClientError shows the type and message. A session whose backend is
down gets 410 ``session_backend_unavailable`` (open a new session); a stateless or new-session
request goes to another healthy backend when the first refuses the connection.

Every forwarded invocation carries ``X-Resident-Request-Id`` (the client's, when it sent a valid
one). TorchServe's async mode does not tell the backend when a client goes away, so when the client
disconnects before its answer is complete, or the front's timeout fires, the front sends the
backend a cancel for that id (``session/front/backend_client.py``), best effort: the engine stops the
request and rolls its session's turn back.

Adapters: the front sends an admin request (``X-Resident-Admin-Token``, a secret shared with its
backends) to every backend. Registering validates on each and rolls back where it succeeded if
one refuses; unregistering first asks every backend whether it may (a dry run: 409 while live
sessions use the adapter), then does it everywhere.

Settings: ``FrontConfig`` from ``RESIDENT_FRONT_*`` environment variables. Never imports ``ts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from multidict import CIMultiDict

from session.errors import (
    BackendError,
    BackendTimeout,
    BadRequest,
    ConfigError,
    PayloadTooLarge,
    ResidentError,
    SessionBackendUnavailable,
    SessionNotFound,
)
from session.front.backend_client import BackendAdmin
from session.front.event_stream import CONTENT_TYPE as EVENT_STREAM, model_stream_error, payload_part
from session.front.locator import SessionLocator
from session.front.migration import Migrator
from session.front.router import Backend, Router
from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    NEW_SESSION,
    NEW_SESSION_HEADER,
    REQUEST_ID_HEADER,
    REQUEST_ID_RE,
    SESSION_HEADER,
    header,
    load_json_object,
    sse,
)
from session.types import validate_session_id

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
TAG_RE = re.compile(r"^[A-Za-z0-9]+\*?$")


class Forbidden(ResidentError):
    """An admin request to the front without the right X-Resident-Admin-Token."""

    status = 403
    type = "forbidden"


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
    admin_token: str = ""  # shared with the backends (RESIDENT_ADMIN_TOKEN): adapters, session look-up, drain
    # Each backend's RESIDENT_SESSION_ID_TAG, same order; empty: b0, b1, ...; "none": ids carry no tag.
    backend_tags: tuple[str, ...] = ()
    cancel_timeout_s: float = 2.0  # a cancel sent to a backend (best effort)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> FrontConfig:
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
        tags = self.session_tags()
        if len(tags) != len(self.backends):
            raise ConfigError(f"{ENV_PREFIX}BACKEND_TAGS has {len(tags)} tags for {len(self.backends)} backends; "
                              "give one per backend, or 'none'")
        for tag in tags:
            if tag and not TAG_RE.match(tag):
                raise ConfigError(f"session id tag {tag!r} in {ENV_PREFIX}BACKEND_TAGS: use letters and digits, "
                                  "optionally ending in * (a prefix)")
        for name in ("timeout_s", "max_request_bytes", "health_interval_s", "health_timeout_s", "unhealthy_after",
                     "default_session_ttl_s", "cancel_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be > 0, got {getattr(self, name)}")
        if self.drain_s < 0:
            raise ConfigError(f"{ENV_PREFIX}DRAIN_S must be >= 0, got {self.drain_s}")

    def session_tags(self) -> tuple[str, ...]:
        """The session id tag of each backend ("" where ids carry none)."""
        if self.backend_tags == ("none",):
            return ("",) * len(self.backends)
        return self.backend_tags or tuple(f"b{i}" for i in range(len(self.backends)))


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


class _Missing(Exception):
    """The backend a follow-up was sent to answered 404 ``session_not_found``: look elsewhere first.
    ``response`` is that 404, for the client if the session is nowhere."""

    def __init__(self, response: web.Response):
        super().__init__("session not on this backend")
        self.response = response


class _ClientGone(Exception):
    """The client closed its connection while its answer was being relayed."""


@dataclass(frozen=True)
class _Call:
    """One invocation to forward: what every attempt on a backend sends."""

    path: str  # on the backend: /invocations or /predictions/<model>
    body: bytes
    headers: dict[str, str]  # X-Amzn-SageMaker-*, Content-Type, X-Resident-Request-Id
    session_id: str | None  # None (stateless), NEW_SESSION or an id
    request_id: str
    events: bool  # answer as AWS event-stream PayloadParts (the response-stream path)


class Front:
    """The front door. Built once by the launcher (``launch/cluster.py``) or a test; ``start`` binds
    and begins health checks, ``stop`` stops listening, lets requests in flight finish (up to
    ``drain_s``) and closes the connections to the backends."""

    def __init__(self, config: FrontConfig, restart_backend: Callable[[int], None] | None = None):
        self.config = config
        # Blocking: restarts backend i and returns once it is ready (launch/cluster.py); None: not ours to restart.
        self._restart_backend = restart_backend
        management = config.management_urls or (None,) * len(config.backends)
        self.router = Router([Backend(index=i, url=url, management_url=mgmt, tag=tag)
                              for i, (url, mgmt, tag) in enumerate(zip(config.backends, management,
                                                                       config.session_tags()))],
                             unhealthy_after=config.unhealthy_after, default_ttl_s=config.default_session_ttl_s)
        # aiohttp refuses a body of client_max_size bytes or more; we allow exactly max_request_bytes.
        self.app = web.Application(client_max_size=config.max_request_bytes + 1, middlewares=[self._errors])
        self.app.router.add_get("/ping", self.ping)
        self.app.router.add_get("/backends", self.describe_backends)
        self.app.router.add_post("/backends/{index}/drain", self._to_completion(self.drain_backend))
        self.app.router.add_post("/backends/{index}/resume", self.resume_backend)
        self.app.router.add_post("/backends/{index}/restart", self._to_completion(self.restart_backend))
        self.app.router.add_post("/invocations", self.invoke)
        self.app.router.add_post("/predictions/{model}", self.invoke)
        self.app.router.add_post("/v1/chat/completions", self.invoke)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_post("/endpoints/{endpoint}/invocations", self.invoke)
        self.app.router.add_post("/endpoints/{endpoint}/invocations-response-stream", self.invoke_stream)
        self.app.router.add_get("/adapters", self.list_adapters)
        self.app.router.add_post("/adapters", self._to_completion(self.register_adapter))
        self.app.router.add_delete("/adapters/{name}", self._to_completion(self.unregister_adapter))
        self._http: aiohttp.ClientSession | None = None  # requests to backends, kept alive
        self._probe_http: aiohttp.ClientSession | None = None  # health probes, a fresh connection each
        self.admin: BackendAdmin | None = None  # admin calls and cancels to backends (set by start)
        self.migrator: Migrator | None = None  # drains (set by start)
        self.locator: SessionLocator | None = None  # finds sessions no pin or tag places (set by start)
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # cancels on their way to backends, drains, adapter fan-outs
        self.num_cancels_sent = 0

    async def start(self, host: str, port: int) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        self._probe_http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self.admin = BackendAdmin(self._http, model_name=self.config.model_name, token=self.config.admin_token,
                                  timeout_s=self.config.timeout_s + self.config.health_timeout_s,
                                  cancel_timeout_s=self.config.cancel_timeout_s)
        self.migrator = Migrator(self.router, self.admin)
        self.locator = SessionLocator(self.admin, lambda: self.router.healthy_backends)
        # handler_cancellation: a client that disconnects cancels its handler, which then cancels the backend's work.
        self._runner = web.AppRunner(self.app, access_log_class=AccessLogger, access_log=access_logger,
                                     handler_cancellation=True)
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
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=max(self.config.drain_s, self.config.cancel_timeout_s))
        for client in (self._http, self._probe_http):
            if client is not None:
                await client.close()

    def _in_background(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _to_completion(self, handler):
        """Wraps a handler whose work must not stop halfway when its client leaves (a drain would lose
        the session in transit, an adapter fan-out leave backends unlike): it runs as a task of its own,
        and a client that disconnects (handler cancellation) cancels only the wait for it."""
        async def run(request: web.Request) -> web.StreamResponse:
            return await asyncio.shield(self._in_background(handler(request)))
        return run

    # ------------------------------------------------------------ handlers

    async def ping(self, request: web.Request) -> web.Response:
        num_healthy = len(self.router.healthy_backends)
        status = 200 if num_healthy else 503
        return web.json_response({"status": "Healthy" if num_healthy else "Unhealthy",
                                  "healthy_backends": num_healthy, "backends": len(self.router.backends)},
                                 status=status)

    async def describe_backends(self, request: web.Request) -> web.Response:
        return web.json_response({"backends": [asdict(b) for b in self.router.backends],
                                  "num_sessions": len(self.router.pins), "num_cancels_sent": self.num_cancels_sent,
                                  "num_lookups": self.locator.num_lookups,
                                  "num_lookup_fan_outs": self.locator.num_fan_outs})

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        """``/invocations``, ``/predictions/{model}``, ``/v1/chat/completions`` and InvokeEndpoint: one body,
        the same OpenAI chat shape, forwarded to the backend's ``/invocations`` (or the named model)."""
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

    async def list_models(self, request: web.Request) -> web.Response:
        """OpenAI ``GET /v1/models``: the base model, and the registered adapters when the front may ask."""
        names = [self.config.model_name]
        if self.admin.enabled and self.router.healthy_backends:
            [(status, body)] = await self._admin_all({"adapters": "list"}, self.router.healthy_backends[:1])
            if status == 200:
                names += [a["name"] for a in body.get("adapters", [])]
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "resident"} for name in names]})

    # ------------------------------------------------------------ drain

    async def drain_backend(self, request: web.Request) -> web.Response:
        """Move every session off backend i (it then may stop with none lost); the report times each move."""
        self._check_admin(request)
        report = await self.migrator.drain(self._backend_at(request))
        return web.json_response(report.to_body())

    async def resume_backend(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        backend = self._backend_at(request)
        self.router.resume(backend)
        return web.json_response({"backend": backend.index, "draining": False})

    async def restart_backend(self, request: web.Request) -> web.Response:
        """A step of a rolling restart: drain backend i, restart it, put it back. 409 (and no restart)
        when a session could not be moved off it."""
        self._check_admin(request)
        backend = self._backend_at(request)
        if self._restart_backend is None:
            raise BadRequest("this front does not own its backends' processes (only make cluster's does): drain, "
                             "restart the backend yourself, then POST /backends/{i}/resume")
        report = await self.migrator.drain(backend)
        if report.num_remaining:
            return web.json_response({"error": {"type": "sessions_remaining", "message": (
                f"{report.num_remaining} session(s) could not be moved off backend {backend.index}; not restarted "
                "(it stays drained: POST /backends/{i}/resume to undo)")}, "drain": report.to_body()}, status=409)
        started = asyncio.get_running_loop().time()
        await asyncio.get_running_loop().run_in_executor(None, self._restart_backend, backend.index)
        await self._probe(backend)
        self.router.resume(backend)
        return web.json_response({"backend": backend.index, "drain": report.to_body(), "healthy": backend.healthy,
                                  "restart_s": round(asyncio.get_running_loop().time() - started, 3)})

    def _check_admin(self, request: web.Request) -> None:
        if not self.config.admin_token:
            raise Forbidden(f"the admin API is off: set {ENV_PREFIX}ADMIN_TOKEN and the backends' "
                            "RESIDENT_ADMIN_TOKEN to one secret (make cluster does)")
        token = header(request.headers, ADMIN_TOKEN_HEADER) or ""
        if not hmac.compare_digest(token.encode(), self.config.admin_token.encode()):
            raise Forbidden(f"send the cluster's admin token in {ADMIN_TOKEN_HEADER}")

    def _backend_at(self, request: web.Request) -> Backend:
        raw = request.match_info["index"]
        if not raw.isdigit() or int(raw) >= len(self.router.backends):
            raise web.HTTPNotFound()
        return self.router.backends[int(raw)]

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
        if not self.admin.enabled:
            raise BadRequest(f"the adapter API is off: set {ENV_PREFIX}ADMIN_TOKEN and the backends' "
                             "RESIDENT_ADMIN_TOKEN to one secret (make cluster does)")
        if not backends:
            raise BackendError("no healthy backend to manage adapters on")
        return list(await asyncio.gather(*(self.admin.call(b, payload) for b in backends)))

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
        request_id = _request_id(request)
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-amzn-sagemaker-")}
        # The body is JSON whatever the client's Content-Type says (SageMaker clients send all sorts, curl -d
        # says form): forwarded as a form, TorchServe would decode it into fields and lose it.
        headers["Content-Type"] = JSON_CONTENT_TYPE
        headers[REQUEST_ID_HEADER] = request_id
        call = _Call(path=path, body=body, headers=headers, session_id=session_id, request_id=request_id,
                     events=events)
        if session_id in (None, NEW_SESSION):
            return await self._forward_anywhere(request, call)
        return await self._forward_to_session(request, call)

    async def _forward_anywhere(self, request: web.Request, call: _Call) -> web.StreamResponse:
        """A new session or a stateless request: the least busy backend; the next one if it refuses."""
        refused: list[Backend] = []
        while True:
            backend = self.router.pick(exclude=refused)  # BackendUnavailable when none is left
            try:
                return await self._exchange_counted(request, backend, call)
            except _Unreachable:
                refused.append(backend)

    async def _forward_to_session(self, request: web.Request, call: _Call) -> web.StreamResponse:
        """A follow-up: to the backend its pin or its id's tag names; when that backend does not hold the
        session (404) or is down, to the one the backends say holds it; else that 404, or 410."""
        session_id = call.session_id
        try:
            backend = self.router.route(session_id)
        except (SessionNotFound, SessionBackendUnavailable) as exc:
            backend = await self._look_up(session_id, exclude=())
            if backend is None:
                raise exc
        try:
            return await self._exchange_counted(request, backend, call, look_elsewhere=self.admin.enabled)
        except (_Missing, _Unreachable) as exc:
            elsewhere = await self._look_up(session_id, exclude=(backend,))
            if elsewhere is None and isinstance(exc, _Missing):
                return exc.response
            if elsewhere is not None:
                with contextlib.suppress(_Unreachable):
                    return await self._exchange_counted(request, elsewhere, call)
        raise SessionBackendUnavailable(
            f"the backend holding session {session_id} is unavailable and the session's state was held there; "
            "open a new session with NEW_SESSION")

    async def _look_up(self, session_id: str, exclude: tuple[Backend, ...]) -> Backend | None:
        """Where the session lives now, by asking the backends (``session/front/locator.py``); remembered here
        when found. A session this front is moving is waited for. None without the admin token."""
        if self.migrator.is_moving(session_id):
            await self.migrator.wait_moved(session_id, self.config.timeout_s)
            pin = self.router.pins.get(session_id)
            if pin is not None:
                return pin.backend
        if not self.admin.enabled:
            return None
        found = await self.locator.find(session_id, exclude)
        if found is None:
            return None
        backend, expires_at = found
        self.router.pin(session_id, backend, expires_at)
        logger.info("session %s found on backend %d", session_id, backend.index)
        return backend

    async def _exchange_counted(self, request: web.Request, backend: Backend, call: _Call,
                                look_elsewhere: bool = False) -> web.StreamResponse:
        self.router.acquire(backend)
        try:
            return await self._exchange(request, backend, call, look_elsewhere)
        finally:
            self.router.release(backend)

    async def _exchange(self, request: web.Request, backend: Backend, call: _Call,
                        look_elsewhere: bool) -> web.StreamResponse:
        """One request to one backend, its answer relayed to the client. Raises _Unreachable; _Missing
        when ``look_elsewhere`` and the backend does not hold the session. On timeout or a client gone,
        the backend is told to cancel the request."""
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        try:
            async with await self._send(backend, call) as upstream:
                if upstream.status == 200 and upstream.content_type == SSE_CONTENT_TYPE:
                    self.router.record_answer(backend, call.session_id, upstream.status, upstream.headers)
                    return await self._relay_stream(request, upstream, backend, call)
                payload = await self._read_answer(upstream, backend, deadline)
        except (BackendTimeout, asyncio.CancelledError):
            self._cancel_later(backend, call.request_id)
            raise
        error = _error_of(payload) if upstream.status >= 400 else None
        self.router.record_answer(backend, call.session_id, upstream.status, upstream.headers,
                                  error["type"] if error else None)
        out_headers = self._answer_headers(request, upstream, backend, call)
        if error is not None:
            response = self._error_response(request, upstream.status, {"error": error}, out_headers)
            if look_elsewhere and upstream.status == 404 and error["type"] == SessionNotFound.type:
                raise _Missing(response)
            return response
        if call.events and upstream.status == 200:  # a JSON answer on the stream path (a CLOSE): one part
            return await self._single_part(request, payload, out_headers, upstream.content_type)
        return web.Response(status=upstream.status, body=payload, headers=out_headers)

    async def _send(self, backend: Backend, call: _Call) -> aiohttp.ClientResponse:
        """POST to the backend; returns once its status and headers are in."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.health_timeout_s,
                                        sock_read=self.config.timeout_s)
        try:
            return await self._http.post(backend.url + call.path, data=call.body, headers=call.headers,
                                         timeout=timeout)
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
                            call: _Call) -> web.StreamResponse:
        """Relay an SSE answer chunk by chunk: as SSE, or as one PayloadPart event per SSE event."""
        headers = self._answer_headers(request, upstream, backend, call)
        if call.events:
            headers["Content-Type"] = EVENT_STREAM
            headers[PAYLOAD_CONTENT_TYPE_HEADER] = SSE_CONTENT_TYPE
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        try:
            await self._relay_chunks(upstream, response, call.events)
        except _ClientGone:
            logger.info("client left during the stream of request %s; cancelling it on backend %d",
                        call.request_id, backend.index)
            self._cancel_later(backend, call.request_id)
            raise ConnectionResetError("client disconnected") from None
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # The status line is gone already: end the stream with an error in its own format.
            if isinstance(exc, asyncio.TimeoutError):
                error = BackendTimeout(f"backend {backend.index} sent nothing for {self.config.timeout_s:g} s")
                self._cancel_later(backend, call.request_id)
            else:
                error = BackendError(f"backend {backend.index} broke off its stream: {exc}")
            logger.warning("stream from backend %d ended early: %s", backend.index, error.message)
            await response.write(model_stream_error(error.message, error.type) if call.events
                                 else sse(error.to_body()).encode())
        await response.write_eof()
        return response

    @staticmethod
    async def _relay_chunks(upstream: aiohttp.ClientResponse, response: web.StreamResponse, events: bool) -> None:
        """Copy the upstream SSE body to the client as it arrives. Raises _ClientGone when a write fails."""
        rest = b""
        async for chunk in upstream.content.iter_any():
            if not events:
                await _write(response, chunk)
                continue
            parts, rest = split_sse(rest + chunk)
            for part in parts:
                await _write(response, payload_part(part))
        if rest:
            await _write(response, payload_part(rest))

    def _cancel_later(self, backend: Backend, request_id: str) -> None:
        """Tell the backend to stop ``request_id``, in the background (the caller may be cancelled itself)."""
        self.num_cancels_sent += 1
        self._in_background(self._cancel(backend, request_id))

    async def _cancel(self, backend: Backend, request_id: str) -> None:
        cancelled = await self.admin.cancel(backend, request_id)
        logger.info("cancel of request %s on backend %d: %s", request_id, backend.index,
                    {True: "stopped", False: "already finished", None: "not delivered"}[cancelled])

    async def _single_part(self, request: web.Request, payload: bytes, headers: CIMultiDict,
                           content_type: str) -> web.StreamResponse:
        headers["Content-Type"] = EVENT_STREAM
        headers[PAYLOAD_CONTENT_TYPE_HEADER] = content_type
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        await response.write(payload_part(payload))
        await response.write_eof()
        return response

    def _answer_headers(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: Backend,
                        call: _Call) -> CIMultiDict:
        headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if _passes_back(k))
        headers["Content-Type"] = upstream.headers.get("Content-Type", JSON_CONTENT_TYPE)
        headers[BACKEND_HEADER] = str(backend.index)  # replaces an inner front's, in a front of fronts
        headers[REQUEST_ID_HEADER] = call.request_id
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


def _request_id(request: web.Request) -> str:
    """The client's X-Resident-Request-Id when it is valid, else a fresh one."""
    value = (header(request.headers, REQUEST_ID_HEADER) or "").strip()
    return value if REQUEST_ID_RE.fullmatch(value) else uuid.uuid4().hex


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError too
        raise _ClientGone() from exc


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
