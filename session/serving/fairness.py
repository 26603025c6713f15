"""Fair shares of a worker's scarce slots among tenants (the front's ``X-Resident-Tenant``).

Who calls this: the chat service, on its event loop (``FairSlots`` is an asyncio primitive).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairSlots:
    """At most ``total`` holders at once, and at most ``per_key`` of them for one key: one tenant's
    requests never hold every slot, so another's waits for at most the slots left to it. Waiters
    queue per key first, then for a slot (first come, first served among those under their share)."""

    def __init__(self, total: int, per_key: int):
        self.per_key = per_key
        self._slots = asyncio.Semaphore(total)
        self._own: dict[str, asyncio.Semaphore] = {}  # key -> its share, while any of its requests wants one
        self._wanting: Counter[str] = Counter()  # requests per key holding or waiting for a slot
        self.num_waiting = 0  # requests waiting for a slot (their own share or a free one)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        own = self._own.setdefault(key, asyncio.Semaphore(self.per_key))
        self._wanting[key] += 1
        self.num_waiting += 1
        waiting = True
        try:
            async with own:
                async with self._slots:
                    self.num_waiting -= 1
                    waiting = False
                    yield
        finally:
            if waiting:  # cancelled (its client went away) before it got a slot
                self.num_waiting -= 1
            self._wanting[key] -= 1
            if not self._wanting[key]:
                del self._wanting[key], self._own[key]
