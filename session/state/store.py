"""Session bookkeeping: ids, expiry, byte counts. Plain Python; the engine owns the tensors.

Who calls this: the engine loop thread only (it serialises every mutation), except the
read-only counters, which are safe to read from any thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from cachetools import LRUCache

from session.errors import CapacityExceeded, SessionExists, SessionNotFound, TooManyRequests
from session.state.session import SessionState


class SessionStore:
    def __init__(self, *, ttl_s: float, max_sessions: int, clock: Callable[[], float], max_per_tenant: int = 0):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_per_tenant = max_per_tenant  # 0: no share
        self.per_tenant: Counter[str] = Counter()  # live sessions (not ephemeral) by tenant
        self.clock = clock
        self._sessions: dict[str, SessionState] = {}  # session_id -> state
        self._ended: LRUCache = LRUCache(maxsize=100_000)  # session_id -> "closed" | "expired", for messages
        self.num_opened = 0
        self.num_closed = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def all_sessions(self) -> list[SessionState]:
        return list(self._sessions.values())

    def can_open(self) -> bool:
        return len(self._sessions) < self.max_sessions

    def open(self, state: SessionState) -> SessionState:
        if state.session_id in self._sessions:  # replacing it would leak the live one's KV, images and count
            raise SessionExists(f"session {state.session_id} is already open on this worker")
        if not state.ephemeral and self.max_per_tenant and self.per_tenant[state.tenant] >= self.max_per_tenant:
            raise TooManyRequests(f"this tenant has {self.per_tenant[state.tenant]} sessions open on this worker, its "
                                  "share (RESIDENT_MAX_SESSIONS_PER_TENANT); close one (requestType CLOSE) or let one "
                                  "expire", retry_after_s=5)
        if not state.ephemeral and not self.can_open():
            raise CapacityExceeded(f"this worker holds its maximum of {self.max_sessions} sessions", retry_after_s=5)
        self._sessions[state.session_id] = state
        if not state.ephemeral:
            self.num_opened += 1
            self.per_tenant[state.tenant] += 1
        return state

    def get(self, session_id: str) -> SessionState:
        state = self._sessions.get(session_id)
        if state is None or state.ephemeral:
            reason = self._ended.get(session_id)
            detail = f"was {reason}" if reason else "is unknown on this worker"
            raise SessionNotFound(f"session {session_id} {detail}; open a new one with NEW_SESSION")
        return state

    def peek(self, session_id: str) -> SessionState | None:
        """The live session (ephemeral ones too) with this id, or None."""
        return self._sessions.get(session_id)

    def touch(self, state: SessionState) -> None:
        state.last_used_at = self.clock()
        state.expires_at = state.last_used_at + self.ttl_s

    def close(self, session_id: str, reason: str = "closed") -> SessionState:
        state = self._sessions.pop(session_id)
        state.release_tensors()
        if not state.ephemeral:
            self.per_tenant[state.tenant] -= 1
            if not self.per_tenant[state.tenant]:
                del self.per_tenant[state.tenant]
            self._ended[session_id] = reason
            if reason == "expired":
                self.num_expired += 1
            else:
                self.num_closed += 1
        return state

    def expired_ids(self) -> list[str]:
        """Idle sessions past their expiry; a session in a request never expires under it."""
        now = self.clock()
        return [sid for sid, s in self._sessions.items()
                if not s.busy and not s.ephemeral and s.expires_at <= now]
