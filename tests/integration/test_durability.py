"""Durability faults never fail an answer: a journal or image write error (ENOSPC, EIO, the journal's
own cap) serves the turn, marks the session not crash-recoverable, counts it and logs it once."""

from __future__ import annotations

import errno
import logging

import pytest

from session.engine.events import Finished
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
        # Both turns tried to journal; an image whose write failed cannot be written later (its bytes came
        # with the first turn only), so the session stays not recoverable.
        assert len(calls) == (2 if what == "write" else 1)
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
