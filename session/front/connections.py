"""The front's listening socket, guarded: caps on open connections (in all, and per peer address),
deadlines for each request's head and for each answer's writes, and a cap on each client's requests
in flight.

aiohttp's server reads a request's head for as long as the client takes (a client that sends its
headers a byte at a time holds a connection and a parser forever), writes an answer for as long as
the client takes to read it, and accepts every connection it is offered. ``GuardedSite`` listens
like ``web.TCPSite``, but wraps each connection's protocol (aiohttp's ``RequestHandler``) in
``_Guarded``, which:

- keeps at most ``max_connections`` connections open, and at most ``max_per_address`` from one peer
  address. A connection past either cap makes room by closing the oldest *idle* connection (of that
  address, for its cap): one between requests, with nothing left to send. Only when every connection
  it could close is in a request is the new one refused, with a 503 written straight to the socket
  (``Connection: close``) before aiohttp sees it. So idle kept-alive connections (a ``/ping`` each,
  say) never lock others out, and one address cannot hold every connection;
- closes a connection whose request head (request line and headers, up to the blank line) has not
  arrived within ``header_timeout_s`` of its first byte, or of the connection opening for the first
  request. Between requests an idle kept-alive connection is aiohttp's to close
  (``keepalive_timeout``, the front's ``idle_timeout_s``); the body has its own deadline, where the
  front reads it (``Front._read_body``);
- aborts a connection whose client has not read what the front writes for ``write_timeout_s``: the
  transport's buffer stayed above its high-water mark (asyncio's ``pause_writing`` until
  ``resume_writing``) that long. aiohttp then cancels the request's handler, which cancels the
  request on its backend (``forwarding``), as for a client that hung up.

``ClientLimiter`` counts each client's requests in flight for the front's middleware, which answers
429 past ``max_requests_per_client``. A client is a tenant (``tenants``): the API key's or the
trusted header's, else the peer address, which behind a load balancer every tenant shares.

Who calls this: ``Front.start`` (the site) and the front's middleware (the limiter, ``request_done``),
on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from contextlib import contextmanager
from typing import cast

from aiohttp import web

from session.errors import TooManyRequests

logger = logging.getLogger(__name__)

HEAD_END = b"\r\n\r\n"


def _refusal(why: str) -> bytes:
    body = json.dumps({"error": {"type": "capacity_exceeded", "message": why + "; retry later"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


REFUSAL = _refusal("the front has as many connections open as it allows (RESIDENT_FRONT_MAX_CONNECTIONS), "
                   "all of them in a request")
ADDRESS_REFUSAL = _refusal("your address has as many connections open as the front allows one "
                           "(RESIDENT_FRONT_MAX_CONNECTIONS_PER_ADDRESS), all of them in a request")


class ConnectionGuard:
    """The counts and limits every guarded connection of one site shares."""

    def __init__(self, *, max_connections: int, header_timeout_s: float, max_per_address: int = 0,
                 write_timeout_s: float = 30.0):
        self.max_connections = max_connections
        self.max_per_address = max_per_address  # 0: no cap per address
        self.header_timeout_s = header_timeout_s
        self.write_timeout_s = write_timeout_s
        self.num_open = 0
        self.num_refused = 0  # connections refused at a cap, none there idle
        self.num_evicted = 0  # idle connections closed to make room for a new one
        self.num_timed_out = 0  # connections closed for a request head slower than header_timeout_s
        self.num_write_timeouts = 0  # connections aborted for a client that read nothing for write_timeout_s
        self.open_by_address: Counter[str] = Counter()  # peer address -> its open connections
        self._idle: dict[_Guarded, None] = {}  # connections between requests, the longest idle first
        self._by_transport: dict[asyncio.BaseTransport, _Guarded] = {}

    def request_done(self, transport: asyncio.BaseTransport | None) -> None:
        """A request on this connection was answered: the connection is idle, and its next head gets a
        fresh deadline (the front's middleware calls this, as the handler returns)."""
        guarded = self._by_transport.get(transport) if transport is not None else None
        if guarded is not None:
            guarded.await_head()

    def admit(self, guarded: _Guarded) -> bytes | None:
        """Room for a new connection from ``guarded.address``, made by closing an idle one if need be;
        the refusal to write when there is none."""
        address = guarded.address
        if self.max_per_address and self.open_by_address[address] >= self.max_per_address:
            if not self._evict_idle(address):
                return ADDRESS_REFUSAL
        if self.num_open >= self.max_connections and not self._evict_idle(None):
            return REFUSAL
        self.num_open += 1
        self.open_by_address[address] += 1
        assert guarded.transport is not None, "admitted from connection_made, which sets it"
        self._by_transport[guarded.transport] = guarded
        self._idle[guarded] = None
        return None

    def release(self, guarded: _Guarded) -> None:
        self.num_open -= 1
        self.open_by_address[guarded.address] -= 1
        if not self.open_by_address[guarded.address]:
            del self.open_by_address[guarded.address]
        if guarded.transport is not None:
            self._by_transport.pop(guarded.transport, None)
        self._idle.pop(guarded, None)

    def mark_idle(self, guarded: _Guarded) -> None:
        self._idle.pop(guarded, None)
        self._idle[guarded] = None  # now the newest

    def mark_busy(self, guarded: _Guarded) -> None:
        self._idle.pop(guarded, None)

    def _evict_idle(self, address: str | None) -> bool:
        """Close the longest idle connection (from ``address``, unless None) with nothing left to send."""
        for guarded in self._idle:
            if address is not None and guarded.address != address:
                continue
            if guarded.transport is not None and guarded.transport.get_write_buffer_size():
                continue  # its last answer is still on its way out
            self.num_evicted += 1
            guarded.close_idle()
            return True
        return False


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, the guard's limits around it."""

    def __init__(self, make_inner, guard: ConnectionGuard):
        self.make_inner = make_inner  # aiohttp's Server: called once the connection is accepted
        self.inner: asyncio.Protocol | None = None  # None: refused
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.address = ""  # the peer's IP address
        self.counted = False  # in the guard's counts (until closed)
        self._in_head = True  # reading a request head (until its blank line)
        self._tail = b""  # the last bytes of the head so far: its end may straddle two reads
        self._deadline: asyncio.TimerHandle | None = None  # for the head
        self._write_deadline: asyncio.TimerHandle | None = None  # while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server's protocol is handed a Transport (asyncio.Protocol's contract; typeshed types
        # every protocol's argument as the base)
        self.transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        refusal = self.guard.admit(self)
        if refusal is not None:
            self.guard.num_refused += 1
            transport.write(refusal)
            transport.close()
            return
        self.counted = True
        self._arm()
        self.inner = self.make_inner()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self._in_head:
            if self._deadline is None:
                self._arm()
            if self.counted and data:
                self.guard.mark_busy(self)  # a request has begun
            seen = self._tail + data
            if HEAD_END in seen:
                self._in_head = False
                self._tail = b""
                self._disarm()
            else:
                self._tail = seen[-(len(HEAD_END) - 1):]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        self._forget()
        self._cancel_write_deadline()
        self.inner.connection_lost(exc)
        self.inner = None

    def pause_writing(self) -> None:
        if self.inner is None:
            return
        if self._write_deadline is None:
            self._write_deadline = asyncio.get_running_loop().call_later(self.guard.write_timeout_s,
                                                                         self._write_expired)
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is None:
            return
        self._cancel_write_deadline()
        self.inner.resume_writing()

    def await_head(self) -> None:
        """The request was answered: idle until the next head begins, whose deadline starts with it.
        Called as the handler returns; aiohttp writes a non-streamed answer right after, without
        yielding to the loop, so no other connection's accept sees this one idle with its answer
        unwritten (and ``_evict_idle`` skips one whose answer is still in the transport's buffer)."""
        self._in_head = True
        self._tail = b""
        if self.counted:
            self.guard.mark_idle(self)

    def close_idle(self) -> None:
        """Closed by the guard to make room: out of its counts now, not when the loop reports it closed."""
        self._forget()
        if self.transport is not None:
            self.transport.close()

    def _forget(self) -> None:
        if self.counted:
            self.counted = False
            self._disarm()
            self.guard.release(self)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._in_head and self.transport is not None and not self.transport.is_closing():
            self.guard.num_timed_out += 1
            logger.info("closing a connection from %s: no complete request head within %g s",
                        self.transport.get_extra_info("peername"), self.guard.header_timeout_s)
            self.transport.close()

    def _write_expired(self) -> None:
        """The client read nothing of what was written for write_timeout_s: abort (close would wait
        for the buffer to drain, which it never does)."""
        self._write_deadline = None
        if self.transport is not None and not self.transport.is_closing():
            self.guard.num_write_timeouts += 1
            logger.info("aborting a connection from %s: the client read nothing of its answer for %g s "
                        "(RESIDENT_FRONT_WRITE_TIMEOUT_S)", self.address, self.guard.write_timeout_s)
            self.transport.abort()


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
