"""Crash recovery: each live session's transcript and images on disk (default under /dev/shm).

A session is journaled after every turn it completes (an atomic rename, so a reader never sees
a half-written entry) and removed when it is closed or expires. When the worker process dies
and is restarted, the engine reads the journal back: every live session returns without its
KV cache and is recomputed from its transcript on its next request, answering exactly as if
nothing had happened. Images are stored once per content hash. A corrupt entry is logged,
moved aside and skipped: never a crash loop.

Trust: what is read back is checked before any of it names a file. ``check_entry`` checks every
field's type, the session id against the wire's pattern (``validate_session_id``) and each image
digest as a sha256 hex digest (``DIGEST_RE``); an entry that fails is moved aside as corrupt. Every
method that turns an id or a digest into a path checks it too and raises ``BadRequest``
(``InvalidSessionId`` for an id): nothing can make the journal touch a path outside its directory.

Privacy: the directory and every file in it are readable by the server's user only (0700 / 0600):
transcripts and images are the users' data. At open, the directory and its ``sessions/`` and
``images/`` folders must be real directories owned by this process's uid: a symbolic link, or a
directory another local user created first (``/dev/shm`` is writable by everyone), is refused with
a ``ConfigError`` naming it.

Bounds: the journal holds at most ``max_bytes``, and one session at most ``session_max_bytes``
(its entry and the images no other journaled session names), so one client's few large images
cannot take the room every other session's crash recovery needs. A write past either raises
``JournalFull`` (an OSError, ENOSPC; ``JournalSessionFull`` for the quota, EDQUOT) before anything
is written, like a full disk would, and the caller treats both the same way (docs/ENGINE.md,
"durability faults").

Durability: on a disk, a write fsyncs the new file before its rename and the directory after it
(and a removal the directory), so after a power loss an entry is the old one or the new one. On a
memory filesystem (tmpfs, ramfs: the default /dev/shm) a power loss takes everything anyway, so
nothing is fsynced. The filesystem is told by the directory's device number in
/proc/self/mountinfo (symbolic links and bind mounts resolve right); where it cannot be told
(no /proc, a device not listed there), the journal fsyncs.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
from collections import Counter
from collections.abc import Container, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from session.errors import BadRequest, ConfigError
from session.types import redact, validate_session_id

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DIGEST_RE = re.compile(r"[0-9a-f]{64}")  # hashlib.sha256(raw).hexdigest(), as session/families/image_decode.py makes it
MAX_ADAPTER_NAME_LEN = 256
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})  # a power loss empties them: an fsync there buys nothing


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


class JournalFull(OSError):
    def __init__(self, need: int, max_bytes: int):
        super().__init__(errno.ENOSPC, f"the journal would exceed its cap of {max_bytes} bytes (+{need})")


class JournalSessionFull(JournalFull):
    """One session would take more of the journal than its quota (RESIDENT_JOURNAL_SESSION_MAX_BYTES)."""

    def __init__(self, session_id: str, need: int, max_bytes: int):
        OSError.__init__(self, errno.EDQUOT, f"session {redact(session_id)} would take {need} bytes of the journal; its "
                                             f"quota is {max_bytes} (RESIDENT_JOURNAL_SESSION_MAX_BYTES)")


def is_digest(value: object) -> bool:
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
    return entry


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class Journal:
    """Who calls this: ``Sessions`` on the engine loop thread (and the admin code, for adapters.json)."""

    def __init__(self, directory: str | Path, max_bytes: int = 0, session_max_bytes: int = 0):
        self.directory = Path(directory)
        self.sessions_dir = self.directory / "sessions"
        self.images_dir = self.directory / "images"
        self.max_bytes = max_bytes  # 0: no cap
        self.session_max_bytes = session_max_bytes  # 0: no quota per session
        for path in (self.directory, self.sessions_dir, self.images_dir):
            _own_directory(path)
        self.fsync = filesystem_type(self.directory) not in MEMORY_FILESYSTEMS
        self.num_corrupt = 0
        for folder in (self.directory, self.sessions_dir, self.images_dir):
            for path in folder.glob(".*.tmp"):  # a write a crash interrupted: never renamed into place
                path.unlink(missing_ok=True)
        self.nbytes = sum(_size(p) for d in (self.sessions_dir, self.images_dir) for p in d.iterdir()
                          if p.suffix != ".corrupt")
        self._digests_of: dict[str, frozenset[str]] = {}  # session_id -> the digests its journaled entry names
        self._num_refs: Counter[str] = Counter()  # digest -> journaled entries naming it

    # ------------------------------------------------------------------ sessions

    def write_session(self, entry: JournalEntry, image_bytes: Mapping[str, bytes]) -> None:
        """Journal a session after a turn: the images its entry names that are not here yet (their
        encoded bytes from ``image_bytes``), then the entry. Both caps are checked before anything
        is written. Raises JournalFull (JournalSessionFull: its quota), FileNotFoundError for an image
        neither here nor in ``image_bytes``, BadRequest for an id or digest that is no safe file name."""
        check_entry(asdict(entry))
        missing = [d for d in dict.fromkeys(entry.image_digests) if not self.has_image(d)]
        absent = [d for d in missing if d not in image_bytes]
        if absent:
            raise FileNotFoundError(errno.ENOENT, f"image {absent[0][:12]} is neither in the journal nor given")
        self._check_quota(entry, len(_encode(entry)), {d: len(image_bytes[d]) for d in missing})
        for digest in missing:
            self.write_image(digest, image_bytes[digest])
        self.write(entry)

    def write(self, entry: JournalEntry) -> None:
        """The session's entry alone; the images it names must be here already (``write_session``)."""
        check_entry(asdict(entry))
        data = _encode(entry)
        self._check_quota(entry, len(data), {})
        self._write(self._entry_path(entry.session_id), data)
        self._note_refs(entry.session_id, entry.image_digests)

    def remove(self, session_id: str) -> None:
        self._remove(self._entry_path(session_id))
        self._note_refs(session_id, ())

    def entries(self) -> list[JournalEntry]:
        """Every readable, valid entry; corrupt, partial or unsafe ones are moved aside with a log line.
        Who calls this: ``Sessions.restore_journal``, once at start-up."""
        out = []
        self._digests_of.clear()
        self._num_refs.clear()
        for path in sorted(self.sessions_dir.glob("*.json")):
            try:
                entry = self._read_entry(path)
            except Exception as exc:  # any defect in one entry must not stop the worker
                self.num_corrupt += 1
                logger.warning("skipping corrupt journal entry %s: %s", redact(path.stem) + path.suffix, exc)
                self.nbytes -= _size(path)
                path.rename(path.with_suffix(".corrupt"))
                continue
            self._note_refs(entry.session_id, entry.image_digests)
            out.append(entry)
        return out

    def _read_entry(self, path: Path) -> JournalEntry:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise ValueError("not a regular file")
        data = json.loads(path.read_bytes())
        version = data.pop("version", None) if isinstance(data, dict) else None
        if not _is_int(version) or version != FORMAT_VERSION:
            raise ValueError("unknown journal format version")
        entry = check_entry(data)
        if path.name != f"{entry.session_id}.json":
            raise ValueError(f"its file name is not its session id {entry.session_id!r}")
        missing = [d for d in entry.image_digests if not self.has_image(d)]
        if missing:
            raise ValueError(f"missing image(s) {missing}")
        return entry

    # ------------------------------------------------------------------ images (by sha256 digest)

    def has_image(self, digest: str) -> bool:
        return self._image_path(digest).exists()

    def write_image(self, digest: str, raw: bytes) -> None:
        path = self._image_path(digest)
        if not path.exists():
            self._write(path, raw)

    def read_image(self, digest: str) -> bytes:
        return self._image_path(digest).read_bytes()

    def remove_image(self, digest: str) -> None:
        self._remove(self._image_path(digest))

    def remove_images_except(self, keep: Container[str]) -> None:
        """Remove every image file whose name is not in ``keep`` (stray files too: the folder is ours).
        Who calls this: ``Sessions.restore_journal``, with the digests the restored sessions use."""
        for path in list(self.images_dir.iterdir()):
            if path.name not in keep:
                self._remove(path)

    # ------------------------------------------------------------------ adapters

    def write_adapters(self, adapters: dict[str, dict]) -> None:
        """Adapters registered at run time (name -> {"src", "pinned"}), so a restart keeps them."""
        _atomic_write(self.directory / "adapters.json", json.dumps(adapters).encode(), self.fsync)

    def adapters(self) -> dict[str, dict]:
        path = self.directory / "adapters.json"
        try:
            return json.loads(path.read_bytes()) if path.exists() else {}
        except ValueError as exc:
            logger.warning("skipping corrupt %s: %s", path, exc)
            return {}

    # ------------------------------------------------------------------ files and bytes

    def _entry_path(self, session_id: str) -> Path:
        return self.sessions_dir / f"{validate_session_id(session_id)}.json"

    def _image_path(self, digest: str) -> Path:
        return self.images_dir / validate_digest(digest)

    def _check_quota(self, entry: JournalEntry, entry_bytes: int, new_images: dict[str, int]) -> None:
        """Raise JournalSessionFull when the session's entry and the images only it names (``new_images``:
        digest -> bytes of those not written yet) pass its quota. An image another journaled entry
        names is not counted: dropping this session would not free it."""
        if not self.session_max_bytes:
            return
        own = self._digests_of.get(entry.session_id, frozenset())
        total = entry_bytes
        for digest in set(entry.image_digests):
            if self._num_refs[digest] - (digest in own) > 0:
                continue
            total += new_images[digest] if digest in new_images else _size(self._image_path(digest))
        if total > self.session_max_bytes:
            raise JournalSessionFull(entry.session_id, total, self.session_max_bytes)

    def _note_refs(self, session_id: str, digests) -> None:
        old = self._digests_of.pop(session_id, frozenset())
        self._num_refs.subtract(old)
        for digest in old:
            if self._num_refs[digest] <= 0:
                del self._num_refs[digest]
        if digests:
            self._digests_of[session_id] = frozenset(digests)
            self._num_refs.update(self._digests_of[session_id])

    def _write(self, path: Path, data: bytes) -> None:
        old = _size(path)
        if self.max_bytes and self.nbytes - old + len(data) > self.max_bytes:
            raise JournalFull(len(data) - old, self.max_bytes)
        _atomic_write(path, data, self.fsync)
        self.nbytes += len(data) - old

    def _remove(self, path: Path) -> None:
        try:
            size = os.lstat(path).st_size
        except FileNotFoundError:
            return
        path.unlink(missing_ok=True)
        self.nbytes -= size
        if self.fsync:  # else a power loss could bring a closed session back
            _fsync_directory(path.parent)


def _encode(entry: JournalEntry) -> bytes:
    return json.dumps({"version": FORMAT_VERSION, **asdict(entry)}).encode()


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def _own_directory(path: Path) -> None:
    """Create ``path`` (0700), or accept the one there only if it is a real directory of this uid:
    a symbolic link, or a directory another local user made first, would hand them our users' data."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # a file, or a link to nowhere: told apart below
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"the journal directory {path} is a symbolic link; refusing it: remove it or set "
                          "RESIDENT_JOURNAL_DIR to a directory of the server's own")
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"the journal directory {path} exists and is not a directory; remove it or set "
                          "RESIDENT_JOURNAL_DIR elsewhere")
    if info.st_uid != os.getuid():
        raise ConfigError(f"the journal directory {path} belongs to uid {info.st_uid}, not to this server's uid "
                          f"{os.getuid()} (another user may have created it first); remove it or set "
                          "RESIDENT_JOURNAL_DIR elsewhere")
    path.chmod(0o700)  # also when it existed (an older, world-readable journal); not a link: checked above


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` ("tmpfs", "ext4", ...), or None when it cannot be told."""
    try:
        device = os.stat(path).st_dev
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    return mount_type(mountinfo, os.major(device), os.minor(device))


def mount_type(mountinfo: str, major: int, minor: int) -> str | None:
    """The filesystem type of device ``major:minor`` in the text of /proc/self/mountinfo, whose lines read
    ``id parent major:minor root mount-point options [optional fields...] - type source options``."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 7 and fields[2] == f"{major}:{minor}" and "-" in fields[6:]:
            rest = fields[fields.index("-", 6) + 1:]
            if rest:
                return rest[0]
    return None


def _atomic_write(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # 0600: never readable by other users; O_NOFOLLOW: never written through a link.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            if fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:  # the rename itself is durable only once the directory is
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
