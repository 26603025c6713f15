"""Draining a backend: every session it holds moves to the others, under the same session id.

The front's ``POST /backends/{i}/drain`` calls ``Migrator.drain``. It takes the backend out of
the choice for new sessions (``Router.drain``), then, until the backend lists no session (or
``MAX_ROUNDS`` lists in a row still find some, when other fronts keep opening sessions there),
moves each session: export on the source (the backend waits until the session has no request in
flight, then hands over its transcript, image bytes and settings and forgets it), import on the
least busy other backend, pin the id there in this front's router. The KV cache is not copied:
the target recomputes it on the session's next request, which answers exactly as it would have
on the source (the engine's equivalence invariant); that first request pays one prefill.

A session is never dropped on the floor: if no other backend takes it, it is imported back on the
source. While a session is between export and import, this front holds its requests
(``Migrator.wait_moved``) instead of answering 404; another front finds it by asking the backends
again (``session/front/server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from session.errors import BackendError, BackendUnavailable, SessionNotFound
from session.front.backend_client import AdminError, BackendAdmin
from session.front.router import Backend, Router

logger = logging.getLogger(__name__)

MAX_PARALLEL_MOVES = 4  # sessions in transit at once: exports wait for in-flight requests, so overlap them
MAX_ROUNDS = 5  # rounds of moves before the drain reports what is left on the source


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
        """Move every session off ``source``; it gets no new sessions until ``Router.resume``."""
        self.router.drain(source)
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
        """Move one session off ``source``; None when it was closed or expired meanwhile. Raises
        AdminError / BackendError when the export fails (the session is then still on the source)."""
        self._in_transit[session_id] = asyncio.Event()
        try:
            t0 = self.clock()
            try:
                exported = await self.admin.export_session(source, session_id)
            except SessionNotFound:
                return None
            t1 = self.clock()
            target = await self._import_somewhere(source, exported)
            self.router.pin(session_id, target, exported.get("expires_at"))
            return MovedSession(session_id=session_id, target=target.index,
                                num_tokens=len(exported.get("token_ids", ())),
                                num_images=len(exported.get("images", {})), export_s=t1 - t0,
                                import_s=self.clock() - t1)
        finally:
            self._in_transit.pop(session_id).set()

    async def _import_somewhere(self, source: Backend, exported: dict) -> Backend:
        """Import on the least busy other backend; if every one refuses, back on the source."""
        tried = [source]
        while True:
            try:
                target = self.router.pick(exclude=tried)
            except BackendUnavailable:
                break
            self.router.acquire(target)  # counts as load, so that parallel moves spread over the others
            try:
                await self.admin.import_session(target, exported)
                return target
            except (AdminError, BackendError) as exc:
                logger.warning("backend %d refused session %s: %s", target.index, exported["session_id"], exc.message)
                tried.append(target)
            finally:
                self.router.release(target)
        try:
            await self.admin.import_session(source, exported)
        except (AdminError, BackendError) as exc:
            logger.error("session %s is lost: no backend took it back (%s)", exported["session_id"], exc.message)
            raise AdminError(exc.status, {"type": exc.type, "message": f"lost: no backend took it ({exc.message})"}) from exc
        logger.warning("no other backend took session %s; it stays on backend %d", exported["session_id"],
                       source.index)
        return source
