"""Moving a session to another backend (draining one): the moves under way, and the export's form.

Who calls this: ``Sessions`` only (session/state/sessions.py), on the engine loop thread: its
``export``, ``import_``, ``forget_moved``, ``resume_move`` and ``end_overdue_moves`` (called by the
engine's admin code and admission) use what is here; its journal restore checks token ids here too.

Moves are two-phase. ``export`` hands a session over and marks it as moving (``Moves.begin``): it
stays here, and the engine holds its requests (``session/engine/admission.py``). The move then ends
one of three ways: ``forget_moved`` (the target imported it: forgotten here), ``resume_move`` (no
target took it: live here again), or ``end_overdue_moves`` after ``timeout_s`` with neither (the
front that began it died): live here again, so a session is never lost in transit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Callable, Iterator

from session.errors import BadRequest, InvalidSessionId
from session.state.journal import JournalEntry, check_entry, validate_digest
from session.state.session import SessionState
from session.types import redact

logger = logging.getLogger(__name__)

MOVE_TIMEOUT_S = 120.0  # an exported session neither confirmed nor resumed within this is live here again


class Moves:
    """The sessions exported and not yet confirmed, resumed or timed out; plain bookkeeping."""

    def __init__(self, timeout_s: float = MOVE_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._deadlines: dict[str, float] = {}  # session_id -> when its move times out (the engine's clock)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._deadlines

    def __iter__(self) -> Iterator[str]:
        return iter(self._deadlines)

    def __len__(self) -> int:
        return len(self._deadlines)

    def begin(self, session_id: str, now: float) -> None:
        self._deadlines[session_id] = now + self.timeout_s

    def end(self, session_id: str) -> bool:
        """The move is over (confirmed, aborted, or the session forgotten). Whether it was moving."""
        return self._deadlines.pop(session_id, None) is not None

    def end_overdue(self, now: float) -> list[str]:
        """End the moves past their deadline; returns their session ids."""
        overdue = [sid for sid, deadline in self._deadlines.items() if deadline <= now]
        for session_id in overdue:
            del self._deadlines[session_id]
            logger.warning("the move of session %s was neither confirmed nor aborted within %g s; it serves "
                           "here again", redact(session_id), self.timeout_s)
        return overdue


def export_session(session: SessionState, encoded_image: Callable[[str], bytes]) -> dict:
    """The session as JSON: transcript, settings, and each image's bytes (base64) by digest."""
    images = {d: base64.b64encode(encoded_image(d)).decode() for d in dict.fromkeys(session.image_digests)}
    return {"session_id": session.session_id, "token_ids": list(session.token_ids),
            "image_digests": list(session.image_digests), "ended_with_eos": session.ended_with_eos,
            "num_turns": session.num_turns, "created_at": session.created_at,
            "expires_at": session.expires_at, "adapter": session.adapter,
            "cache_salt": session.cache_salt, "tenant": session.tenant, "images": images}


def parse_export(exported: object, vocab_size: int) -> tuple[JournalEntry, dict[str, bytes]]:
    """An exported session's entry and images (digest -> bytes), checked like a journal entry
    (``check_entry``), each image against its digest. Raises BadRequest (InvalidSessionId as it is)."""
    if not isinstance(exported, dict):
        raise BadRequest("import needs the exported session object in 'session'")
    try:
        entry = check_entry({k: v for k, v in exported.items() if k != "images"})
        images = decode_images(exported.get("images", {}))
        check_token_ids(entry, vocab_size)
    except InvalidSessionId:
        raise
    except BadRequest as exc:
        raise BadRequest(f"not an exported session: {exc.message}") from None
    return entry, images


def check_token_ids(entry: JournalEntry, vocab_size: int) -> None:
    """Token ids the model can embed (an id past the vocabulary fails on the device, not here)."""
    if any(t >= vocab_size for t in entry.token_ids):
        raise BadRequest(f"token_ids must be below the model's vocabulary size {vocab_size}")


def decode_images(images: object) -> dict[str, bytes]:
    """An export's images (digest -> base64) as bytes, each checked against its sha256 digest: a shared
    embedding is keyed by digest, so a wrong pair would feed another session's image to others."""
    if not isinstance(images, dict):
        raise BadRequest("images must be an object of digest -> base64 bytes")
    decoded = {}
    for digest, encoded in images.items():
        validate_digest(digest)
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise BadRequest(f"image {digest[:12]} is not valid base64") from None
        if hashlib.sha256(raw).hexdigest() != digest:
            raise BadRequest(f"image {digest[:12]}: its bytes do not hash to its digest")
        decoded[digest] = raw
    return decoded
