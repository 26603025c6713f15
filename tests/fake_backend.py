"""A session-aware stand-in for a TorchServe backend running our handler, for front and proxy tests.

It speaks the backend side of the protocol the front relies on: session ids ``<uuid4>-<tag>``,
follow-ups answered with the turn number, 404 ``session_not_found`` for unknown or moved sessions,
admin requests (``{"sessions": "list" | "export" | "forget" | "resume" | "import"}``,
``{"adapters": "list"}``) with the shared token, and cancels (``X-Resident-Cancel``). An exported
session stays, moving: its requests wait until ``forget`` (then 404 "was moved") or ``resume``. A request whose last message is "hold" waits
until it is cancelled or ``release`` is set (streamed: after its first chunk); "stream" bodies
answer SSE, one chunk per word.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    CANCEL_HEADER,
    CLOSED_SESSION_HEADER,
    NEW_SESSION_HEADER,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
)

TOKEN = "secret-admin-token"
EXPIRES_AT = 4_000_000_000.0


@dataclass
class FakeSession:
    num_turns: int
    expires_at: float = EXPIRES_AT
    images: dict = field(default_factory=dict)


class FakeServer:
    """An aiohttp stand-in for a TorchServe backend: GET /ping, and POST /invocations and
    /predictions/{model} answered by ``handle``. ``start`` binds 127.0.0.1 (a free port by default)
    in the running event loop."""

    runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def start(self, port: int = 0):
        app = web.Application()
        app.router.add_get("/ping", lambda r: web.json_response({"status": "Healthy"}))
        app.router.add_post("/invocations", self.handle)
        app.router.add_post("/predictions/{model}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return self

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.runner.addresses[0][1]

    async def stop(self) -> None:
        await self.runner.cleanup()


class SessionBackend(FakeServer):
    """One session-aware fake backend."""

    def __init__(self, index: int, tag: str | None = None, token: str = TOKEN):
        self.index = index
        self.tag = f"b{index}" if tag is None else tag
        self.token = token
        self.sessions: dict[str, FakeSession] = {}
        self.moved: set[str] = set()  # ids whose move was confirmed: 404 "was moved" here from now on
        self.moving: dict[str, asyncio.Event] = {}  # exported, not yet forgotten or resumed: set when it ends
        self.admin_bodies: list[dict] = []  # every admin request's body, in order
        self.admin_calls: list[str] = []  # the sessions actions received, in order ("export", "import", ...)
        self.requests: list[dict] = []  # chat requests: {"path", "session", "request_id", "body", "headers"}
        self.cancels: list[str] = []  # request ids asked to cancel
        self.cancelled: list[str] = []  # held requests that a cancel stopped
        self.refuse_imports = False
        self.release = asyncio.Event()
        self._held: dict[str, asyncio.Event] = {}  # request id -> set by its cancel

    def new_id(self) -> str:
        return f"{uuid.uuid4()}-{self.tag}" if self.tag else str(uuid.uuid4())

    # ------------------------------------------------------------ requests

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read() or b"{}")
        if CANCEL_HEADER in request.headers:  # like the engine's: only with the admin token
            if request.headers.get(ADMIN_TOKEN_HEADER) != self.token:
                return _error(403, "forbidden", "a cancel needs the admin token")
            return self._cancel(request.headers[CANCEL_HEADER])
        if ADMIN_TOKEN_HEADER in request.headers:
            if request.headers[ADMIN_TOKEN_HEADER] != self.token:
                return _error(403, "forbidden", "bad admin token")
            self.admin_bodies.append(body)
            return self._admin(body)
        return await self._chat(request, body)

    def _cancel(self, request_id: str) -> web.Response:
        self.cancels.append(request_id)
        held = self._held.get(request_id)
        if held is not None:
            held.set()
        return web.json_response({"cancelled": held is not None})

    async def _chat(self, request: web.Request, body: dict) -> web.StreamResponse:
        session = request.headers.get(SESSION_HEADER)
        request_id = request.headers.get(REQUEST_ID_HEADER, "")
        self.requests.append({"path": request.path, "session": session, "request_id": request_id, "body": body,
                              "headers": dict(request.headers)})
        headers = {"X-Resident-Worker": f"fake:{self.index}"}
        if session in self.moving:
            await self.moving[session].wait()
        if body.get("requestType") == "CLOSE":
            if self.sessions.pop(session, None) is None:
                return _error(404, "session_not_found", f"session {session} not found")
            return web.json_response({"session_id": session, "closed": True},
                                     headers={**headers, CLOSED_SESSION_HEADER: session})
        if session == "NEW_SESSION":
            session = self.new_id()
            self.sessions[session] = FakeSession(num_turns=0)
            headers[NEW_SESSION_HEADER] = f"{session}; Expires=2096-10-02T07:06:40Z"
        elif session is not None:
            if session not in self.sessions:
                moved = " was moved to another backend" if session in self.moved else " not found"
                return _error(404, "session_not_found", f"session {session}{moved}")
            headers[SESSION_HEADER] = session
        hold = body["messages"][-1]["content"] == "hold"
        if hold and not body.get("stream") and await self._hold(request_id):
            return _error(400, "cancelled", "cancelled")
        text = f"backend {self.index}"
        if session is not None:
            self.sessions[session].num_turns += 1
            text += f" turn {self.sessions[session].num_turns}"
        if body.get("stream"):
            return await self._stream(request, text, headers, hold_id=request_id if hold else None)
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "llava",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                                  **({"session_id": session} if session else {})}, headers=headers)

    async def _hold(self, request_id: str) -> bool:
        """Wait for a cancel (True) or ``release`` (False)."""
        cancelled = self._held[request_id] = asyncio.Event()
        release = asyncio.ensure_future(self.release.wait())
        stop = asyncio.ensure_future(cancelled.wait())
        await asyncio.wait([release, stop], return_when=asyncio.FIRST_COMPLETED)
        release.cancel()
        stop.cancel()
        if cancelled.is_set():
            self.cancelled.append(request_id)
        return cancelled.is_set()

    async def _stream(self, request: web.Request, text: str, headers: dict,
                      hold_id: str | None = None) -> web.StreamResponse:
        """One chunk per word; with ``hold_id`` it holds after the first (and stops there if cancelled)."""
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(text.split(" ")):
            if i == 1 and hold_id is not None and await self._hold(hold_id):
                return response
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "llava",
                     "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ------------------------------------------------------------ admin

    def _admin(self, body: dict) -> web.Response:
        if body.get("adapters") == "list":
            return web.json_response({"adapters": [{"name": "support", "src": "/x", "tier": "disk",
                                                    "pinned": False, "running": 0}]})
        action = body.get("sessions")
        self.admin_calls.append(action)
        if action == "list":
            return web.json_response({"sessions": [
                {"session_id": sid, "busy": False, "num_turns": s.num_turns, "expires_at": s.expires_at}
                for sid, s in self.sessions.items()]})
        if action == "export":
            sid = body["session_id"]
            session = self.sessions.get(sid)
            if session is None:
                return _error(404, "session_not_found", f"session {sid} not found")
            if sid in self.moving:
                return _error(409, "session_exists", f"session {sid} is moving already")
            self.moving[sid] = asyncio.Event()
            return web.json_response({"session": {
                "session_id": sid, "token_ids": list(range(10 * session.num_turns)), "image_digests": [],
                "ended_with_eos": True, "num_turns": session.num_turns, "created_at": 0.0,
                "expires_at": session.expires_at, "adapter": None, "images": {"d1": "aGk="}}})
        if action in ("forget", "resume"):
            sid = body["session_id"]
            if sid not in self.sessions:
                return _error(404, "session_not_found", f"session {sid} not found")
            moving = self.moving.pop(sid, None)
            if action == "resume":
                if moving is not None:
                    moving.set()
                return web.json_response({"resumed": sid, "was_moving": moving is not None})
            if moving is None:
                return _error(409, "session_exists", f"session {sid} is live here, not moving")
            del self.sessions[sid]
            self.moved.add(sid)
            moving.set()
            return web.json_response({"forgotten": sid})
        if action == "import":
            exported = body["session"]
            if self.refuse_imports:
                return _error(503, "capacity_exceeded", "full")
            if exported["session_id"] in self.sessions:
                return _error(409, "session_exists", "already live here")
            self.sessions[exported["session_id"]] = FakeSession(num_turns=exported["num_turns"],
                                                                expires_at=exported["expires_at"])
            self.moved.discard(exported["session_id"])
            return web.json_response({"imported": exported["session_id"]})
        return _error(400, "invalid_request_error", f"unknown admin request {body}")


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


class LoopThread:
    """An event loop in a daemon thread, for servers that synchronous clients (openai, nginx tests) talk to."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-loop", daemon=True)
        self.thread.start()

    def call(self, coroutine, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
