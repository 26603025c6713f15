"""Finding the backend that holds a session when neither a pin nor the id's tag says (or says wrong).

The front (``session/front/server.py``) calls ``SessionLocator.find`` for a follow-up whose id carries no
known tag, whose tagged backend answered 404 (the session was moved by a drain) or is down. It asks
every healthy backend for its sessions (``{"sessions": "list"}``, an admin request). Fan-outs are
shared: a look-up that arrives while one is in flight waits for it, and a listing serves later
look-ups for ``max_age_s``, so a burst of unknown ids (a client retrying a closed session, many
moved sessions at once) costs one round of list requests, not one per request. A session found
nowhere is looked for once more, ``retry_s`` later, in a fresh listing: another front may have been
moving it (between its export and its import it is on no backend).

Runs on the front's event loop; an injected clock for tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from session.front.backend_client import BackendAdmin
from session.front.router import Backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listing:
    """Every healthy backend's sessions at one moment."""

    taken_at: float  # clock time when the fan-out began
    where: dict[str, tuple[Backend, float]]  # session_id -> (the backend holding it, its expires_at)


class SessionLocator:
    def __init__(self, admin: BackendAdmin, backends: Callable[[], list[Backend]], *, max_age_s: float = 0.2,
                 retry_s: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self.admin = admin
        self.backends = backends  # the backends to ask: the router's healthy ones, at the time of asking
        self.max_age_s = max_age_s
        self.retry_s = retry_s
        self.clock = clock
        self._listing: Listing | None = None
        self._fan_out: tuple[float, asyncio.Task] | None = None  # (its start, the task) while one runs
        self.num_lookups = 0
        self.num_fan_outs = 0

    async def find(self, session_id: str, exclude: tuple[Backend, ...] = ()) -> tuple[Backend, float] | None:
        """(backend, expires_at) of the session, on a backend not in ``exclude``; None if none holds it."""
        self.num_lookups += 1
        listing = await self._listing_since(self.clock() - self.max_age_s)
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(self.retry_s)
                # Strictly newer than the one that did not have it (however the clock moved).
                listing = await self._listing_since(max(self.clock(), listing.taken_at + 1e-9))
            found = listing.where.get(session_id)
            if found is not None and found[0] not in exclude:
                return found
        return None

    async def _listing_since(self, not_before: float) -> Listing:
        """A listing whose fan-out began at ``not_before`` or later: the last one, the one in flight, or a new one."""
        if self._listing is not None and self._listing.taken_at >= not_before:
            return self._listing
        if self._fan_out is None or self._fan_out[0] < not_before:
            started = self.clock()
            self._fan_out = (started, asyncio.get_running_loop().create_task(self._list_all(started)))
        # Shielded: a request that gives up must not cancel the listing others wait for.
        return await asyncio.shield(self._fan_out[1])

    async def _list_all(self, started: float) -> Listing:
        self.num_fan_outs += 1
        backends = self.backends()
        answers = await asyncio.gather(*(self.admin.list_sessions(b) for b in backends), return_exceptions=True)
        where: dict[str, tuple[Backend, float]] = {}
        for backend, sessions in zip(backends, answers):
            if isinstance(sessions, BaseException):
                logger.warning("backend %d could not list its sessions: %r", backend.index, sessions)
                continue
            for info in sessions:
                where[info.session_id] = (backend, info.expires_at)
        listing = Listing(taken_at=started, where=where)
        if self._listing is None or self._listing.taken_at <= started:
            self._listing = listing
        if self._fan_out is not None and self._fan_out[0] == started:
            self._fan_out = None
        return listing
