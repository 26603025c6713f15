"""The front door: an aiohttp server that sends each session's requests to the backend holding it.

One front stands before N backends (TorchServe instances running our handler, one worker per
device; or, in docker/compose.yaml, other fronts standing in for SageMaker instances). It serves:

  GET  /ping                                            200 while a backend is healthy, else 503
  GET  /backends                                        each backend's health and counters (JSON; admin token)
  POST /backends/{i}/drain, /backends/{i}/resume        move every session off backend i (admin token),
                                                        put it back into rotation (session/front/migration.py)
  POST /backends/{i}/restart                            drain, restart (make cluster only), resume
  POST /invocations, /predictions/{model}               forwarded as they are (SSE streams relayed)
  POST /v1/chat/completions, POST /v1/completions       the OpenAI API (the openai client), sessions by
  GET  /v1/models, GET /v1/models/{model}               the same SageMaker headers; the models: the served
                                                        name (FrontConfig.served_model_name) and adapters
  POST /endpoints/{name}/invocations                    SageMaker InvokeEndpoint
  GET  /adapters, POST /adapters {"name", "src"}, DELETE /adapters/{name}
                                                        LoRA adapters on every backend at once (admin token)
  POST /endpoints/{name}/invocations-response-stream    SageMaker InvokeEndpointWithResponseStream:
       forwarded with "stream": true; each SSE chunk becomes a PayloadPart event as it arrives.
       It continues an existing session or serves a stateless request; it never opens a session.

The jobs live beside this file: forwarding and relaying (``forwarding``), the admin API
(``admin_routes``), backend health (``health``), the answers' headers and error shapes
(``answers``), settings (``config``: ``FrontConfig`` from ``RESIDENT_FRONT_*``). ``X-Amzn-SageMaker-*``
headers pass both ways; answers carry ``X-Resident-Backend: <backend index>`` and
``X-Resident-Request-Id``: the front's own id for the request (a client's is never forwarded, so no
client can name, and cancel, another's request on a backend). No other client header reaches a
backend (``forwarding.Call``): ``X-Resident-Cancel``, ``X-Resident-Admin-Token``,
``X-Resident-Endpoint`` (set by the front alone, on ``/v1/completions``) and ``X-Resident-Tenant``
stop here.

Tenants: the middleware resolves each request's tenant once (``tenants``: an API key, a trusted
header, else the peer address; with a key file every route but ``/ping`` needs a key, else 401),
keys the per-client limits on it, logs it and forwards it as ``X-Resident-Tenant``.

Abuse: connections are capped (in all and per address; idle ones make room), each request's head and
body and each answer's writes have deadlines, and each tenant's requests in flight are capped
(``connections``); ``/ping`` is the only route that needs no body.
Nothing is forwarded unchecked (``request_checks``): a routing header sent twice is 400 before any
routing, and ``/predictions/{model}`` forwards only a plain model name in the raw path (else 404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TypeVar

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from multidict import CIMultiDict

from session.errors import BackendError, BadRequest, PayloadTooLarge, RequestTimeout, ResidentError
from session.front.admin_routes import AdminRoutes
from session.front.answers import BACKEND_HEADER, error_response
from session.front.backend_client import BackendAdmin
from session.front.config import ENV_PREFIX, FrontConfig
from session.front.connections import ClientLimiter, ConnectionGuard, GuardedSite
from session.front.forwarding import Call, Forwarder
from session.front.health import Health
from session.front.locator import SessionLocator
from session.front.migration import Migrator
from session.front.request_checks import check_single_headers, predictions_path
from session.front.router import Backend, Router
from session.front.tenants import TENANT, Tenants, peer_tenant
from session.serving.protocol import (
    COMPLETIONS_ENDPOINT,
    NEW_SESSION,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    header,
    load_json_object,
)
from session.types import redact, validate_session_id

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("resident.front.access")

Route = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]
MAX_HEADERS = 128  # a request with more is answered 400 (aiohttp >= 3.13.4 enforces it)
MAX_LINE_BYTES = 8190  # the request line, and each header

T = TypeVar("T")


def _started(part: T | None) -> T:
    """A part ``Front.start`` makes (it needs the event loop's client sessions); None before it."""
    if part is None:
        raise RuntimeError("the front is not started: call start() first")
    return part


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
        self.guard = ConnectionGuard(max_connections=config.max_connections, header_timeout_s=config.header_timeout_s,
                                     max_per_address=config.max_connections_per_address,
                                     write_timeout_s=config.write_timeout_s)
        self.limiter = ClientLimiter(config.max_requests_per_client)
        self.tenants = Tenants.from_config(config)  # reads the API-key file, if any, once
        add = self.app.router
        add.add_get("/ping", self.ping)
        add.add_get("/backends", self.describe_backends)
        add.add_post("/backends/{index}/drain", self._admin("drain_backend", to_completion=True))
        add.add_post("/backends/{index}/resume", self._admin("resume_backend"))
        add.add_post("/backends/{index}/restart", self._admin("restart_backend", to_completion=True))
        add.add_post("/invocations", self.invoke)
        add.add_post("/predictions/{model}", self.invoke)
        add.add_post("/v1/chat/completions", self.invoke)
        add.add_post("/v1/completions", self.complete)
        add.add_get("/v1/models", self.list_models)
        add.add_get("/v1/models/{model}", self.retrieve_model)
        add.add_post("/endpoints/{endpoint}/invocations", self.invoke)
        add.add_post("/endpoints/{endpoint}/invocations-response-stream", self.invoke_stream)
        add.add_get("/adapters", self._admin("list_adapters"))
        add.add_post("/adapters", self._admin("register_adapter", to_completion=True))
        add.add_delete("/adapters/{name}", self._admin("unregister_adapter", to_completion=True))
        self._http: aiohttp.ClientSession | None = None  # requests to backends, kept alive
        self._probe_http: aiohttp.ClientSession | None = None  # health probes, a fresh connection each
        # Set by start (they need the event loop's client sessions):
        self.admin: BackendAdmin | None = None  # admin calls and cancels to backends
        self.migrator: Migrator | None = None  # drains
        self.locator: SessionLocator | None = None  # finds sessions no pin or tag places
        self.health: Health | None = None
        self.forwarder: Forwarder | None = None
        self.admin_routes: AdminRoutes | None = None
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # cancels on their way to backends, drains, adapter fan-outs

    async def start(self, host: str, port: int) -> None:
        config = self.config
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        self._probe_http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self.admin = BackendAdmin(self._http, model_name=config.model_name, token=config.admin_token,
                                  timeout_s=config.timeout_s + config.health_timeout_s,
                                  cancel_timeout_s=config.cancel_timeout_s)
        self.migrator = Migrator(self.router, self.admin)
        self.locator = SessionLocator(self.admin, lambda: self.router.healthy_backends)
        self.health = Health(config, self.router, self._probe_http)
        self.forwarder = Forwarder(config=config, router=self.router, http=self._http, admin=self.admin,
                                   migrator=self.migrator, locator=self.locator, health=self.health,
                                   in_background=self._in_background)
        self.admin_routes = AdminRoutes(config=config, router=self.router, admin=self.admin, migrator=self.migrator,
                                        health=self.health, restart=self._restart_backend)
        # handler_cancellation: a client that disconnects cancels its handler, which then cancels the backend's work.
        # keepalive_timeout: an idle kept-alive connection is closed (aiohttp's default is an hour).
        self._runner = web.AppRunner(self.app, access_log_class=AccessLogger, access_log=access_logger,
                                     handler_cancellation=True, shutdown_timeout=config.drain_s,
                                     keepalive_timeout=config.idle_timeout_s, max_headers=MAX_HEADERS,
                                     max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES)
        await self._runner.setup()
        await GuardedSite(self._runner, host, port, self.guard).start()
        self._health_task = asyncio.create_task(self.health.run())
        logger.info("front listening on %s:%d for %d backend(s)", host, port, len(self.router.backends))

    @property
    def port(self) -> int:
        """The bound port (useful after ``start(host, 0)``)."""
        return _started(self._runner).addresses[0][1]

    @property
    def num_cancels_sent(self) -> int:
        return self.forwarder.num_cancels_sent if self.forwarder is not None else 0

    async def check_health(self) -> None:
        """Probe every backend once (tests, and a restart waiting for its backend)."""
        await _started(self.health).check()

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

    def _admin(self, name: str, to_completion: bool = False):
        """The route for ``AdminRoutes.<name>``, given the request and its (size-limited) body. With
        ``to_completion``, work that must not stop halfway when its client leaves (a drain would lose
        the session in transit, an adapter fan-out leave backends unlike) runs as a task of its own,
        and a client that disconnects (handler cancellation) cancels only the wait for it."""
        async def run(request: web.Request) -> web.StreamResponse:
            body = await self._read_body(request)
            work = getattr(self.admin_routes, name)(request, body)
            if to_completion:
                return await asyncio.shield(self._in_background(work))
            return await work
        return run

    # ------------------------------------------------------------ handlers

    async def ping(self, request: web.Request) -> web.Response:
        num_healthy = len(self.router.healthy_backends)
        status = 200 if num_healthy else 503
        return web.json_response({"status": "Healthy" if num_healthy else "Unhealthy",
                                  "healthy_backends": num_healthy, "backends": len(self.router.backends)},
                                 status=status)

    async def describe_backends(self, request: web.Request) -> web.Response:
        """Internal URLs and counters: the admin token's, like the rest of the admin API."""
        _started(self.admin_routes).check_token(request)
        locator = _started(self.locator)
        return web.json_response({"backends": [asdict(b) for b in self.router.backends],
                                  "num_sessions": len(self.router.pins), "num_cancels_sent": self.num_cancels_sent,
                                  "num_lookups": locator.num_lookups,
                                  "num_lookup_fan_outs": locator.num_fan_outs,
                                  "connections": {"open": self.guard.num_open, "refused": self.guard.num_refused,
                                                  "idle_closed": self.guard.num_evicted,
                                                  "head_timeouts": self.guard.num_timed_out,
                                                  "write_timeouts": self.guard.num_write_timeouts},
                                  "num_client_limit_refusals": self.limiter.num_refused})

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        """``/invocations``, ``/predictions/{model}``, ``/v1/chat/completions`` and InvokeEndpoint: one body,
        the same OpenAI chat shape, forwarded to the backend's ``/invocations`` (or the named model)."""
        path = "/invocations"
        if "model" in request.match_info:  # /predictions/{model}: only a plain name (request_checks), else 404
            path = predictions_path(request.raw_path, self.config.model_name)
        body = await self._read_body(request)
        return await self._forward(request, body, path, events=False)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions``: forwarded like a chat, marked ``X-Resident-Endpoint: completions`` so that
        the backend reads the body as a completions request (a prompt, not messages)."""
        body = await self._read_body(request)
        return await self._forward(request, body, "/invocations", events=False, endpoint=COMPLETIONS_ENDPOINT)

    async def invoke_stream(self, request: web.Request) -> web.StreamResponse:
        data = load_json_object(await self._read_body(request))
        if _session_id(request) == NEW_SESSION or data.get("requestType") == NEW_SESSION:
            raise BadRequest("invocations-response-stream cannot open a session: open it with InvokeEndpoint "
                             f"({SESSION_HEADER}: {NEW_SESSION}), then stream within it")
        body = json.dumps({**data, "stream": True}).encode()
        return await self._forward(request, body, "/invocations", events=True)

    async def list_models(self, request: web.Request) -> web.Response:
        """OpenAI ``GET /v1/models``: the base model, and the registered adapters when the front may ask."""
        return web.json_response({"object": "list", "data": await self._models()})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """OpenAI ``GET /v1/models/{model}``: one entry of the list, or 404 ``model_not_found``."""
        name = request.match_info["model"]
        for model in await self._models():
            if model["id"] == name:
                return web.json_response(model)
        body = {"error": {"type": "model_not_found", "code": "model_not_found",
                          "message": f"the model {name!r} does not exist here; GET /v1/models lists what is served"}}
        return error_response(request, 404, body, CIMultiDict())

    async def _models(self) -> list[dict]:
        """The base model under the name the backends serve it (clients send it as "model"), with its
        context length when the launcher knows it, then each registered adapter (its ``parent``: the base)."""
        base = self.config.listed_model_name
        shared = {"object": "model", "created": 0, "owned_by": "resident"}
        if self.config.max_model_len:
            shared["max_model_len"] = self.config.max_model_len
        return [{"id": base, **shared}] + [{"id": name, **shared, "parent": base} for name in await self._adapters()]

    async def _adapters(self) -> list[str]:
        """The adapters registered on the first healthy backend that answers; none without the admin token,
        or when none answers (the base model is listed all the same)."""
        if not (_started(self.admin).enabled and self.router.healthy_backends):
            return []
        try:
            status, body = await _started(self.admin_routes).on_first({"adapters": "list"})
        except BackendError as exc:
            logger.warning("listing the adapters for /v1/models: %s", exc)
            return []
        return [a["name"] for a in body.get("adapters", [])] if status == 200 else []

    async def _forward(self, request: web.Request, body: bytes, path: str, *, events: bool,
                       endpoint: str | None = None) -> web.StreamResponse:
        call = Call.of(request, body, path, session_id=_session_id(request), request_id=_request_id(request),
                       tenant=request[TENANT], events=events, endpoint=endpoint)
        return await _started(self.forwarder).forward(request, call)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_request_bytes
        too_large = PayloadTooLarge(f"request body is larger than {limit} bytes, the endpoint's payload limit "
                                    f"({ENV_PREFIX}MAX_REQUEST_BYTES)")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            return await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except asyncio.TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {self.config.body_timeout_s:g} s "
                                 f"({ENV_PREFIX}BODY_TIMEOUT_S)") from None

    # ------------------------------------------------------------ errors

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.path == "/ping":  # health checks come from the platform, at its own pace
                return await handler(request)
            check_single_headers(name for name, _ in request.headers.items())  # before routing: one copy of each routing header
            request[TENANT] = tenant = self.tenants.identify(request)
            with self.limiter.admit(tenant):
                return await handler(request)
        except ResidentError as exc:
            return error_response(request, exc.status, exc.to_body(), CIMultiDict(exc.headers))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "invalid_request_error")
            body = {"error": {"type": kind, "message": f"{exc.reason}: {request.method} {request.path}"}}
            return error_response(request, exc.status, body, CIMultiDict())
        except ConnectionResetError:  # the client went away mid-answer
            raise
        except Exception:
            logger.exception("front: %s %s (tenant %s, session %s) failed", request.method, request.path,
                             request.get(TENANT, "-"), redact(header(request.headers, SESSION_HEADER)))
            body = {"error": {"type": "internal_error", "message": "internal error in the front"}}
            return error_response(request, 500, body, CIMultiDict())
        finally:
            self.guard.request_done(request.transport)


class AccessLogger(AbstractAccessLogger):
    """One line per request: the peer, the tenant (the peer's ``addr:`` where none was resolved: ``/ping``,
    a 401 or 400), the session id (for an open: the new id; shortened, ``redact``) and the backend."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        session_id = header(request.headers, SESSION_HEADER)
        opened = response.headers.get(NEW_SESSION_HEADER)
        if opened:
            session_id = opened.split(";", 1)[0]
        self.logger.info('%s "%s %s" %d %d %.3fs tenant=%s session=%s backend=%s', request.remote,
                         request.method, request.path, response.status, response.body_length, time,
                         request.get(TENANT) or peer_tenant(request), redact(session_id),
                         response.headers.get(BACKEND_HEADER, "-"))


def _session_id(request: web.Request) -> str | None:
    """The request's session header: None, NEW_SESSION or a valid id (else InvalidSessionId, 400)."""
    value = header(request.headers, SESSION_HEADER)
    if value is None:
        return None
    value = value.strip()
    return value if value == NEW_SESSION else validate_session_id(value)


def _request_id(request: web.Request) -> str:
    """The front's own id for the request, always fresh: a client's X-Resident-Request-Id is never
    forwarded (another client could reuse it and cancel this request on the backend by hanging up)."""
    return uuid.uuid4().hex
