"""Moves: the sessions exported and not yet confirmed, as the invariant check reads them (a Collection)."""

from __future__ import annotations

from collections.abc import Collection

from session.state.invariants import session_problems
from session.state.migration import Moves
from session.state.store import SessionStore


def test_moves_is_a_collection_of_the_moving_ids():
    moves = Moves(timeout_s=10)
    moves.begin("a", now=0.0)
    moves.begin("b", now=1.0)
    assert isinstance(moves, Collection)
    assert len(moves) == 2 and "a" in moves and 3 not in moves and sorted(moves) == ["a", "b"]
    assert moves.end("a") and not moves.end("a")
    assert len(moves) == 1 and list(moves) == ["b"]
    # what Sessions.check passes: a moving id the store does not hold is a violation
    store = SessionStore(ttl_s=60, max_sessions=4, clock=lambda: 0.0)
    assert session_problems(store, moves, {}) == ["session b: moving but not live"]
