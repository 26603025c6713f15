"""Engine-side session administration (draining a backend): list, export (waits for the request in
flight, then the session is gone here), import (answers as before), and bad input."""

from __future__ import annotations

import pytest

from session.engine import SessionAdminRequest
from session.engine.events import AdminResult, EventStream, Failed
from session.errors import BadRequest, InvalidSessionId, SessionExists, SessionNotFound
from tests.integration.test_engine import finished, run, turn
from tests.integration.test_memory import engine_with, image_request


def admin(engine, action, **fields):
    stream = EventStream()
    engine.submit(SessionAdminRequest(action=action, stream=stream, **fields))
    event = stream.get(timeout=60)
    if isinstance(event, Failed):
        raise event.error
    assert isinstance(event, AdminResult)
    return event.body


def test_export_then_import_answers_as_if_never_moved(tiny_model_path, tmp_path):
    source = engine_with(tiny_model_path, journal_dir=str(tmp_path / "a"))
    target = engine_with(tiny_model_path, journal_dir=str(tmp_path / "b"))
    reference = engine_with(tiny_model_path)
    try:
        for engine in (source, reference):
            finished(run(engine, image_request(engine, "m", 4, "What is it?")))
            finished(turn(engine, "m", "And the colours?"))
        assert [s["session_id"] for s in admin(source, "list")["sessions"]] == ["m"]
        exported = admin(source, "export", session_id="m")["session"]
        assert exported["num_turns"] == 2 and len(exported["images"]) == 1
        gone = turn(source, "m", "Still here?")[-1]
        assert isinstance(gone, Failed) and isinstance(gone.error, SessionNotFound)
        assert "was moved to another backend" in gone.error.message
        assert admin(target, "import", exported=exported) == {"imported": "m"}
        moved = finished(turn(target, "m", "One more?"))
        assert moved.token_ids == finished(turn(reference, "m", "One more?")).token_ids
        assert moved.usage.cached_tokens == 0  # recomputed from the transcript and the image
        with pytest.raises(SessionExists):
            admin(target, "import", exported=exported)
    finally:
        for engine in (source, target, reference):
            engine.stop()


@pytest.mark.parametrize("exported,error", [
    ({"session_id": "x"}, BadRequest),  # fields missing
    ({"session_id": "bad id!", "token_ids": [1], "image_digests": [], "ended_with_eos": False, "num_turns": 1,
      "created_at": 0.0, "expires_at": 9e9}, InvalidSessionId),
    ({"session_id": "ok", "token_ids": ["1"], "image_digests": [], "ended_with_eos": False, "num_turns": 1,
      "created_at": 0.0, "expires_at": 9e9}, BadRequest),  # token ids not integers
    ({"session_id": "ok", "token_ids": [1], "image_digests": ["../etc"], "ended_with_eos": False, "num_turns": 1,
      "created_at": 0.0, "expires_at": 9e9, "images": {"../etc": "aGk="}}, BadRequest),  # a path, not a digest
    ({"session_id": "ok", "token_ids": [1], "image_digests": ["d1"], "ended_with_eos": False, "num_turns": 1,
      "created_at": 0.0, "expires_at": 9e9, "images": {}}, SessionNotFound),  # its image is not in the export
    ("not an object", BadRequest),
])
def test_a_bad_import_is_refused_and_leaves_nothing(tiny_model_path, tmp_path, exported, error):
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "j"))
    try:
        with pytest.raises(error):
            admin(engine, "import", exported=exported)
        assert admin(engine, "list") == {"sessions": []}
        with pytest.raises(SessionNotFound):
            admin(engine, "export", session_id="nobody")
        with pytest.raises(BadRequest, match="unknown sessions action"):
            admin(engine, "teleport")
    finally:
        engine.stop()
