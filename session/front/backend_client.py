"""Requests from the front to one backend that are not a client's: admin calls and cancels.

Admin calls carry ``X-Resident-Admin-Token`` (the secret the front shares with its backends,
``RESIDENT_ADMIN_TOKEN`` there) and a JSON body, and go to the backend's ``/predictions/<model>``:

  {"adapters": "list" | "register" | "unregister", ...}   the front's /adapters API
  {"sessions": "list"}                                    -> {"sessions": [{"session_id", "busy", "num_turns",
                                                              "expires_at", "moving"}]}
  {"sessions": "export", "session_id": id}                -> {"session": {...}}: waits until the session has no
                                                              request in flight, then marks it as moving there
                                                              (404 if unknown): it stays, its requests wait
  {"sessions": "forget", "session_id": id}                -> {"forgotten": id}: the move is confirmed, the
                                                              session is dropped there (later requests: 404);
                                                              409 if it is not moving (its move timed out)
  {"sessions": "resume", "session_id": id}                -> {"resumed": id, "was_moving": bool}: the move is
                                                              aborted, the session serves there again
  {"sessions": "import", "session": {...}}                -> {"imported": id} (409 if live there already)

A moving session that gets neither ``forget`` nor ``resume`` (its front died mid-move) serves on its
backend again after that backend's move timeout (``session/state/sessions.py``).

A cancel is ``X-Resident-Cancel: <request id>`` with body ``{}``: the backend stops the request
that carried ``X-Resident-Request-Id: <request id>`` at its next step and rolls its session's turn
back; it answers ``{"cancelled": true|false}``.

The front (``session/front/server.py``) and the migrator (``session/front/migration.py``) call these on the
front's event loop. Never imports ``ts``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp

from session.errors import BackendError, ResidentError, SessionNotFound
from session.front.router import Backend
from session.serving.protocol import ADMIN_TOKEN_HEADER, CANCEL_HEADER

logger = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"


@dataclass(frozen=True)
class SessionInfo:
    """One entry of a backend's ``{"sessions": "list"}`` answer."""

    session_id: str
    busy: bool  # a request of this session is in flight
    num_turns: int
    expires_at: float  # epoch seconds


class AdminError(ResidentError):
    """A backend refused an admin request; carries the backend's own status and error body."""

    def __init__(self, status: int, error: dict):
        super().__init__(error.get("message", "admin request failed"))
        self.status = status
        self.type = error.get("type", BackendError.type)


class BackendAdmin:
    """Admin requests and cancels to backends, over the front's kept-alive client session."""

    def __init__(self, http: aiohttp.ClientSession, *, model_name: str, token: str, timeout_s: float,
                 cancel_timeout_s: float):
        self.http = http
        self.model_name = model_name
        self.token = token
        self.timeout_s = timeout_s  # an admin call (an export waits for the session's request in flight)
        self.cancel_timeout_s = cancel_timeout_s  # a cancel is best effort: short

    @property
    def enabled(self) -> bool:
        """Admin calls need the shared token; without it the front cannot list or move sessions."""
        return bool(self.token)

    async def call(self, backend: Backend, payload: dict) -> tuple[int, dict]:
        """One admin request: (status, JSON body; ``{"error": {...}}`` unless 200). Raises BackendError
        when the backend cannot be reached or does not answer in time."""
        headers = {"Content-Type": JSON_CONTENT_TYPE, ADMIN_TOKEN_HEADER: self.token}
        try:
            async with self.http.post(self._url(backend), data=json.dumps(payload).encode(), headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                raw = await response.read()
                return response.status, _json_body(response.status, raw)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BackendError(f"backend {backend.index} did not answer an admin request: {exc!r}") from None

    async def list_sessions(self, backend: Backend) -> list[SessionInfo]:
        status, body = await self.call(backend, {"sessions": "list"})
        if status != 200:
            raise AdminError(status, body["error"])
        return [SessionInfo(session_id=s["session_id"], busy=bool(s.get("busy")), num_turns=int(s.get("num_turns", 0)),
                            expires_at=float(s.get("expires_at", 0.0))) for s in body["sessions"]]

    async def export_session(self, backend: Backend, session_id: str) -> dict:
        """The session's transcript, images and settings; ``backend`` keeps it, moving, until
        ``forget_session`` or ``resume_session``. Raises SessionNotFound (closed or expired meanwhile)
        or AdminError."""
        return (await self._session_action(backend, "export", session_id))["session"]

    async def forget_session(self, backend: Backend, session_id: str) -> None:
        """Confirm a move: ``backend`` drops the session it exported. Raises SessionNotFound, or AdminError
        (409: it is not moving there any more: its move timed out and it serves there again)."""
        await self._session_action(backend, "forget", session_id)

    async def resume_session(self, backend: Backend, session_id: str) -> None:
        """Abort a move: ``backend`` serves the session it exported again. Raises SessionNotFound or AdminError."""
        await self._session_action(backend, "resume", session_id)

    async def _session_action(self, backend: Backend, action: str, session_id: str) -> dict:
        status, body = await self.call(backend, {"sessions": action, "session_id": session_id})
        if status == 404:
            raise SessionNotFound(body["error"].get("message", f"session {session_id} is not on the backend"))
        if status != 200:
            raise AdminError(status, body["error"])
        return body

    async def import_session(self, backend: Backend, exported: dict) -> None:
        status, body = await self.call(backend, {"sessions": "import", "session": exported})
        if status != 200:
            raise AdminError(status, body["error"])

    async def cancel(self, backend: Backend, request_id: str) -> bool | None:
        """Ask ``backend`` to stop request ``request_id``: whether it did, None when the cancel failed."""
        headers = {"Content-Type": JSON_CONTENT_TYPE, CANCEL_HEADER: request_id, ADMIN_TOKEN_HEADER: self.token}
        try:
            async with self.http.post(self._url(backend), data=b"{}", headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=self.cancel_timeout_s)) as response:
                body = _json_body(response.status, await response.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("cancel of request %s on backend %d failed: %r", request_id, backend.index, exc)
            return None
        if response.status != 200:
            logger.warning("backend %d refused to cancel request %s: %d %s", backend.index, request_id,
                           response.status, body)
            return None
        return bool(body.get("cancelled"))

    def _url(self, backend: Backend) -> str:
        return f"{backend.url}/predictions/{self.model_name}"


def _json_body(status: int, raw: bytes) -> dict:
    """A JSON object body; a non-JSON or non-object answer becomes ``{"error": {...}}``."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        body = None
    if isinstance(body, dict) and (status == 200 or isinstance(body.get("error"), dict)):
        return body
    return {"error": {"type": BackendError.type, "message": raw[:1000].decode("utf-8", "replace")}}
