"""Session memory tiers under a device byte budget.

Tiers, best first: DEVICE (the KV cache is on the accelerator, ready), HOST (a compact copy of
the KV in host memory; restored by one copy), DROPPED (no KV; restored by recomputing the
transcript). A session's transcript and image references are never dropped while it lives, so
every tier answers exactly the same tokens, only at different speed (docs/DESIGN.md, "Invariants").

Who calls this: the KV manager (session/state/kv_manager.py), the owner of KV memory the scheduler
asks, when a turn takes its room (``reserve``); ``Sessions`` when a session needs its KV back
(``restore_from_host``). This module is the demotion policy: which session leaves the device, to
which tier, and the budget's arithmetic. Sessions in a request are never demoted under it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from session.errors import CapacityExceeded
from session.state.session import SessionState, Tier
from session.state.store import SessionStore

if TYPE_CHECKING:  # annotations only: this module needs nothing of the model at run time
    from session.model.kv_cache import KVCache, KVPool

logger = logging.getLogger(__name__)


class BlockAccounts(Protocol):
    """The paged pools' bytes (session/model/kv_cache.py, ``PoolAccounts``): what sessions hold, each
    shared block counted once, and the idle published blocks kept for sharing."""

    def held_bytes(self) -> int: ...

    def idle_bytes(self) -> int: ...

    def evict_idle_bytes(self, num_bytes: int) -> int: ...

    def fits(self, needs: Sequence[tuple[KVPool, int]]) -> bool: ...


class MemoryManager:
    def __init__(self, *, device_budget_bytes: int, host_budget_bytes: int, store: SessionStore,
                 blocks: BlockAccounts | None = None):
        self.device_budget_bytes = device_budget_bytes  # 0: unlimited
        self.host_budget_bytes = host_budget_bytes  # 0: no host tier (demotion drops)
        self.store = store
        self.blocks = blocks  # paged KV: the pools' own count (shared blocks once); None: sum the sessions
        self.num_to_host = 0
        self.num_dropped = 0
        self.num_restored_from_host = 0
        self.num_restored_shared_tokens = 0  # restored from the host tier by sharing published blocks, not copying
        self.num_recomputed = 0
        self.peak_device_bytes = 0

    @property
    def device_bytes(self) -> int:
        """KV bytes live sessions and requests hold on the device (a block several share, once)."""
        if self.blocks is not None:
            return self.blocks.held_bytes()
        return sum(s.device_bytes for s in self.store.all_sessions())

    @property
    def idle_bytes(self) -> int:
        """Bytes of idle shared-prefix blocks: inside the budget, evicted before any session is demoted."""
        return self.blocks.idle_bytes() if self.blocks is not None else 0

    @property
    def host_bytes(self) -> int:
        return sum(s.host_bytes for s in self.store.all_sessions())

    def reserve(self, session: SessionState, num_bytes: int, blocks: Sequence[tuple[KVPool, int]] = ()) -> None:
        """Make room for ``num_bytes`` more device bytes for ``session`` by demoting idle sessions,
        least recently used first, and in each fixed pool for the blocks ``blocks`` asks of it ((pool,
        blocks) pairs: a target's pool and its draft's fill at their own pace, the draft holding no
        image tokens). Raises CapacityExceeded (503) when not enough can be freed."""
        budget = self.device_budget_bytes
        if budget > 0 and num_bytes > budget:
            raise CapacityExceeded(f"this turn needs {num_bytes} bytes of KV cache; the device budget is "
                                   f"{budget}", retry_after_s=5)
        over = 0 if budget <= 0 else self.device_bytes + self.idle_bytes + num_bytes - budget  # bytes to free
        while over > 0 or not self._pools_fit(blocks):
            # cached prefixes go first: sessions are promises (idle bytes exist only with pool accounts)
            if self.blocks is not None and self.idle_bytes and over > 0:
                self.blocks.evict_idle_bytes(over)
            else:  # (a fixed pool's own idle blocks count as room: allocating evicts them)
                victim = _least_recent(s for s in self.store.all_sessions() if s is not session
                                       and s.tier is Tier.DEVICE and not s.busy and s.device_bytes)
                if victim is None:
                    raise CapacityExceeded("device memory for sessions is full and every resident session is "
                                           "in a request; retry shortly", retry_after_s=1)
                self.demote(victim)  # frees its own blocks; blocks it shared stay (or turn idle)
            over = 0 if budget <= 0 else self.device_bytes + self.idle_bytes + num_bytes - budget

    def _pools_fit(self, blocks: Sequence[tuple[KVPool, int]]) -> bool:
        return self.blocks is None or not blocks or self.blocks.fits(blocks)

    def note_usage(self) -> None:
        """Called after the device holdings changed; keeps the peak for tests and metrics."""
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def demote(self, session: SessionState) -> Tier:
        """DEVICE -> HOST when the host tier has room (making it by dropping older host copies), else DROPPED."""
        kv = session.kv
        if session.draft_kv is not None:  # the draft re-reads the transcript lazily: not worth a host copy
            session.draft_kv.release()
        host_need = kv.length * kv.token_nbytes
        if self.host_budget_bytes > 0 and self._make_host_room(host_need, session):
            session.host_kv = kv.to_host()
            session.host_length = kv.length
            kv.release()
            session.tier = Tier.HOST
            self.num_to_host += 1
        else:
            self.drop(session)
        logger.debug("session %s demoted to %s", session.session_id, session.tier.value)
        return session.tier

    def drop(self, session: SessionState) -> None:
        session.release_tensors()
        session.tier = Tier.DROPPED
        self.num_dropped += 1

    def _make_host_room(self, num_bytes: int, session: SessionState) -> bool:
        if num_bytes > self.host_budget_bytes:
            return False
        used = self.host_bytes
        while used + num_bytes > self.host_budget_bytes:
            victim = _least_recent(s for s in self.store.all_sessions() if s is not session and s.tier is Tier.HOST)
            if victim is None:
                return False
            used -= victim.host_bytes
            self.drop(victim)
        return True

    def restore_from_host(self, session: SessionState, keys: Sequence[bytes] = ()) -> None:
        """HOST -> DEVICE: copy the compact KV back into the session's (already sized) device cache;
        with its blocks' content ``keys``, the prefix other sessions published is shared, not copied."""
        host_kv = session.host_kv
        assert host_kv is not None, f"session {session.session_id} is restored from a host copy it does not hold"
        self.num_restored_shared_tokens += session.kv.load(*host_kv, keys=keys)
        session.host_kv = None
        session.host_length = 0
        session.tier = Tier.DEVICE
        self.num_restored_from_host += 1


def _least_recent(candidates: Iterable[SessionState]) -> SessionState | None:
    return min(candidates, key=lambda s: s.last_used_at, default=None)


def kv_bytes(kv: KVCache, num_tokens: int) -> int:
    """Device bytes a KV cache of ``kv``'s shape holds once sized for ``num_tokens``."""
    return kv.capacity_for(num_tokens) * kv.token_nbytes
