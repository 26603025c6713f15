"""Sticky routing bookkeeping for the front: backends, their health and load, and session pins.

Plain Python, no I/O, no clock of its own beyond the one it is given. The front
(``session/front.py``) calls it around every forwarded request: ``pick`` or ``route`` to choose a
backend, ``acquire``/``release`` around the request, ``record_answer`` with the backend's status
and headers; its health loop calls ``record_probe`` and ``expire``.

The rules (DESIGN §5):
- New sessions and stateless requests go to the healthy backend with the fewest outstanding
  requests; ties go to the one holding the fewest sessions, then the lowest index.
- A session is pinned to the backend whose answer carried ``X-Amzn-SageMaker-New-Session-Id``,
  until the ``Expires`` given there (plus a small grace, so that the backend, which owns the
  session, is the one to declare it expired). Every answered request in the session extends the
  pin by the session's TTL (its first ``Expires`` minus the time it was opened).
- A pin is forgotten on ``X-Amzn-SageMaker-Closed-Session-Id``, on a 404 ``session_not_found``
  from the backend, and on expiry.
- A request for a session whose backend is down gets ``SessionBackendUnavailable``
  (410 ``session_backend_unavailable``): the session's KV cache and transcript lived in that
  backend's memory, so the caller must open a new session. The pin is kept until it expires, so
  that a backend that comes back with its sessions (a missed health check) serves them again; a
  backend that comes back empty answers 404 and the pin goes.
- A backend is down after ``unhealthy_after`` failed health probes in a row, or at once when it
  refuses a connection (``mark_down``); one good probe makes it healthy again.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Iterable, Mapping

from session.errors import BackendUnavailable, SessionBackendUnavailable, SessionNotFound
from session.protocol import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, header

logger = logging.getLogger(__name__)

# Time a pin outlives the backend's own expiry, so that the backend answers "expired" itself.
EXPIRY_GRACE_S = 5.0
_NEW_SESSION_VALUE_RE = re.compile(r"^\s*([^;\s]+)\s*(?:;\s*Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\s*)?$")


@dataclass
class Backend:
    index: int
    url: str  # inference base URL, e.g. http://127.0.0.1:9000
    management_url: str | None = None  # TorchServe management API; None: health is GET /ping alone
    healthy: bool = False  # until the first good probe
    num_outstanding: int = 0  # requests forwarded and not finished (streams count until their end)
    num_sessions: int = 0  # sessions pinned here
    num_requests: int = 0  # requests forwarded here, ever
    num_failed_probes: int = 0  # consecutive


@dataclass
class Pin:
    backend: Backend
    ttl_s: float  # how far each answered request pushes the expiry
    expires_at: float  # epoch seconds, as the backend's Expires


def parse_new_session_header(value: str) -> tuple[str, float | None]:
    """``"<id>; Expires=2026-11-30T09:19:49Z"`` -> (id, epoch seconds); Expires may be absent."""
    match = _NEW_SESSION_VALUE_RE.match(value)
    if match is None:
        raise ValueError(f"malformed {NEW_SESSION_HEADER} value {value!r}")
    session_id, expires = match.groups()
    if expires is None:
        return session_id, None
    when = datetime.strptime(expires, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    return session_id, when.timestamp()


class Router:
    def __init__(self, backends: Iterable[Backend], *, unhealthy_after: int = 3, default_ttl_s: float = 1200.0,
                 clock: Callable[[], float] = time.time):
        self.backends = list(backends)
        if not self.backends:
            raise ValueError("the router needs at least one backend")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self.unhealthy_after = unhealthy_after
        self.default_ttl_s = default_ttl_s  # when a backend's New-Session-Id carries no Expires
        self.clock = clock
        self.pins: dict[str, Pin] = {}  # session_id -> the backend holding it

    # ------------------------------------------------------------ choosing a backend

    @property
    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Iterable[Backend] = ()) -> Backend:
        """The backend for a new session or a stateless request. Raises BackendUnavailable."""
        excluded = {b.index for b in exclude}
        candidates = [b for b in self.healthy_backends if b.index not in excluded]
        if not candidates:
            raise BackendUnavailable("no healthy backend can take this request; retry shortly", retry_after_s=2)
        return min(candidates, key=lambda b: (b.num_outstanding, b.num_sessions, b.index))

    def route(self, session_id: str) -> Backend:
        """The backend holding ``session_id``. Raises SessionNotFound or SessionBackendUnavailable."""
        pin = self.pins.get(session_id)
        if pin is not None and pin.expires_at + EXPIRY_GRACE_S <= self.clock():
            self.forget(session_id)
            raise SessionNotFound(f"session {session_id} has expired; open a new one with NEW_SESSION")
        if pin is None:
            raise SessionNotFound(f"session {session_id} is unknown to this endpoint (never opened, closed or "
                                  "expired); open a new one with NEW_SESSION")
        if not pin.backend.healthy:
            raise SessionBackendUnavailable(
                f"the backend holding session {session_id} is unavailable and the session's state was held "
                "there; open a new session with NEW_SESSION")
        return pin.backend

    # ------------------------------------------------------------ load

    def acquire(self, backend: Backend) -> None:
        """Called when a request is forwarded to ``backend``."""
        backend.num_outstanding += 1
        backend.num_requests += 1

    def release(self, backend: Backend) -> None:
        """Called when that request's answer has been relayed in full (or has failed)."""
        assert backend.num_outstanding > 0, f"release without acquire on backend {backend.index}"
        backend.num_outstanding -= 1

    # ------------------------------------------------------------ pins

    def record_answer(self, backend: Backend, session_id: str | None, status: int, headers: Mapping[str, str],
                      error_type: str | None = None) -> None:
        """Learn from a backend's answer; called once its status and headers are in.

        ``session_id`` is the id the request carried (None for stateless, NEW_SESSION to open);
        ``error_type`` is the ``error.type`` of a JSON error body, when there is one.
        """
        opened = header(headers, NEW_SESSION_HEADER)
        closed = header(headers, CLOSED_SESSION_HEADER)
        if opened is not None:
            try:
                new_id, expires_at = parse_new_session_header(opened)
            except ValueError:
                logger.warning("backend %d sent a malformed %s: %r", backend.index, NEW_SESSION_HEADER, opened)
            else:
                self.pin(new_id, backend, expires_at)
        if closed is not None:
            self.forget(closed.strip())
        elif session_id in self.pins and self.pins[session_id].backend is backend:
            if status == 404 and error_type == SessionNotFound.type:
                self.forget(session_id)
            elif status == 200:
                self.touch(session_id)

    def pin(self, session_id: str, backend: Backend, expires_at: float | None) -> Pin:
        now = self.clock()
        ttl_s = self.default_ttl_s if expires_at is None else max(expires_at - now, 0.0)
        self.forget(session_id)
        pin = Pin(backend=backend, ttl_s=ttl_s, expires_at=now + ttl_s)
        self.pins[session_id] = pin
        backend.num_sessions += 1
        return pin

    def touch(self, session_id: str) -> None:
        pin = self.pins[session_id]
        pin.expires_at = max(pin.expires_at, self.clock() + pin.ttl_s)

    def forget(self, session_id: str) -> bool:
        """Drop a pin; returns whether there was one."""
        pin = self.pins.pop(session_id, None)
        if pin is None:
            return False
        pin.backend.num_sessions -= 1
        return True

    def expire(self) -> list[str]:
        """Forget every pin past its expiry (and grace); returns their ids. Called by the health loop."""
        deadline = self.clock() - EXPIRY_GRACE_S
        expired = [sid for sid, pin in self.pins.items() if pin.expires_at <= deadline]
        for session_id in expired:
            self.forget(session_id)
        return expired

    # ------------------------------------------------------------ health

    def record_probe(self, backend: Backend, ok: bool) -> bool:
        """One health probe's outcome; returns whether the backend's health changed."""
        was = backend.healthy
        if ok:
            backend.num_failed_probes = 0
            backend.healthy = True
        else:
            backend.num_failed_probes += 1
            if backend.num_failed_probes >= self.unhealthy_after:
                backend.healthy = False
        return backend.healthy != was

    def mark_down(self, backend: Backend) -> bool:
        """The backend refused a connection: down at once. Returns whether its health changed."""
        was = backend.healthy
        backend.healthy = False
        backend.num_failed_probes = max(backend.num_failed_probes, self.unhealthy_after)
        return was
