"""A journaled session's record: ``JournalEntry``, its JSON encoding on disk, and the checks it passes.

Trust: what is read back is checked before any of it names a file. ``check_entry`` checks every
field's type, the session id against the wire's pattern (``validate_session_id``) and each image
digest as a sha256 hex digest (``DIGEST_RE``); ``decode_entry`` also refuses a format version it
does not know. The journal moves an entry that fails aside as corrupt (session/state/journal.py).

Who calls this: the journal on every entry it writes or reads, and ``Sessions`` (``check_entry``
on an exported session, ``is_digest`` and ``validate_digest`` on the images it names).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import TypeGuard

from session.errors import BadRequest
from session.types import MAX_TENANT_LEN, validate_session_id

FORMAT_VERSION = 1
DIGEST_RE = re.compile(r"[0-9a-f]{64}")  # hashlib.sha256(raw).hexdigest(), as session/families/image_decode.py makes it
MAX_ADAPTER_NAME_LEN = 256
MAX_CACHE_SALT_LEN = 64  # a sha256 hex digest (the chat service hashes the tenant and cache_salt)


@dataclass(frozen=True)
class JournalEntry:
    session_id: str
    token_ids: list[int]
    image_digests: list[str]  # one per image occurrence, in order
    ended_with_eos: bool
    num_turns: int
    created_at: float
    expires_at: float  # wall clock (epoch seconds)
    adapter: str | None = None
    cache_salt: str = ""  # SessionState.cache_salt
    tenant: str = ""  # SessionState.tenant


def is_digest(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and DIGEST_RE.fullmatch(value) is not None


def validate_digest(digest: object) -> str:
    if not is_digest(digest):
        raise BadRequest(f"invalid image digest {str(digest)[:80]!r}: must be a sha256 hex digest "
                         f"(64 characters 0-9a-f)")
    return digest


def check_entry(fields: object) -> JournalEntry:
    """A session entry from its JSON fields, checked: every field present, known and of its type, the
    session id valid, each image digest a sha256 hex digest. Raises InvalidSessionId for the id,
    BadRequest for anything else. Who calls this: the journal on every entry it reads or writes, and
    ``Sessions.import_`` on an exported session (the same fields)."""
    if not isinstance(fields, dict):
        raise BadRequest("a session entry must be a JSON object")
    try:
        entry = JournalEntry(**fields)
    except TypeError as exc:
        raise BadRequest(f"bad session entry fields: {exc}") from None
    if not isinstance(entry.session_id, str):
        raise BadRequest("session_id must be a string")
    validate_session_id(entry.session_id)
    _require(isinstance(entry.token_ids, list) and all(_is_int(t) and t >= 0 for t in entry.token_ids),
             "token_ids must be a list of non-negative integers")
    _require(isinstance(entry.image_digests, list) and all(is_digest(d) for d in entry.image_digests),
             "image_digests must be a list of sha256 hex digests")
    _require(isinstance(entry.ended_with_eos, bool), "ended_with_eos must be true or false")
    _require(_is_int(entry.num_turns) and entry.num_turns >= 0, "num_turns must be a non-negative integer")
    _require(all(_is_number(t) for t in (entry.created_at, entry.expires_at)),
             "created_at and expires_at must be finite numbers (epoch seconds)")
    _require(entry.adapter is None or (isinstance(entry.adapter, str) and 0 < len(entry.adapter) <= MAX_ADAPTER_NAME_LEN),
             f"adapter must be null or a name of at most {MAX_ADAPTER_NAME_LEN} characters")
    _require(isinstance(entry.cache_salt, str) and len(entry.cache_salt) <= MAX_CACHE_SALT_LEN,
             f"cache_salt must be a string of at most {MAX_CACHE_SALT_LEN} characters")
    _require(isinstance(entry.tenant, str) and len(entry.tenant) <= MAX_TENANT_LEN,
             f"tenant must be a string of at most {MAX_TENANT_LEN} characters")
    return entry


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def encode_entry(entry: JournalEntry) -> bytes:
    """The bytes of the entry's file: its fields and the format version, as JSON."""
    return json.dumps({"version": FORMAT_VERSION, **asdict(entry)}).encode()


def decode_entry(data: bytes) -> JournalEntry:
    """An entry from its file's bytes, checked (``check_entry``). Raises ValueError for JSON that is not
    an entry of this format version, BadRequest (InvalidSessionId) for a field that fails its check."""
    fields = json.loads(data)
    version = fields.pop("version", None) if isinstance(fields, dict) else None
    if not _is_int(version) or version != FORMAT_VERSION:
        raise ValueError("unknown journal format version")
    return check_entry(fields)


def entry_file_name(session_id: str) -> str:
    """The entry's file name in the journal's sessions/ folder; raises InvalidSessionId for an unsafe id."""
    return f"{validate_session_id(session_id)}.json"
