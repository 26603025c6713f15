"""Admission: each request taken from the inbox becomes a scheduled sequence, a queued request behind
its session's request in flight, or an immediate answer (cancel, close, admin).

Who calls this: the engine loop thread, between steps (``Engine._admit_arrivals``), and after a
request ended (``admit_next``: what waited behind it on the session). Requests on one session are
admitted in arrival order, one in flight at a time.

A moving session (exported, its move neither confirmed nor aborted: ``session/state/sessions.py``)
takes no request: generations, closes and exports for it are held here, in arrival order, until the
move ends. Confirmed (``forget``), they are admitted again and find the session moved (404, which
sends the front to the target); aborted (``resume``) or timed out (``end_overdue_moves``, called with
the reaper), they run here as if they had just arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from session.engine import admin
from session.engine.events import AdminResult, Cancelled, Closed, Failed
from session.engine.requests import (
    AdapterRequest,
    CancelRequest,
    CloseRequest,
    EngineRequest,
    GenerationRequest,
    Sequence,
    SessionAdminRequest,
)
from session.errors import AdapterMismatch, BadRequest, ResidentError, SessionNotFound
from session.types import new_session_id, redact

if TYPE_CHECKING:
    from session.engine.scheduler import Scheduler
    from session.model.lora import AdapterRegistry
    from session.state.sessions import Sessions

logger = logging.getLogger(__name__)


class Admission:
    def __init__(self, *, scheduler: Scheduler, sessions: Sessions, adapters: AdapterRegistry | None,
                 vocab_size: int, session_ttl_s: float, clock: Callable[[], float],
                 end: Callable[[Sequence, Cancelled], None], on_barrier: Callable[[], None]):
        self.scheduler = scheduler
        self.sessions = sessions
        self.adapters = adapters
        self.vocab_size = vocab_size  # the logits' width: a logit_bias id at or above it names no token
        self.session_ttl_s = session_ttl_s
        self.clock = clock
        self.end = end  # Engine.end: the one place a request in flight ends
        self.on_barrier = on_barrier  # an empty cancel is a barrier (Engine.fresh_stats): publish first
        self.num_cancelled_queued = 0  # queued generations cancelled before they were admitted
        self.held: dict[str, list] = {}  # session_id -> requests that arrived while it was moving, in order

    def admit(self, item: EngineRequest) -> bool:
        """Admit one request; True when it now waits or runs (a generation in flight)."""
        try:
            if isinstance(item, GenerationRequest):
                return self._generation(item)
            if isinstance(item, CancelRequest):
                if not item.target_request_id:  # fresh_stats' barrier
                    self.on_barrier()
                item.stream.put(AdminResult({"cancelled": self.cancel(item.target_request_id, "cancelled")}))
            elif isinstance(item, CloseRequest):
                if not self._hold_if_moving(item.session_id, item):
                    self.close(item)
            elif isinstance(item, SessionAdminRequest):
                self._session_admin(item)
            elif isinstance(item, AdapterRequest):
                item.stream.put(AdminResult(admin.adapter_admin(item, self.adapters, self.sessions)))
            else:
                raise TypeError(f"cannot admit {type(item).__name__}")
        except Exception as exc:
            if not isinstance(exc, ResidentError):
                logger.exception("admitting request %s (session %s) failed", getattr(item, "request_id", ""),
                                 redact(getattr(item, "session_id", None)))
            item.stream.put(Failed(exc))
        return False

    def admit_next(self, item: EngineRequest | None, session_id: str) -> None:
        """Admit the requests queued on a session until one of them is in flight again."""
        while item is not None and not self.admit(item):
            item = self.scheduler.next_pending(session_id)

    def _generation(self, request: GenerationRequest) -> bool:
        biased = max((token_id for token_id, _ in request.sampling.logit_bias), default=-1)
        if biased >= self.vocab_size:  # before any work: sampling would fail after the prefill
            raise BadRequest(f"logit_bias names token id {biased}, which is not in the vocabulary "
                             f"(ids are below {self.vocab_size})")
        if request.adapter is not None:
            admin.registry_or_404(self.adapters, request.adapter).get(request.adapter)
        if request.request_id and self.scheduler.find(request.request_id) is not None:
            raise BadRequest(f"request id {request.request_id!r} is already in flight")
        if request.open_session or request.session_id is None:
            session = self.sessions.open(request.session_id or new_session_id(), now=self.clock(),
                                         ttl_s=self.session_ttl_s, ephemeral=not request.open_session,
                                         adapter=request.adapter, cache_salt=request.cache_salt,
                                         tenant=request.tenant)
        else:
            session = self.sessions.get(request.session_id)
            wanted = request.adapter if request.adapter is not None or request.base_model else session.adapter
            if wanted != session.adapter:
                raise AdapterMismatch(f"session {session.session_id} was opened with {_served(session.adapter)}; "
                                      f"its cache cannot serve {_served(wanted)}: open a new session for it")
            if self._hold_if_moving(session.session_id, request):
                return True
            if self.scheduler.is_busy(session.session_id):
                self.scheduler.enqueue(session.session_id, request)
                return True
        self.scheduler.add(Sequence(request=request, session=session))
        return True

    def _session_admin(self, request: SessionAdminRequest) -> None:
        session_id = request.session_id or ""
        if request.action == "export" and self.scheduler.is_busy(session_id):
            self.scheduler.enqueue(session_id, request)  # after the request in flight
            return
        if request.action == "export" and self._hold_if_moving(session_id, request):
            return  # after the move under way (another front's drain)
        request.stream.put(AdminResult(admin.session_admin(request, self.sessions, self.clock())))
        if request.action in ("forget", "resume"):
            self._admit_held(session_id)

    # ------------------------------------------------------------------ moving sessions

    def _hold_if_moving(self, session_id: str | None, item) -> bool:
        if session_id is None or not self.sessions.is_moving(session_id):
            return False
        self.held.setdefault(session_id, []).append(item)
        return True

    def _admit_held(self, session_id: str) -> None:
        """The session's move ended: what waited for it is admitted, in arrival order."""
        for item in self.held.pop(session_id, []):
            self.admit(item)

    def end_overdue_moves(self) -> None:
        """Moves that neither a confirm nor an abort ended in time (the front that began them died) end
        here: those sessions serve again, their held requests first. Who calls this: the engine loop,
        with the reaper."""
        for session_id in self.sessions.end_overdue_moves(self.clock()):
            self._admit_held(session_id)

    def take_all_held(self) -> list:
        """Remove and return every held request (the engine is stopping)."""
        items = [item for held in self.held.values() for item in held]
        self.held.clear()
        return items

    def _take_held(self, request_id: str) -> GenerationRequest | None:
        if not request_id:  # a barrier (``Engine.fresh_stats``), not a cancel of anything held
            return None
        for session_id, held in self.held.items():
            for item in held:
                if isinstance(item, GenerationRequest) and item.request_id == request_id:
                    held.remove(item)
                    if not held:
                        del self.held[session_id]
                    return item
        return None

    def cancel(self, request_id: str, reason: str) -> bool:
        """Between steps: end the named request (in flight or queued) with Cancelled."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.end(seq, Cancelled(reason))
            return True
        queued = self.scheduler.take_pending(request_id)
        if queued is not None and isinstance(queued, GenerationRequest):
            self.num_cancelled_queued += 1
            queued.stream.put(Cancelled(reason))
            return True
        if queued is not None:  # a close or export: it goes on
            self.scheduler.enqueue(queued.session_id, queued)
            return False
        held = self._take_held(request_id)
        if held is not None:
            self.num_cancelled_queued += 1
            held.stream.put(Cancelled(reason))
            return True
        return False

    def close(self, request: CloseRequest) -> None:
        """Close a session; a request in flight on it is cancelled (rolled back) first, and the ones
        queued behind it find the session gone."""
        session = self.sessions.get(request.session_id)
        queued = self.scheduler.take_queued(session.session_id)
        active = self.scheduler.in_flight(session.session_id)
        if active is not None:
            self.end(active, Cancelled(f"session {session.session_id} was closed while this request ran"))
        if self.sessions.is_live(session):  # (a cancelled opening turn forgot it already)
            self.sessions.forget(session, "closed")
        request.stream.put(Closed(request.session_id))
        for later in queued:
            later.stream.put(Failed(SessionNotFound(f"session {request.session_id} was closed")))


def _served(adapter: str | None) -> str:
    return "the base model" if adapter is None else f"adapter {adapter!r}"
