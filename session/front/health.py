"""Health of the backends: a probe of each every ``health_interval_s``, and on demand.

A backend is alive when ``GET /ping`` answers 200, and ready when, given a management URL, its
model's workers are all READY. ``Router.record_probe`` decides when a backend goes in or out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from session.front.config import FrontConfig
from session.front.router import Backend, Router
from session.types import redact

logger = logging.getLogger(__name__)


class Health:
    """Who calls this: the front's health loop (``run``), the forwarder when a connection to a
    backend breaks (``alive``), and a restart waiting for its backend (``probe``)."""

    def __init__(self, config: FrontConfig, router: Router, http: aiohttp.ClientSession):
        self.config = config
        self.router = router
        self.http = http  # a fresh connection per probe (force_close): a kept-alive one says nothing

    async def run(self) -> None:
        while True:
            await self.check()
            for session_id in self.router.expire():
                logger.info("session %s expired; its pin is forgotten", redact(session_id))
            await asyncio.sleep(self.config.health_interval_s)

    async def check(self) -> None:
        """Probe every backend once."""
        await asyncio.gather(*(self.probe(backend) for backend in self.router.backends))

    async def probe(self, backend: Backend) -> None:
        ok = await self.alive(backend) and await self._workers_ready(backend)
        if self.router.record_probe(backend, ok):
            logger.log(logging.INFO if backend.healthy else logging.WARNING, "backend %d (%s) is now %s",
                       backend.index, backend.url, "healthy" if backend.healthy else "unhealthy")

    async def alive(self, backend: Backend) -> bool:
        return await self._get_json(backend.url + "/ping") is not None

    async def _workers_ready(self, backend: Backend) -> bool:
        if backend.management_url is None:
            return True
        described = await self._get_json(f"{backend.management_url}/models/{self.config.model_name}")
        if not isinstance(described, list) or not described:
            return False
        statuses = [w.get("status") for w in described[0].get("workers", [])]
        return bool(statuses) and all(s == "READY" for s in statuses)

    async def _get_json(self, url: str) -> Any:
        """The JSON of a 200 answer, or None on any failure."""
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(
                    total=self.config.health_timeout_s)) as response:
                if response.status != 200:
                    return None
                return await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
