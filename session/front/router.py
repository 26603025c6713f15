"""Sticky routing bookkeeping for the front: backends, their health and load, and where sessions live.

Plain Python, no I/O, no clock of its own beyond the one it is given. The front
(``session/front/server.py``) calls it around every forwarded request: ``pick`` or ``route`` to choose a
backend, ``acquire``/``release`` around the request, ``record_answer`` with the backend's status
and headers; its health loop calls ``record_probe`` and ``expire``; a drain calls ``pin`` for
every session it moved.

The rules (docs/DESIGN.md, "TorchServe as we found it", docs/ROUTING.md):
- New sessions and stateless requests go to the healthy, not draining backend with the fewest
  outstanding requests; ties go to the one holding the fewest sessions, then the lowest index.
- A session's route needs no table: a backend started with ``RESIDENT_SESSION_ID_TAG=<tag>``
  creates ids ``<uuid4>-<tag>``, and ``route`` sends such an id to the backend with that tag (its
  *home*). A restarted front, or a second one, therefore routes every existing session at once.
- Pins are a cache on top, for what the id cannot say: a session moved off its home by a drain,
  or an untagged id found by asking the backends (the front's look-up). A pin wins over the tag.
  It lasts until the ``Expires`` of the session's answer (plus a small grace), extended by the
  session's TTL on every answered request; it is forgotten on
  ``X-Amzn-SageMaker-Closed-Session-Id``, on a 404 ``session_not_found`` from its backend, and on
  expiry. An expired pin is only forgotten: the backend, which owns the session, decides whether
  the session still lives (another front may have kept it alive).
- ``route`` raises ``SessionNotFound`` when neither a pin nor a tag names a backend, and
  ``SessionBackendUnavailable`` (410) when the backend named is down; the front then asks the
  backends where the session is before it answers either.
- A backend is down after ``unhealthy_after`` failed health probes in a row, or at once when it
  refuses a connection (``mark_down``); one good probe makes it healthy again. A draining backend
  (``drain``) keeps serving its sessions until they are moved but gets no new ones.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from session.errors import BackendUnavailable, SessionBackendUnavailable, SessionNotFound
from session.serving.protocol import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, header

logger = logging.getLogger(__name__)

# Time a pin outlives the backend's own expiry, so that the backend answers "expired" itself.
EXPIRY_GRACE_S = 5.0
# A tagged session id: a uuid4, a dash, the tag of the backend that created it.
_HEX = "[0-9a-fA-F]"
_TAGGED_ID_RE = re.compile(rf"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}-([A-Za-z0-9]+)$")
_NEW_SESSION_VALUE_RE = re.compile(r"^\s*([^;\s]+)\s*(?:;\s*Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\s*)?$")


@dataclass
class Backend:
    index: int
    url: str  # inference base URL, e.g. http://127.0.0.1:9000
    management_url: str | None = None  # TorchServe management API; None: health is GET /ping alone
    # The suffix of the session ids it creates (its RESIDENT_SESSION_ID_TAG); "" = none. "<prefix>*"
    # matches every tag that starts with <prefix>: an instance whose own front has several backends.
    tag: str = ""
    healthy: bool = False  # until the first good probe
    draining: bool = False  # being emptied: serves its sessions, gets no new ones
    num_outstanding: int = 0  # requests forwarded and not finished (streams count until their end)
    num_sessions: int = 0  # sessions pinned here
    num_requests: int = 0  # requests forwarded here, ever
    num_failed_probes: int = 0  # consecutive


@dataclass
class Pin:
    backend: Backend
    ttl_s: float  # how far each answered request pushes the expiry
    expires_at: float  # epoch seconds, as the backend's Expires


def session_tag(session_id: str) -> str | None:
    """The backend tag in ``<uuid4>-<tag>``; None for a plain uuid4 or any other id."""
    match = _TAGGED_ID_RE.match(session_id)
    return match.group(1) if match else None


def _tags_overlap(a: str, b: str) -> bool:
    """Whether one session tag could match both tag patterns."""
    if a == b:
        return True
    prefix_a, prefix_b = a.rstrip("*"), b.rstrip("*")
    return (a.endswith("*") and prefix_b.startswith(prefix_a)) or (b.endswith("*") and prefix_a.startswith(prefix_b))


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
        self.pins: dict[str, Pin] = {}  # session_id -> the backend holding it, where the id does not say
        self.by_tag: dict[str, Backend] = {}  # tag (or "<prefix>*") -> the backend that creates ids with it
        for backend in self.backends:
            if backend.tag:
                clash = next((b for t, b in self.by_tag.items() if _tags_overlap(t, backend.tag)), None)
                if clash is not None:
                    raise ValueError(f"backends {clash.index} and {backend.index} share the session id tag "
                                     f"{backend.tag!r} (or a prefix of it); give each its own")
                self.by_tag[backend.tag] = backend

    # ------------------------------------------------------------ choosing a backend

    @property
    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Iterable[Backend] = ()) -> Backend:
        """The backend for a new session or a stateless request. Raises BackendUnavailable."""
        excluded = {b.index for b in exclude}
        candidates = [b for b in self.healthy_backends if b.index not in excluded and not b.draining]
        if not candidates:
            raise BackendUnavailable("no healthy backend can take this request; retry shortly", retry_after_s=2)
        return min(candidates, key=lambda b: (b.num_outstanding, b.num_sessions, b.index))

    def route(self, session_id: str) -> Backend:
        """The backend holding ``session_id``: its pin, else the backend its tag names.
        Raises SessionNotFound or SessionBackendUnavailable."""
        pin = self.pins.get(session_id)
        if pin is not None and pin.expires_at + EXPIRY_GRACE_S <= self.clock():
            self.forget(session_id)
            pin = None
        backend = pin.backend if pin is not None else self.home(session_id)
        if backend is None:
            raise SessionNotFound(f"session {session_id} is unknown to this endpoint (never opened, closed or "
                                  "expired); open a new one with NEW_SESSION")
        if not backend.healthy:
            raise SessionBackendUnavailable(
                f"the backend holding session {session_id} is unavailable and the session's state was held "
                "there; open a new session with NEW_SESSION")
        return backend

    def home(self, session_id: str) -> Backend | None:
        """The backend whose tag the id carries: the one that created the session."""
        tag = session_tag(session_id)
        if tag is None:
            return None
        if tag in self.by_tag:
            return self.by_tag[tag]
        return next((b for t, b in self.by_tag.items() if t.endswith("*") and tag.startswith(t[:-1])), None)

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

    # ------------------------------------------------------------ draining

    def drain(self, backend: Backend) -> None:
        """Take ``backend`` out of ``pick`` while its sessions are moved off it (the front's drain)."""
        backend.draining = True

    def resume(self, backend: Backend) -> None:
        """Put a drained backend back into ``pick`` (after its restart)."""
        backend.draining = False

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
