"""Forwarding an invocation to the backend that should answer it, and relaying the answer back.

A new session or a stateless request goes to the least busy healthy backend (the next one when the
first refuses the connection). A follow-up goes to the backend its pin, else its id's tag, names
(``session/front/router.py``); when that backend does not hold the session (a 404, or it is down)
the front asks every backend (``session/front/locator.py``) before it answers 404 or 410, so no
front keeps state another needs. A session whose backend is down gets 410
``session_backend_unavailable`` (open a new session).

Every forwarded invocation carries ``X-Resident-Request-Id``, the front's own fresh id (never the
client's), and ``X-Resident-Tenant``, the tenant the front resolved (``tenants``; never the client's). TorchServe's async mode does not tell the backend when a client goes away, so when the
client disconnects before its answer is complete the front sends the backend a cancel for that id
(``session/front/backend_client.py``), best effort: the engine stops the request and rolls its
session's turn back.

When the front's timeout fires, it waits for that cancel (up to ``cancel_timeout_s``) before it
answers 504, and the 504 says which it was (``may_have_committed`` in its error): false, the
backend stopped the request and rolled the turn back, so sending it again is safe; true, the
request had finished there (its turn is in the session) or the cancel did not get through (it may
still finish), so a client that sends it again may ask its question twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from session.errors import BackendError, BackendTimeout, ResidentError, SessionBackendUnavailable, SessionNotFound
from session.front.answers import (
    JSON_CONTENT_TYPE,
    PAYLOAD_CONTENT_TYPE_HEADER,
    SSE_CONTENT_TYPE,
    answer_headers,
    error_of,
    error_response,
)
from session.front.backend_client import BackendAdmin
from session.front.config import FrontConfig
from session.front.event_stream import CONTENT_TYPE as EVENT_STREAM, model_stream_error, payload_part
from session.front.health import Health
from session.front.locator import SessionLocator
from session.front.migration import Migrator
from session.front.router import Backend, Router
from session.serving.protocol import ENDPOINT_HEADER, NEW_SESSION, REQUEST_ID_HEADER, TENANT_HEADER, sse
from session.types import redact

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """One invocation to forward: what every attempt on a backend sends."""

    path: str  # on the backend: /invocations or /predictions/<model>
    body: bytes
    # X-Amzn-SageMaker-*, Content-Type, X-Resident-Request-Id, X-Resident-Tenant, X-Resident-Endpoint
    headers: dict[str, str]
    session_id: str | None  # None (stateless), NEW_SESSION or an id
    request_id: str
    events: bool  # answer as AWS event-stream PayloadParts (the response-stream path)

    @classmethod
    def of(cls, request: web.Request, body: bytes, path: str, session_id: str | None, request_id: str,
           tenant: str, events: bool, endpoint: str | None = None) -> Call:
        """Only the client's X-Amzn-SageMaker-* headers pass; ours are set here, so no client sets
        X-Resident-Request-Id, X-Resident-Tenant (``tenant``: the one the front resolved) or
        X-Resident-Endpoint (``endpoint``: which OpenAI body the backend parses; None for a chat)."""
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-amzn-sagemaker-")}
        # The body is JSON whatever the client's Content-Type says (SageMaker clients send all sorts, curl -d
        # says form): forwarded as a form, TorchServe would decode it into fields and lose it.
        headers["Content-Type"] = JSON_CONTENT_TYPE
        headers[REQUEST_ID_HEADER] = request_id
        headers[TENANT_HEADER] = tenant
        if endpoint is not None:
            headers[ENDPOINT_HEADER] = endpoint
        return cls(path=path, body=body, headers=headers, session_id=session_id, request_id=request_id,
                   events=events)


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


def split_sse(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events (each with its closing blank line) and the incomplete rest."""
    *events, rest = buffer.split(b"\n\n")
    return [event + b"\n\n" for event in events], rest


class Forwarder:
    """Who calls this: the front's invocation handlers, on the event loop, once per request."""

    def __init__(self, *, config: FrontConfig, router: Router, http: aiohttp.ClientSession, admin: BackendAdmin,
                 migrator: Migrator, locator: SessionLocator, health: Health,
                 in_background: Callable[[Coroutine], asyncio.Task]):
        self.config = config
        self.router = router
        self.http = http  # requests to backends, kept alive
        self.admin = admin
        self.migrator = migrator
        self.locator = locator
        self.health = health
        self.in_background = in_background  # runs a coroutine that must outlive the request (a cancel)
        self.num_cancels_sent = 0

    async def forward(self, request: web.Request, call: Call) -> web.StreamResponse:
        if call.session_id is None or call.session_id == NEW_SESSION:
            return await self._forward_anywhere(request, call)
        return await self._forward_to_session(request, call, call.session_id)

    async def _forward_anywhere(self, request: web.Request, call: Call) -> web.StreamResponse:
        """A new session or a stateless request: the least busy backend; the next one if it refuses."""
        refused: list[Backend] = []
        while True:
            backend = self.router.pick(exclude=refused)  # BackendUnavailable when none is left
            try:
                return await self._exchange_counted(request, backend, call)
            except _Unreachable:
                refused.append(backend)

    async def _forward_to_session(self, request: web.Request, call: Call, session_id: str) -> web.StreamResponse:
        """A follow-up: to the backend its pin or its id's tag names; when that backend does not hold the
        session (404) or is down, to the one the backends say holds it; else that 404, or 410."""
        try:
            backend = self.router.route(session_id)
        except (SessionNotFound, SessionBackendUnavailable) as exc:
            found = await self._look_up(session_id, exclude=())
            if found is None:
                raise exc from None
            backend = found
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
        """Where the session lives now, by asking the backends; remembered here when found. A session
        this front is moving is waited for. None without the admin token."""
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
        logger.info("session %s found on backend %d", redact(session_id), backend.index)
        return backend

    async def _exchange_counted(self, request: web.Request, backend: Backend, call: Call,
                                look_elsewhere: bool = False) -> web.StreamResponse:
        self.router.acquire(backend)
        try:
            return await self._exchange(request, backend, call, look_elsewhere)
        finally:
            self.router.release(backend)

    async def _exchange(self, request: web.Request, backend: Backend, call: Call,
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
        except asyncio.CancelledError:
            self._cancel_later(backend, call.request_id)
            raise
        except BackendTimeout as exc:
            raise await self._rolled_back_or_not(backend, call, exc) from None
        error = error_of(payload) if upstream.status >= 400 else None
        self.router.record_answer(backend, call.session_id, upstream.status, upstream.headers,
                                  error["type"] if error else None)
        out_headers = answer_headers(request, upstream, backend.index, call.request_id)
        if error is not None:
            response = error_response(request, upstream.status, {"error": error}, out_headers)
            if look_elsewhere and upstream.status == 404 and error["type"] == SessionNotFound.type:
                raise _Missing(response)
            return response
        if call.events and upstream.status == 200:  # a JSON answer on the stream path (a CLOSE): one part
            return await self._single_part(request, payload, out_headers, upstream.content_type)
        return web.Response(status=upstream.status, body=payload, headers=out_headers)

    async def _send(self, backend: Backend, call: Call) -> aiohttp.ClientResponse:
        """POST to the backend; returns once its status and headers are in."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.health_timeout_s,
                                        sock_read=self.config.timeout_s)
        try:
            return await self.http.post(backend.url + call.path, data=call.body, headers=call.headers,
                                        timeout=timeout)
        except asyncio.TimeoutError:
            raise BackendTimeout(f"backend {backend.index} did not answer within {self.config.timeout_s:g} s") \
                from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A kept-alive connection to a backend that has died fails as a reset, not a refusal.
            if not await self.health.alive(backend):
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
                            call: Call) -> web.StreamResponse:
        """Relay an SSE answer chunk by chunk: as SSE, or as one PayloadPart event per SSE event."""
        headers = answer_headers(request, upstream, backend.index, call.request_id)
        if call.events:
            headers["Content-Type"] = EVENT_STREAM
            headers[PAYLOAD_CONTENT_TYPE_HEADER] = SSE_CONTENT_TYPE
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        try:
            await _relay_chunks(upstream, response, call.events)
        except _ClientGone:
            logger.info("client left during the stream of request %s; cancelling it on backend %d",
                        call.request_id, backend.index)
            self._cancel_later(backend, call.request_id)
            raise ConnectionResetError("client disconnected") from None
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # The status line is gone already: end the stream with an error in its own format.
            error: ResidentError
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

    async def _rolled_back_or_not(self, backend: Backend, call: Call, timeout: BackendTimeout) -> BackendTimeout:
        """The 504 for a request the front gave up on, once the backend was told to cancel it: whether
        its turn may have been committed all the same. The cancel runs as a task of its own (a client
        that leaves meanwhile cancels only this wait)."""
        self.num_cancels_sent += 1
        cancelled = await asyncio.shield(self.in_background(self._cancel(backend, call.request_id)))
        named = {REQUEST_ID_HEADER: call.request_id}
        if cancelled:
            return BackendTimeout(f"{timeout.message}; the request was stopped there and its turn rolled back: "
                                  "sending it again is safe", may_have_committed=False, headers=named)
        why = ("it had finished there before the cancel came, so its turn may be part of the session"
               if cancelled is False else "the cancel did not reach it, so it may still finish there")
        return BackendTimeout(f"{timeout.message}; {why}: check the session before sending it again",
                              may_have_committed=True, headers=named)

    def _cancel_later(self, backend: Backend, request_id: str) -> None:
        """Tell the backend to stop ``request_id``, in the background (the caller may be cancelled itself)."""
        self.num_cancels_sent += 1
        self.in_background(self._cancel(backend, request_id))

    async def _cancel(self, backend: Backend, request_id: str) -> bool | None:
        cancelled = await self.admin.cancel(backend, request_id)
        logger.info("cancel of request %s on backend %d: %s", request_id, backend.index,
                    {True: "stopped", False: "already finished", None: "not delivered"}[cancelled])
        return cancelled

    @staticmethod
    async def _single_part(request: web.Request, payload: bytes, headers: CIMultiDict,
                           content_type: str) -> web.StreamResponse:
        headers["Content-Type"] = EVENT_STREAM
        headers[PAYLOAD_CONTENT_TYPE_HEADER] = content_type
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        await response.write(payload_part(payload))
        await response.write_eof()
        return response


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


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError too
        raise _ClientGone() from exc
