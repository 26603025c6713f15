"""The one owner of KV memory that the scheduler asks: ``blocks_needed`` / ``can_admit`` / ``admit``.

A turn takes its whole KV room when it begins (its prompt and ``max_tokens``), so a step's decode
rows never ask for more. Before the scheduler begins a prefill it asks ``can_admit`` with every turn
it has already planned in that step; a turn that does not fit waits among the waiting until a request
in flight ends (its session then becomes demotable, or its stateless KV is freed), instead of failing
after it was scheduled. ``admit`` (called when the turn begins, by ``Sessions.prepare_turn``) then
makes the room — idle shared blocks evicted, idle sessions demoted by the memory manager's policy
(session/state/memory.py) — and takes it.

The currency at the seam is ``KVNeed``: the blocks a turn takes of each fixed pool (the target's and
the draft's fill at their own pace, the draft holding no image tokens), and the bytes they are under
a device budget (a pool that may grow, on CPU, has only the budget to respect; a static cache counts
its whole buffer). The estimate is an upper bound (a shared prefix may cut it), and what demotion
could free counts only blocks a session holds alone: ``can_admit`` never says yes when ``admit``
would refuse, and may say no when it would succeed (the turn then waits one request longer).

Who calls this: the engine loop thread only (the scheduler through the executor; ``Sessions``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from session.model.blocks import blocks_missing
from session.model.kv_cache import KVCache, KVPool, PagedKVCache
from session.state.memory import MemoryManager, kv_bytes
from session.state.session import SessionState, Tier


@dataclass(frozen=True)
class KVNeed:
    """What one turn asks of device KV memory beyond what its session holds."""

    num_bytes: int = 0  # under the device budget
    blocks: tuple[tuple[KVPool, int], ...] = field(default=())  # (pool, blocks) per paged cache it grows


class KVManager:
    def __init__(self, memory: MemoryManager):
        self.memory = memory  # the budget, and which session is demoted to make room (its policy)

    def blocks_needed(self, session: SessionState, total_tokens: int, draft_tokens: int) -> KVNeed:
        """What the session's turn takes to hold ``total_tokens`` in its target cache and
        ``draft_tokens`` in its draft's (if it has one)."""
        pairs = [(session.kv, total_tokens)]
        if session.draft_kv is not None:
            pairs.append((session.draft_kv, draft_tokens))
        num_bytes = sum(kv_bytes(kv, tokens) - kv.nbytes for kv, tokens in pairs)
        blocks = tuple((kv.pool, blocks_missing(tokens, kv.block_tokens, len(kv.block_ids)))
                       for kv, tokens in pairs if isinstance(kv, PagedKVCache))
        return KVNeed(num_bytes=num_bytes, blocks=blocks)

    def can_admit(self, needs: list[KVNeed]) -> bool:
        """Could every one of these turns take its room now, together, counting free blocks, idle
        shared blocks and what demoting the sessions in no request would free?"""
        fixed: Counter[KVPool] = Counter()  # pool -> blocks asked of it (fixed pools only: others grow)
        for need in needs:
            for pool, num_blocks in need.blocks:
                if pool.blocks.fixed:
                    fixed[pool] += num_blocks
        budget = self.memory.device_budget_bytes
        if budget <= 0 and not fixed:
            return True
        if needs and _never_fits(needs[-1], budget):
            return True  # waiting would not help: ``admit`` refuses it at once, saying why
        demotable = [s for s in self.memory.store.all_sessions()
                     if s.tier is Tier.DEVICE and not s.busy and s.device_bytes]
        if budget > 0:
            free = budget - self.memory.device_bytes + sum(_sole_bytes(s) for s in demotable)
            if sum(need.num_bytes for need in needs) > free:
                return False
        return all(asked <= pool.blocks.available + sum(_sole_blocks(s, pool) for s in demotable)
                   for pool, asked in fixed.items())

    def admit(self, session: SessionState, need: KVNeed, total_tokens: int, draft_tokens: int) -> None:
        """Make the room ``need`` names (evicting idle shared blocks, demoting idle sessions) and take
        it. Raises CapacityExceeded (503) when there is none: a turn larger than the budget, or one the
        scheduler began with nothing else in flight to wait for."""
        self.memory.reserve(session, need.num_bytes, list(need.blocks))
        if session.draft_kv is not None:
            session.draft_kv.ensure_capacity(draft_tokens)
        session.kv.ensure_capacity(total_tokens)


def _never_fits(need: KVNeed, budget: int) -> bool:
    """Is the turn larger than the whole budget or a whole fixed pool?"""
    return (budget > 0 and need.num_bytes > budget) or any(
        pool.blocks.fixed and num_blocks > pool.blocks.num_blocks - 1 for pool, num_blocks in need.blocks)


def _caches(session: SessionState) -> list[KVCache]:
    return [kv for kv in (session.kv, session.draft_kv) if kv is not None]


def _sole_bytes(session: SessionState) -> int:
    """Device bytes demoting ``session`` frees (or turns into idle shared blocks, which are evicted
    next): the blocks it holds alone, or a static cache's whole buffer."""
    total = 0
    for kv in _caches(session):
        if isinstance(kv, PagedKVCache):
            refs = kv.pool.blocks.refs
            total += sum(refs[b] == 1 for b in kv.block_ids) * kv.pool.block_nbytes
        else:
            total += kv.nbytes
    return total


def _sole_blocks(session: SessionState, pool: KVPool) -> int:
    """Blocks of ``pool`` demoting ``session`` frees (or leaves idle, evictable)."""
    return sum(pool.blocks.refs[b] == 1 for kv in _caches(session)
               if isinstance(kv, PagedKVCache) and kv.pool is pool for b in kv.block_ids)
