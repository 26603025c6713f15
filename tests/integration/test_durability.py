"""Durability faults never fail an answer: a journal or image write error (ENOSPC, EIO, the journal's
own cap, a session's quota) serves the turn, marks the session not crash-recoverable, counts it and
logs it once. And a journal read back at start-up is not trusted: an entry cannot make it touch a
file outside its directory."""

from __future__ import annotations

import errno
import json
import logging

import pytest

from session.engine import CloseRequest
from session.engine.events import EventStream, Failed, Finished
from session.errors import SessionNotFound
from tests.integration.test_engine import finished, run, turn
from tests.integration.test_memory import engine_with, image_request


def _failing(code, calls):
    def write(*args, **kwargs):
        calls.append(code)
        raise OSError(code, "injected")
    return write


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("what", ["write", "write_image"])
def test_a_journal_write_error_serves_the_turn_and_marks_the_session(tiny_model_path, tmp_path, caplog, code, what):
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "journal"))
    reference = engine_with(tiny_model_path)
    try:
        calls = []
        setattr(engine.parts.journal, what, _failing(code, calls))
        with caplog.at_level(logging.WARNING, logger="session.state.sessions"):
            first = finished(run(engine, image_request(engine, "d", 1, "What is it?")))
            second = finished(turn(engine, "d", "And then?"))
        expected = [finished(run(reference, image_request(reference, "d", 1, "What is it?"))),
                    finished(turn(reference, "d", "And then?"))]
        assert [first.token_ids, second.token_ids] == [e.token_ids for e in expected]  # served, unchanged
        # Both turns tried to journal (the second with the image's bytes kept in memory), and failed again.
        assert len(calls) == 2
        stats = engine.fresh_stats()
        assert stats.events["journal_write_errors"] == 2 and stats.not_recoverable_sessions == 1
        assert engine.parts.store.get("d").recoverable is False
        assert not (tmp_path / "journal" / "sessions" / "d.json").exists()  # no stale entry left to restore
        warnings = [r for r in caplog.records if "journal write failed for session d" in r.getMessage()]
        assert len(warnings) == 1  # logged once
    finally:
        engine.stop()
        reference.stop()


def test_a_session_recovers_once_a_later_turn_is_journaled(tiny_model_path, tmp_path):
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "journal"))
    try:
        write = engine.parts.journal.write
        engine.parts.journal.write = _failing(errno.EIO, [])
        assert isinstance(run(engine, image_request(engine, "r", 2, "What is it?"))[-1], Finished)
        assert engine.fresh_stats().not_recoverable_sessions == 1
        engine.parts.journal.write = write
        assert isinstance(turn(engine, "r", "More?")[-1], Finished)
        assert engine.fresh_stats().not_recoverable_sessions == 0
        assert (tmp_path / "journal" / "sessions" / "r.json").exists()
    finally:
        engine.stop()


def test_the_journal_cap_counts_as_a_write_error(tiny_model_path, tmp_path):
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "journal"), journal_max_bytes=300)
    try:
        assert isinstance(run(engine, image_request(engine, "c", 3, "What is it?"))[-1], Finished)
        stats = engine.fresh_stats()
        assert stats.events["journal_write_errors"] == 1 and stats.not_recoverable_sessions == 1
        assert stats.resident_bytes["journal"] <= 300
    finally:
        engine.stop()


def test_an_image_whose_write_failed_is_written_by_the_next_turn(tiny_model_path, tmp_path):
    """The image's bytes came with the first turn only; kept in memory, the next turn journals them."""
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "journal"))
    try:
        write_image = engine.parts.journal.write_image
        engine.parts.journal.write_image = _failing(errno.EIO, [])
        finished(run(engine, image_request(engine, "i", 5, "What is it?")))
        assert engine.fresh_stats().not_recoverable_sessions == 1
        engine.parts.journal.write_image = write_image
        finished(turn(engine, "i", "More?"))
        assert engine.fresh_stats().not_recoverable_sessions == 0
        assert len(list((tmp_path / "journal" / "images").iterdir())) == 1
        assert engine.parts.sessions.kept_image_bytes == 0  # the journal holds them now: not twice
    finally:
        engine.stop()


def test_a_session_over_its_quota_serves_unjournaled_and_leaves_room_for_the_others(tiny_model_path, tmp_path,
                                                                                    caplog):
    """One client's large image no longer takes the journal every other session needs."""
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "journal"), journal_max_bytes=64 << 10,
                         journal_session_max_bytes=2000)
    reference = engine_with(tiny_model_path)
    try:
        with caplog.at_level(logging.WARNING, logger="session.state.sessions"):
            for e in (engine, reference):
                finished(run(e, image_request(e, "big", 6, "What is it?")))  # a PNG of ~9 KB: past 2000 bytes
                finished(turn(e, "big", "And then?"))
            for i in range(3):
                finished(turn(engine, f"small-{i}", "Hello", open_session=True))
        assert finished(turn(engine, "big", "More?")).token_ids == finished(turn(reference, "big", "More?")).token_ids
        stats = engine.fresh_stats()
        assert stats.not_recoverable_sessions == 1 and stats.events["journal_write_errors"] == 3
        assert sorted(p.name for p in (tmp_path / "journal" / "sessions").iterdir()) == [
            "small-0.json", "small-1.json", "small-2.json"]
        assert list((tmp_path / "journal" / "images").iterdir()) == []
        warnings = [r.getMessage() for r in caplog.records if "journal write failed for session big" in r.getMessage()]
        assert len(warnings) == 1 and "RESIDENT_JOURNAL_SESSION_MAX_BYTES" in warnings[0]
    finally:
        engine.stop()
        reference.stop()


def test_a_tampered_journal_deletes_nothing_outside_it_at_restart(tiny_model_path, tmp_path):
    """Entries whose session id or image digest is a path: moved aside, never followed."""
    journal = tmp_path / "journal"
    engine_with(tiny_model_path, journal_dir=str(journal)).stop()  # makes the folders, ours
    victims = [tmp_path / "victim.json", tmp_path / "victim"]
    for victim in victims:
        victim.write_bytes(b"precious")
    fields = {"version": 1, "token_ids": [1, 2], "ended_with_eos": False, "num_turns": 1, "created_at": 0.0,
              "adapter": None}
    (journal / "sessions" / "a.json").write_text(json.dumps(  # expired: a restart removes ../../victim.json
        {**fields, "session_id": "../../victim", "image_digests": [], "expires_at": 0.0}))
    (journal / "sessions" / "b.json").write_text(json.dumps(  # live: closing it removed ../../victim
        {**fields, "session_id": "b", "image_digests": ["../../victim"], "expires_at": 9e9}))
    engine = engine_with(tiny_model_path, journal_dir=str(journal))
    try:
        close = CloseRequest(session_id="b", stream=EventStream())
        engine.submit(close)
        event = close.stream.get(timeout=60)
        assert isinstance(event, Failed) and isinstance(event.error, SessionNotFound)
        assert engine.parts.journal.num_corrupt == 2 and engine.fresh_stats().live_sessions == 0
        assert sorted(p.name for p in (journal / "sessions").iterdir()) == ["a.corrupt", "b.corrupt"]
    finally:
        engine.stop()
    assert [v.read_bytes() for v in victims] == [b"precious", b"precious"]
