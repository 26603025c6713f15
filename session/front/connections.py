"""The front's listening socket, guarded: a cap on open connections, a deadline for each request's
head, and a cap on each client's requests in flight.

aiohttp's server reads a request's head for as long as the client takes (a client that sends its
headers a byte at a time holds a connection and a parser forever) and accepts every connection
it is offered. ``GuardedSite`` listens like ``web.TCPSite``, but wraps each connection's protocol
(aiohttp's ``RequestHandler``) in ``_Guarded``, which:

- refuses a connection past ``max_connections`` open ones with a 503 written straight to the socket
  (``Connection: close``), before aiohttp sees it;
- closes a connection whose request head (request line and headers, up to the blank line) has not
  arrived within ``header_timeout_s`` of its first byte, or of the connection opening for the first
  request. Between requests an idle kept-alive connection is aiohttp's to close
  (``keepalive_timeout``, the front's ``idle_timeout_s``); the body has its own deadline, where the
  front reads it (``Front._read_body``).

``ClientLimiter`` counts each client's requests in flight for the front's middleware, which answers
429 past ``max_requests_per_client``. A client is a tenant (``tenants``): the API key's or the
trusted header's, else the peer address, which behind a load balancer every tenant shares.

Who calls this: ``Front.start`` (the site) and the front's middleware (the limiter), on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from contextlib import contextmanager

from aiohttp import web

from session.errors import TooManyRequests

logger = logging.getLogger(__name__)

HEAD_END = b"\r\n\r\n"


def _refusal() -> bytes:
    body = json.dumps({"error": {"type": "capacity_exceeded",
                                 "message": "the front has as many connections open as it allows "
                                            "(RESIDENT_FRONT_MAX_CONNECTIONS); retry later"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


REFUSAL = _refusal()


class ConnectionGuard:
    """The counts and limits every guarded connection of one site shares."""

    def __init__(self, *, max_connections: int, header_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.num_open = 0
        self.num_refused = 0  # connections refused past max_connections
        self.num_timed_out = 0  # connections closed for a request head slower than header_timeout_s
        self._by_transport: dict[asyncio.BaseTransport, _Guarded] = {}

    def request_done(self, transport: asyncio.BaseTransport | None) -> None:
        """A request on this connection was answered: its next head gets a fresh deadline (the front's
        middleware calls this)."""
        guarded = self._by_transport.get(transport) if transport is not None else None
        if guarded is not None:
            guarded.await_head()


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, the guard's limits around it."""

    def __init__(self, make_inner, guard: ConnectionGuard):
        self.make_inner = make_inner  # aiohttp's Server: called once the connection is accepted
        self.inner: asyncio.Protocol | None = None
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.counted = False
        self._in_head = True  # reading a request head (until its blank line)
        self._tail = b""  # the last bytes of the head so far: its end may straddle two reads
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        if guard.num_open >= guard.max_connections:
            guard.num_refused += 1
            transport.write(REFUSAL)
            transport.close()
            return
        guard.num_open += 1
        self.counted = True
        self.transport = transport
        guard._by_transport[transport] = self
        self._arm()
        self.inner = self.make_inner()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.counted:
            return
        if self._in_head:
            if self._deadline is None:
                self._arm()
            seen = self._tail + data
            if HEAD_END in seen:
                self._in_head = False
                self._tail = b""
                self._disarm()
            else:
                self._tail = seen[-(len(HEAD_END) - 1):]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.counted:
            return
        self.counted = False
        self._disarm()
        self.guard.num_open -= 1
        self.guard._by_transport.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.counted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.counted:
            self.inner.resume_writing()

    def await_head(self) -> None:
        """The next bytes begin a request head; its deadline starts with them."""
        self._in_head = True
        self._tail = b""

    def _arm(self) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._in_head and self.transport is not None and not self.transport.is_closing():
            self.guard.num_timed_out += 1
            logger.info("closing a connection from %s: no complete request head within %g s",
                        self.transport.get_extra_info("peername"), self.guard.header_timeout_s)
            self.transport.close()


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with every connection guarded (``ConnectionGuard``)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, *, backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self.guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        self._server = await loop.create_server(lambda: _Guarded(server, self.guard), self._host, self._port,
                                                backlog=self._backlog, reuse_address=True)


class ClientLimiter:
    """Requests in flight per tenant; ``admit`` raises TooManyRequests (429) past the limit (0: none)."""

    def __init__(self, max_per_client: int):
        self.max_per_client = max_per_client
        self.in_flight: Counter[str] = Counter()  # tenant -> its requests in flight
        self.num_refused = 0

    @contextmanager
    def admit(self, tenant: str):
        if self.max_per_client and self.in_flight[tenant] >= self.max_per_client:
            self.num_refused += 1
            raise TooManyRequests(f"tenant {tenant} has {self.in_flight[tenant]} requests in flight, as many as the "
                                  "front allows one (RESIDENT_FRONT_MAX_REQUESTS_PER_CLIENT); wait for one to end")
        self.in_flight[tenant] += 1
        try:
            yield
        finally:
            self.in_flight[tenant] -= 1
            if not self.in_flight[tenant]:
                del self.in_flight[tenant]
