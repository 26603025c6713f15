"""Draining a backend: every session it holds moves to the others, under the same session id.

The front's ``POST /backends/{i}/drain`` calls ``Migrator.drain``. It takes the backend out of
the choice for new sessions (``Router.drain``), then, until the backend lists no session (or
``MAX_ROUNDS`` lists in a row still find some, when other fronts keep opening sessions there),
moves each session in two phases:

1. export on the source: the backend waits until the session has no request in flight, hands over
   its transcript, image bytes and settings, and keeps it, marked as moving (its requests wait);
2. import on the least busy other backend;
3. confirm on the source (``forget``): only now does the source drop its copy; the id is pinned to
   the target in this front's router.

If no other backend takes it, the source is told to ``resume`` it instead: it serves there as
before. If this front dies between the phases, the source serves the session again once its move
timeout passes (``session/state/sessions.py``); a confirm that comes after that is refused (409),
and the copy imported on the target is taken out again, so one session never lives twice. A
session is never dropped on the floor.

The KV cache is not copied: the target recomputes it on the session's next request, which answers
exactly as it would have on the source (the engine's equivalence invariant); that first request
pays one prefill. While a session is moving, this front holds its requests (``Migrator.wait_moved``)
and the source holds those that reach it; another front finds it by asking the backends again
(``session/front/server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from session.errors import BackendError, BackendUnavailable, SessionNotFound
from session.front.backend_client import AdminError, BackendAdmin
from session.front.router import Backend, Router
from session.types import redact

logger = logging.getLogger(__name__)

MAX_PARALLEL_MOVES = 4  # sessions in transit at once: exports wait for in-flight requests, so overlap them
MAX_ROUNDS = 5  # rounds of moves before the drain reports what is left on the source
CONFIRM_ATTEMPTS = 3  # a confirm the source does not answer is sent again (else it would serve its copy again)
CONFIRM_RETRY_S = 0.5


@dataclass(frozen=True)
class MovedSession:
    session_id: str
    target: int  # the backend index it lives on now
    num_tokens: int  # transcript length: what the target's first request recomputes
    num_images: int
    export_s: float
    import_s: float

    @property
    def seconds(self) -> float:
        return self.export_s + self.import_s


@dataclass
class DrainReport:
    backend: int
    moved: list[MovedSession] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # session_id -> why it is still on the source
    num_remaining: int = 0  # sessions the source still listed after the last round
    elapsed_s: float = 0.0

    def to_body(self) -> dict:
        per_session = [m.seconds for m in self.moved]
        return {
            "backend": self.backend, "draining": True, "moved": len(self.moved), "failed": self.failed,
            "remaining": self.num_remaining, "seconds": round(self.elapsed_s, 4),
            "per_session_ms": {"mean": round(1000 * sum(per_session) / len(per_session), 2) if per_session else 0.0,
                               "max": round(1000 * max(per_session), 2) if per_session else 0.0},
            "sessions": [{"session_id": m.session_id, "to": m.target, "num_tokens": m.num_tokens,
                          "num_images": m.num_images, "export_ms": round(1000 * m.export_s, 2),
                          "import_ms": round(1000 * m.import_s, 2)} for m in self.moved],
        }


class Migrator:
    """Moves sessions between backends for one front. Runs on the front's event loop."""

    def __init__(self, router: Router, admin: BackendAdmin, clock=time.perf_counter):
        self.router = router
        self.admin = admin
        self.clock = clock
        self._in_transit: dict[str, asyncio.Event] = {}  # session_id -> set once it lives somewhere again
        self._drain_lock = asyncio.Lock()  # one drain at a time: each picks targets from the others' counts

    def is_moving(self, session_id: str) -> bool:
        return session_id in self._in_transit

    async def wait_moved(self, session_id: str, timeout_s: float) -> None:
        """Called by the front for a request whose session is between export and import."""
        event = self._in_transit.get(session_id)
        if event is not None:
            await asyncio.wait_for(event.wait(), timeout_s)

    async def drain(self, source: Backend) -> DrainReport:
        """Move every session off ``source``; it gets no new sessions until ``Router.resume``, also when
        the drain fails (its error then says so)."""
        self.router.drain(source)
        try:
            return await self._drain(source)
        except (AdminError, BackendError) as exc:
            note = (f"; backend {source.index} stays drained (it takes no new sessions): "
                    f"POST /backends/{source.index}/resume to undo")
            if isinstance(exc, AdminError):
                raise AdminError(exc.status, {"type": exc.type, "message": exc.message + note}) from None
            raise BackendError(exc.message + note) from None

    async def _drain(self, source: Backend) -> DrainReport:
        async with self._drain_lock:
            started = self.clock()
            report = DrainReport(backend=source.index)
            for round_ in range(MAX_ROUNDS + 1):
                listed = [s.session_id for s in await self.admin.list_sessions(source)]
                report.num_remaining = len(listed)
                to_move = [sid for sid in listed if sid not in report.failed]
                if not to_move or round_ == MAX_ROUNDS:
                    break
                await self._move_all(source, to_move, report)
            report.elapsed_s = self.clock() - started
            logger.info("drained backend %d: %d moved, %d failed, %d left, %.3f s", source.index, len(report.moved),
                        len(report.failed), report.num_remaining, report.elapsed_s)
            return report

    async def _move_all(self, source: Backend, session_ids: list[str], report: DrainReport) -> None:
        slots = asyncio.Semaphore(MAX_PARALLEL_MOVES)

        async def one(session_id: str) -> None:
            async with slots:
                try:
                    moved = await self.move(source, session_id)
                except (AdminError, BackendError) as exc:
                    report.failed[session_id] = exc.message
                    return
                if moved is None:
                    return
                if moved.target == source.index:
                    report.failed[session_id] = "no other backend took it; it stays on the source"
                else:
                    report.moved.append(moved)

        await asyncio.gather(*(one(sid) for sid in session_ids))

    async def move(self, source: Backend, session_id: str) -> MovedSession | None:
        """Move one session off ``source`` (export, import elsewhere, confirm); None when it was closed or
        expired meanwhile. A MovedSession whose target is the source: no other backend took it, and the
        source serves it again. Raises AdminError / BackendError when the move failed; the session then
        still lives on the source (resumed, or serving again once its move times out there)."""
        self._in_transit[session_id] = asyncio.Event()
        try:
            t0 = self.clock()
            try:
                exported = await self.admin.export_session(source, session_id)
            except SessionNotFound:
                return None
            except BackendError:
                await self._resume(source, session_id)  # the export may have happened there all the same
                raise
            t1 = self.clock()
            target = await self._import_elsewhere(source, exported)
            if target is None:
                await self._resume(source, session_id)
                target = source
            else:
                await self._confirm(source, target, session_id)
                self.router.pin(session_id, target, exported.get("expires_at"))
            return MovedSession(session_id=session_id, target=target.index,
                                num_tokens=len(exported.get("token_ids", ())),
                                num_images=len(exported.get("images", {})), export_s=t1 - t0,
                                import_s=self.clock() - t1)
        finally:
            self._in_transit.pop(session_id).set()

    async def _import_elsewhere(self, source: Backend, exported: dict) -> Backend | None:
        """Import on the least busy other backend; None if every one refuses."""
        tried = [source]
        while True:
            try:
                target = self.router.pick(exclude=tried)
            except BackendUnavailable:
                return None
            self.router.acquire(target)  # counts as load, so that parallel moves spread over the others
            try:
                await self.admin.import_session(target, exported)
                return target
            except (AdminError, BackendError) as exc:
                logger.warning("backend %d refused session %s: %s", target.index, redact(exported["session_id"]),
                               exc.message)
                tried.append(target)
            finally:
                self.router.release(target)

    async def _confirm(self, source: Backend, target: Backend, session_id: str) -> None:
        """The source drops its copy. Raises AdminError when it refuses (its move timed out and it serves the
        session again): the target's copy is then taken out, and the session stays on the source."""
        for attempt in range(CONFIRM_ATTEMPTS):
            try:
                await self.admin.forget_session(source, session_id)
                return
            except SessionNotFound:
                return  # gone there already (the source restarted without it): the target's copy is the session
            except AdminError as exc:
                await self._take_back(target, session_id)
                raise AdminError(exc.status, {"type": exc.type, "message": f"the source kept it ({exc.message})"}) \
                    from exc
            except BackendError as exc:
                if attempt == CONFIRM_ATTEMPTS - 1:
                    logger.error("backend %d did not confirm the move of session %s (%s); it lives on backend %d now, "
                                 "but the source serves its old copy again if it comes back before forgetting it",
                                 source.index, redact(session_id), exc.message, target.index)
                    return
                await asyncio.sleep(CONFIRM_RETRY_S)

    async def _resume(self, source: Backend, session_id: str) -> None:
        """Abort a move: the source serves the session again (best effort: else it does once the move times out)."""
        try:
            await self.admin.resume_session(source, session_id)
        except (AdminError, BackendError, SessionNotFound) as exc:
            logger.warning("backend %d did not resume session %s (%s); it serves it again once its move times out",
                           source.index, redact(session_id), exc.message)

    async def _take_back(self, target: Backend, session_id: str) -> None:
        """Remove the copy a move imported on ``target`` (the move failed after the import): export, forget."""
        try:
            await self.admin.export_session(target, session_id)
            await self.admin.forget_session(target, session_id)
        except (AdminError, BackendError, SessionNotFound) as exc:
            logger.error("session %s: the copy imported on backend %d could not be removed (%s)", redact(session_id),
                         target.index, exc.message)
