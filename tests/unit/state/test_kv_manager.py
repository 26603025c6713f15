"""The KV manager: what a turn needs, whether turns fit together (free blocks, idle shared blocks,
what demoting idle sessions frees), and admitting one by making that room."""

from __future__ import annotations

import pytest
import torch

from session.errors import CapacityExceeded
from session.model.kv_cache import KVPool, PoolAccounts
from session.model.prefix_cache import block_keys
from session.state.kv_manager import KVManager
from session.state.memory import MemoryManager
from session.state.session import SessionState, Tier
from session.state.store import SessionStore

BLOCK = 4


def setup(num_blocks: int, *, fixed: bool = True, budget_blocks: int = 0):
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device=torch.device("cpu"),
                  block_tokens=BLOCK, num_blocks=num_blocks)
    pool.blocks.fixed = fixed
    store = SessionStore(ttl_s=100, max_sessions=8, clock=lambda: 0.0)
    memory = MemoryManager(device_budget_bytes=budget_blocks * pool.block_nbytes, host_budget_bytes=0, store=store,
                           blocks=PoolAccounts([pool]))
    return pool, store, KVManager(memory)


def session(store: SessionStore, pool: KVPool, name: str, tokens: int = 0, busy: bool = False) -> SessionState:
    state = store.open(SessionState(session_id=name, kv=pool.new_cache(64), created_at=0, expires_at=100,
                                    tier=Tier.DEVICE))
    state.kv.ensure_capacity(tokens)
    state.kv.length = tokens
    state.busy = busy
    return state


def test_blocks_needed_counts_what_the_session_does_not_hold():
    pool, store, kv = setup(9)
    held = session(store, pool, "a", tokens=5)  # 2 blocks
    need = kv.blocks_needed(held, total_tokens=13, draft_tokens=0)
    assert need.blocks == ((pool, 2),) and need.num_bytes == 2 * pool.block_nbytes
    assert kv.blocks_needed(held, total_tokens=8, draft_tokens=0).blocks == ((pool, 0),)


def test_turns_that_fit_alone_may_not_fit_together_and_busy_sessions_free_nothing():
    pool, store, kv = setup(7)  # 6 usable blocks
    session(store, pool, "busy", tokens=8, busy=True)  # 2 blocks, in a request
    a, b = session(store, pool, "x"), session(store, pool, "y")
    a.busy = b.busy = True
    need_a = kv.blocks_needed(a, 12, 0)
    need_b = kv.blocks_needed(b, 8, 0)
    assert kv.can_admit([need_a]) and kv.can_admit([need_b])  # 3 and 2 of 4 free
    assert not kv.can_admit([need_a, need_b])  # 5 > 4, and the busy session's blocks are not on offer


def test_an_idle_session_counts_as_room_and_admit_demotes_it():
    pool, store, kv = setup(5)  # 4 usable blocks
    idle = session(store, pool, "idle", tokens=16)  # all 4
    newcomer = session(store, pool, "new", busy=True)
    need = kv.blocks_needed(newcomer, 12, 0)
    assert pool.blocks.available == 0 and kv.can_admit([need])
    kv.admit(newcomer, need, 12, 0)
    assert idle.tier is Tier.DROPPED and len(newcomer.kv.block_ids) == 3 and pool.blocks.check(
        [newcomer.kv.block_ids]) == []


def test_blocks_shared_with_another_cache_are_not_counted_as_freed_by_a_demotion():
    pool, store, kv = setup(5)
    idle = session(store, pool, "idle", tokens=8)  # 2 blocks, both also held by a busy session
    idle.kv.publish(block_keys(list(range(8)), BLOCK))
    sharer = session(store, pool, "sharer", busy=True)
    sharer.kv.share_prefix(block_keys(list(range(8)), BLOCK))
    newcomer = session(store, pool, "new", busy=True)
    assert kv.can_admit([kv.blocks_needed(newcomer, 8, 0)])  # 2 free blocks
    assert not kv.can_admit([kv.blocks_needed(newcomer, 12, 0)])  # demoting "idle" frees no block


def test_a_byte_budget_counts_for_a_pool_that_grows():
    pool, store, kv = setup(1, fixed=False, budget_blocks=4)
    session(store, pool, "idle", tokens=8)  # 2 of 4 budget blocks
    busy = session(store, pool, "busy", tokens=4, busy=True)  # 1
    newcomer = session(store, pool, "new", busy=True)
    assert kv.can_admit([kv.blocks_needed(newcomer, 12, 0)])  # 1 left + 2 from demoting "idle"
    assert not kv.can_admit([kv.blocks_needed(newcomer, 16, 0)])
    assert busy.tier is Tier.DEVICE


def test_a_turn_larger_than_the_pool_is_admitted_to_be_refused_at_once():
    pool, store, kv = setup(3)
    newcomer = session(store, pool, "new", busy=True)
    need = kv.blocks_needed(newcomer, 40, 0)  # 10 blocks of a 2-block pool: waiting would never help
    assert kv.can_admit([need])
    with pytest.raises(CapacityExceeded):
        kv.admit(newcomer, need, 40, 0)
