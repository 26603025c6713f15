"""The front's admin API: drain, resume and restart a backend; LoRA adapters on every backend at once.

  POST /backends/{i}/drain, /backends/{i}/resume   move every session off backend i (admin token),
                                                   put it back into rotation (session/front/migration.py)
  POST /backends/{i}/restart                       drain, restart (make cluster only), resume
  GET  /adapters, POST /adapters {"name", "src"}, DELETE /adapters/{name}   (admin token, like all of these)

Adapters: the front sends an admin request (``X-Resident-Admin-Token``, a secret shared with its
backends) to every backend. Registering validates on each and rolls back where it succeeded if
one refuses; unregistering first asks every backend whether it may (a dry run: 409 while live
sessions use the adapter), then does it everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from session.errors import BackendError, BadRequest, Forbidden
from session.front.backend_client import BackendAdmin
from session.front.config import ENV_PREFIX, FrontConfig
from session.front.health import Health
from session.front.migration import Migrator
from session.front.router import Backend, Router
from session.serving.protocol import ADMIN_TOKEN_HEADER, header, load_json_object, tokens_match


class AdminRoutes:
    """Who calls this: the front's aiohttp routes, on the event loop. ``restart`` is blocking: it
    restarts backend i and returns once it is ready (launch/cluster.py); None: not ours to restart."""

    def __init__(self, *, config: FrontConfig, router: Router, admin: BackendAdmin, migrator: Migrator,
                 health: Health, restart: Callable[[int], None] | None):
        self.config = config
        self.router = router
        self.admin = admin
        self.migrator = migrator
        self.health = health
        self.restart = restart

    # ------------------------------------------------------------ backends

    async def drain_backend(self, request: web.Request, body: bytes) -> web.Response:
        """Move every session off backend i (it then may stop with none lost); the report times each move."""
        self.check_token(request)
        report = await self.migrator.drain(self._backend_at(request))
        return web.json_response(report.to_body())

    async def resume_backend(self, request: web.Request, body: bytes) -> web.Response:
        self.check_token(request)
        backend = self._backend_at(request)
        self.router.resume(backend)
        return web.json_response({"backend": backend.index, "draining": False})

    async def restart_backend(self, request: web.Request, body: bytes) -> web.Response:
        """A step of a rolling restart: drain backend i, restart it, put it back. 409 (and no restart)
        when a session could not be moved off it."""
        self.check_token(request)
        backend = self._backend_at(request)
        if self.restart is None:
            raise BadRequest("this front does not own its backends' processes (only make cluster's does): drain, "
                             "restart the backend yourself, then POST /backends/{i}/resume")
        report = await self.migrator.drain(backend)
        if report.num_remaining:
            return web.json_response({"error": {"type": "sessions_remaining", "message": (
                f"{report.num_remaining} session(s) could not be moved off backend {backend.index}; not restarted "
                "(it stays drained: POST /backends/{i}/resume to undo)")}, "drain": report.to_body()}, status=409)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await loop.run_in_executor(None, self.restart, backend.index)
        await self.health.probe(backend)
        self.router.resume(backend)
        return web.json_response({"backend": backend.index, "drain": report.to_body(), "healthy": backend.healthy,
                                  "restart_s": round(loop.time() - started, 3)})

    def check_token(self, request: web.Request) -> None:
        """Forbidden (403) unless the request carries the cluster's admin token."""
        if not self.config.admin_token:
            raise Forbidden(f"the admin API is off: set {ENV_PREFIX}ADMIN_TOKEN and the backends' "
                            "RESIDENT_ADMIN_TOKEN to one secret (make cluster does)")
        if not tokens_match(header(request.headers, ADMIN_TOKEN_HEADER), self.config.admin_token):
            raise Forbidden(f"send the cluster's admin token in {ADMIN_TOKEN_HEADER}")

    def _backend_at(self, request: web.Request) -> Backend:
        raw = request.match_info["index"]
        if not raw.isdigit() or int(raw) >= len(self.router.backends):
            raise web.HTTPNotFound()
        return self.router.backends[int(raw)]

    # ------------------------------------------------------------ adapters

    async def list_adapters(self, request: web.Request, body: bytes) -> web.Response:
        self.check_token(request)
        status, answer = await self.on_first({"adapters": "list"})
        return web.json_response(answer, status=status)

    async def register_adapter(self, request: web.Request, body: bytes) -> web.Response:
        self.check_token(request)
        data = load_json_object(body)
        if set(data) - {"name", "src", "pinned"} or not isinstance(data.get("name"), str) \
                or not isinstance(data.get("src"), str):
            raise BadRequest('POST /adapters takes {"name": str, "src": "<PEFT adapter directory>", '
                             '"pinned": bool (optional)}')
        backends = self.router.healthy_backends
        answers = await self.on_every({"adapters": "register", **data}, backends)
        failed = [(status, answer) for status, answer in answers if status != 200]
        if failed:  # keep every backend alike: undo where it worked
            done = [b for b, (status, _) in zip(backends, answers) if status == 200]
            if done:
                await self.on_every({"adapters": "unregister", "name": data["name"]}, done)
            return web.json_response(failed[0][1], status=failed[0][0])
        return web.json_response({**answers[0][1], "backends": len(backends)})

    async def unregister_adapter(self, request: web.Request, body: bytes) -> web.Response:
        self.check_token(request)
        name = request.match_info["name"]
        backends = self.router.healthy_backends
        for dry_run in (True, False):
            answers = await self.on_every({"adapters": "unregister", "name": name, "dry_run": dry_run}, backends)
            failed = [(status, answer) for status, answer in answers if status != 200]
            if failed:
                return web.json_response(failed[0][1], status=failed[0][0])
        return web.json_response({"unregistered": name, "backends": len(backends)})

    async def on_first(self, payload: dict) -> tuple[int, dict]:
        """One admin request to the healthy backends in turn, until one answers: (status, JSON body). One
        that does not answer (down, and not yet found so by the health checks) passes it to the next."""
        failure = None
        for backend in self.router.healthy_backends:
            try:
                [answer] = await self.on_every(payload, [backend])
                return answer
            except BackendError as exc:
                failure = exc
        raise failure or BackendError("no healthy backend to manage adapters on")

    async def on_every(self, payload: dict, backends: list[Backend]) -> list[tuple[int, dict]]:
        """One admin request to each backend, in parallel: [(status, JSON body)] in backend order."""
        if not self.admin.enabled:
            raise BadRequest(f"the adapter API is off: set {ENV_PREFIX}ADMIN_TOKEN and the backends' "
                             "RESIDENT_ADMIN_TOKEN to one secret (make cluster does)")
        if not backends:
            raise BackendError("no healthy backend to manage adapters on")
        return list(await asyncio.gather(*(self.admin.call(b, payload) for b in backends)))
