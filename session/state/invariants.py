"""The sessions' invariant, read from their state without changing it.

Who calls this: ``Sessions.check`` (session/state/sessions.py), which the engine runs after every
step when RESIDENT_CHECK_INVARIANTS is set; each function returns the violations it finds, as text.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from session.model.kv_cache import PagedKVCache
from session.state.session import Tier
from session.state.store import SessionStore


def session_problems(store: SessionStore, moving: Collection[str], active: Mapping[str, object]) -> list[str]:
    """On the device, the KV holds the transcript but at most its last token (sampled, fed by the next
    step), or, while a turn's prefill runs in chunks, that and part of the turn; elsewhere no device
    bytes are held; a session is busy only with a request in flight (``active``: session id -> the
    scheduler's sequence, with its ``turn``), and never while moving (``moving``: session ids)."""
    problems = [f"session {sid}: moving but not live" for sid in moving if sid not in store]
    for session in store.all_sessions():
        if session.busy and session.session_id not in active:
            problems.append(f"session {session.session_id}: busy without a request in flight")
        if session.busy and session.session_id in moving:
            problems.append(f"session {session.session_id}: a request in flight while it is moving")
        gap = len(session.token_ids) - session.kv.length
        turn = getattr(active.get(session.session_id), "turn", None)
        if turn is not None and turn.feeds_to and turn.mark is None:  # its prefill under way
            if not turn.cached_tokens <= session.kv.length <= turn.feeds_to:
                problems.append(f"session {session.session_id}: KV holds {session.kv.length} tokens, its "
                                f"prefill from {turn.cached_tokens} to {turn.feeds_to}")
        elif session.tier is Tier.DEVICE and not 0 <= gap <= 1:
            problems.append(f"session {session.session_id}: KV holds {session.kv.length} tokens, "
                            f"transcript {len(session.token_ids)}")
        if session.tier is not Tier.DEVICE and session.kv.length:
            problems.append(f"session {session.session_id}: {session.tier.value} tier but KV on the device")
    return problems


def block_problems(store: SessionStore, blocks: object) -> list[str]:
    """Every paged pool's own invariant over the block tables of every live session (and draft);
    ``blocks``: the memory manager's pool accounts (their ``pools``), or None."""
    pools = {id(p): p for p in getattr(blocks, "pools", ())}
    tables: dict[int, list[list[int]]] = {key: [] for key in pools}
    for session in store.all_sessions():
        for kv in (session.kv, session.draft_kv):
            if isinstance(kv, PagedKVCache):
                pools.setdefault(id(kv.pool), kv.pool)
                tables.setdefault(id(kv.pool), []).append(kv.block_ids)
    return [f"KV pool: {problem}" for key, pool in pools.items() for problem in pool.blocks.check(tables[key])]
