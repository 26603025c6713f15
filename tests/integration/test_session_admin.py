"""Engine-side session administration (draining a backend): list, and moves in two phases: export
(waits for the request in flight; the session stays, moving, its requests held), then forget (the
import elsewhere succeeded) or resume (it failed), or the move's timeout (the front died); import
(answers as before), and bad input."""

from __future__ import annotations

import base64
import queue

import pytest

from session.config import EngineConfig
from session.engine import Engine, GenerationRequest, SessionAdminRequest
from session.engine.events import AdminResult, Cancelled, Closed, EventStream, Failed, Finished
from session.engine.requests import CloseRequest
from session.errors import BadRequest, InvalidSessionId, ServiceStopping, SessionExists, SessionNotFound
from session.state.sessions import MOVE_TIMEOUT_S
from session.types import SamplingParams
from tests.conftest import make_image, png_bytes
from tests.integration.test_engine import FakeClock, finished, run, turn, user
from tests.integration.test_memory import BLOCK, engine_with, image_request

MISSING_DIGEST = "0" * 64


def admin(engine, action, **fields):
    stream = EventStream()
    engine.submit(SessionAdminRequest(action=action, stream=stream, **fields))
    event = stream.get(timeout=60)
    if isinstance(event, Failed):
        raise event.error
    assert isinstance(event, AdminResult)
    return event.body


def submit_turn(engine, session_id, text, request_id="") -> GenerationRequest:
    request = GenerationRequest(messages=user(text), sampling=SamplingParams(max_tokens=12), stream=EventStream(),
                                session_id=session_id, request_id=request_id)
    engine.submit(request)
    return request


def last_event(stream: EventStream, timeout_s: float = 60.0):
    while not isinstance(event := stream.get(timeout=timeout_s), (Finished, Failed, Cancelled, Closed)):
        pass
    return event


def assert_waiting(stream: EventStream) -> None:
    with pytest.raises(queue.Empty):
        stream.get(timeout=0.3)


def opened(engine, reference=None):
    """Session "m" (an image, two turns) on ``engine`` and the same on ``reference``."""
    for e in filter(None, (engine, reference)):
        finished(run(e, image_request(e, "m", 4, "What is it?")))
        finished(turn(e, "m", "And the colours?"))


def test_export_then_import_answers_as_if_never_moved(tiny_model_path, tmp_path):
    source = engine_with(tiny_model_path, journal_dir=str(tmp_path / "a"))
    target = engine_with(tiny_model_path, journal_dir=str(tmp_path / "b"))
    reference = engine_with(tiny_model_path)
    try:
        opened(source, reference)
        assert [s["session_id"] for s in admin(source, "list")["sessions"]] == ["m"]
        exported = admin(source, "export", session_id="m")["session"]
        assert exported["num_turns"] == 2 and len(exported["images"]) == 1
        assert admin(source, "list")["sessions"][0]["moving"] is True
        assert (tmp_path / "a" / "sessions" / "m.json").exists()  # still crash-recoverable on the source
        held = submit_turn(source, "m", "Still here?")
        assert_waiting(held.stream)  # held by the move
        assert admin(target, "import", exported=exported) == {"imported": "m"}
        assert admin(source, "forget", session_id="m") == {"forgotten": "m"}
        gone = last_event(held.stream)
        assert isinstance(gone, Failed) and isinstance(gone.error, SessionNotFound)
        assert "was moved to another backend" in gone.error.message
        assert not (tmp_path / "a" / "sessions" / "m.json").exists()
        moved = finished(turn(target, "m", "One more?"))
        assert moved.token_ids == finished(turn(reference, "m", "One more?")).token_ids
        assert moved.usage.cached_tokens == 0  # recomputed from the transcript and the image
        with pytest.raises(SessionExists):
            admin(target, "import", exported=exported)
        with pytest.raises(SessionNotFound):
            admin(source, "forget", session_id="m")
    finally:
        for engine in (source, target, reference):
            engine.stop()


def test_export_works_without_a_journal(tiny_model_path):
    """The image bytes come from memory: a backend without RESIDENT_JOURNAL_DIR can be drained, and
    one without it can take the session (and recompute it from those bytes)."""
    source, target, reference = (engine_with(tiny_model_path) for _ in range(3))
    try:
        opened(source, reference)
        exported = admin(source, "export", session_id="m")["session"]
        assert [base64.b64decode(raw) for raw in exported["images"].values()] == [png_bytes(make_image(4))]
        admin(target, "import", exported=exported)
        admin(source, "forget", session_id="m")
        moved = finished(turn(target, "m", "One more?"))
        assert moved.token_ids == finished(turn(reference, "m", "One more?")).token_ids
        assert moved.usage.cached_tokens == 0
        again = admin(target, "export", session_id="m")["session"]  # its bytes kept on the target too
        assert again["images"] == exported["images"]
    finally:
        for engine in (source, target, reference):
            engine.stop()


def test_an_export_never_confirmed_serves_again_after_the_move_timeout(tiny_model_path, tmp_path):
    """A front that dies between export and import loses no session: the source holds it, then serves it."""
    clock = FakeClock()
    source = Engine(EngineConfig(model_path=str(tiny_model_path), kv_block_tokens=BLOCK, reaper_interval_s=0.05,
                                 journal_dir=str(tmp_path / "a")), clock=clock).start()
    reference = engine_with(tiny_model_path)
    try:
        opened(source, reference)
        admin(source, "export", session_id="m")  # ... and the front is never heard of again
        held = submit_turn(source, "m", "Still here?")
        assert_waiting(held.stream)
        clock.now += MOVE_TIMEOUT_S - 1
        assert_waiting(held.stream)
        clock.now += 2
        answer = last_event(held.stream)
        assert isinstance(answer, Finished)
        assert answer.token_ids == finished(turn(reference, "m", "Still here?")).token_ids
        assert admin(source, "list")["sessions"][0]["moving"] is False
        with pytest.raises(SessionExists, match="not moving"):  # a confirm that comes too late
            admin(source, "forget", session_id="m")
        assert finished(turn(source, "m", "And now?")).token_ids == finished(turn(reference, "m", "And now?")).token_ids
    finally:
        source.stop()
        reference.stop()


def test_resume_serves_the_session_on_the_source_with_what_waited(tiny_model_path):
    """No target took it: the front resumes it, and the requests the move held run in arrival order."""
    source, reference = engine_with(tiny_model_path), engine_with(tiny_model_path)
    try:
        opened(source, reference)
        admin(source, "export", session_id="m")
        first, second = submit_turn(source, "m", "Still here?"), submit_turn(source, "m", "And then?")
        export_stream = EventStream()
        source.submit(SessionAdminRequest(action="export", stream=export_stream, session_id="m"))  # another front's
        assert_waiting(first.stream)
        assert admin(source, "resume", session_id="m") == {"resumed": "m", "was_moving": True}
        for request, text in ((first, "Still here?"), (second, "And then?")):
            answer = last_event(request.stream)
            assert isinstance(answer, Finished)
            assert answer.token_ids == finished(turn(reference, "m", text)).token_ids
        assert isinstance(export_stream.get(timeout=60), AdminResult)  # the held export ran last: moving again
        assert admin(source, "resume", session_id="m") == {"resumed": "m", "was_moving": True}
        assert admin(source, "resume", session_id="m") == {"resumed": "m", "was_moving": False}
    finally:
        source.stop()
        reference.stop()


def test_requests_held_by_a_move_can_be_cancelled_closed_and_are_answered_at_stop(tiny_model_path):
    engine = engine_with(tiny_model_path)
    try:
        opened(engine)
        admin(engine, "export", session_id="m")
        cancelled = submit_turn(engine, "m", "Never mind", request_id="r-1")
        assert engine.cancel("r-1").get(timeout=60).body == {"cancelled": True}
        assert isinstance(last_event(cancelled.stream), Cancelled)
        close = CloseRequest(session_id="m", stream=EventStream())
        engine.submit(close)
        assert_waiting(close.stream)
        admin(engine, "resume", session_id="m")
        assert isinstance(last_event(close.stream), Closed)
        finished(run(engine, image_request(engine, "m", 4, "What is it?")))
        admin(engine, "export", session_id="m")
        stranded = submit_turn(engine, "m", "Anyone?")
        assert_waiting(stranded.stream)
    finally:
        engine.stop()
    event = last_event(stranded.stream)
    assert isinstance(event, Failed) and isinstance(event.error, ServiceStopping)


def entry(**fields) -> dict:
    return {"session_id": "ok", "token_ids": [1], "image_digests": [], "ended_with_eos": False, "num_turns": 1,
            "created_at": 0.0, "expires_at": 9e9, **fields}


@pytest.mark.parametrize("exported,error", [
    ({"session_id": "x"}, BadRequest),  # fields missing
    (entry(session_id="bad id!"), InvalidSessionId),
    (entry(session_id="../../etc/x"), InvalidSessionId),
    (entry(token_ids=["1"]), BadRequest),  # token ids not integers
    (entry(token_ids=[10**9]), BadRequest),  # past the vocabulary
    (entry(expires_at=float("nan")), BadRequest),
    (entry(image_digests=["../etc"], images={"../etc": "aGk="}), BadRequest),  # a path, not a digest
    (entry(image_digests=[MISSING_DIGEST], images={MISSING_DIGEST: "aGk="}), BadRequest),  # bytes not of the digest
    (entry(image_digests=[MISSING_DIGEST], images={}), SessionNotFound),  # its image is not in the export
    ("not an object", BadRequest),
])
def test_a_bad_import_is_refused_and_leaves_nothing(tiny_model_path, tmp_path, exported, error):
    engine = engine_with(tiny_model_path, journal_dir=str(tmp_path / "j"))
    try:
        with pytest.raises(error):
            admin(engine, "import", exported=exported)
        assert admin(engine, "list") == {"sessions": []}
        assert list((tmp_path / "j" / "images").iterdir()) == [] and list((tmp_path / "j" / "sessions").iterdir()) == []
        for action in ("export", "forget", "resume"):
            with pytest.raises(SessionNotFound):
                admin(engine, action, session_id="nobody")
        with pytest.raises(BadRequest, match="needs the session's id"):
            admin(engine, "export")
        with pytest.raises(BadRequest, match="unknown sessions action"):
            admin(engine, "teleport")
    finally:
        engine.stop()
