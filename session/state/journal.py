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
transcripts and images are the users' data.

No path is trusted twice: the directory is opened once, at start-up, and every access after that is
relative to the open directories (``dir_fd``, ``O_NOFOLLOW``), so a directory renamed or swapped for a
symbolic link later redirects nothing. Opening it checks every component from ``/`` down, each
opened relative to the one before without following links (what is checked is what is opened):
every ancestor must belong to root or this uid and be writable by no one else unless sticky (as
``/tmp`` and ``/dev/shm``), or its owner could swap what lies below; the directory and its
``sessions/`` and ``images/`` folders must be real directories of this uid. Anything else is a
``ConfigError`` naming the path and what to set. (The launcher's default path, when another user
made it first, is not used: it picks a fresh private one, launch/torchserve.py.)

Images are verified on read: the bytes must hash to the sha256 that names them. An image that does
not is removed and not restored; the sessions naming it are not crash-recoverable, with a log line.

Bounds: the journal holds at most ``max_bytes``, one session at most ``session_max_bytes`` (its entry
and the images no other journaled session names), and one tenant's sessions together at most
``tenant_max_bytes``, so one client's few large images, or one tenant's many sessions, cannot take
the room every other session's crash recovery needs. A write past either raises
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
import weakref
from collections import Counter
from collections.abc import Container, Mapping
from dataclasses import asdict, dataclass
from hashlib import sha256
from pathlib import Path

from session.errors import BadRequest, ConfigError
from session.types import MAX_TENANT_LEN, redact, validate_session_id

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DIGEST_RE = re.compile(r"[0-9a-f]{64}")  # hashlib.sha256(raw).hexdigest(), as session/families/image_decode.py makes it
MAX_ADAPTER_NAME_LEN = 256
MAX_CACHE_SALT_LEN = 64  # a sha256 hex digest (the chat service hashes the tenant and cache_salt)
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})  # a power loss empties them: an fsync there buys nothing
CORRUPT_SUFFIX = ".corrupt"  # an entry moved aside
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_WALK = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW  # an ancestor: a handle, not read


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


class JournalFull(OSError):
    def __init__(self, need: int, max_bytes: int):
        super().__init__(errno.ENOSPC, f"the journal would exceed its cap of {max_bytes} bytes (+{need})")


class JournalImageCorrupt(OSError):
    """An image's bytes in the journal do not hash to the digest that names them (tampered or damaged)."""

    def __init__(self, digest: str):
        super().__init__(errno.EIO, f"image {digest[:12]} in the journal does not match its sha256; removed")


class JournalTenantFull(JournalFull):
    """One tenant's sessions would take more of the journal than its share (RESIDENT_JOURNAL_TENANT_MAX_BYTES)."""

    def __init__(self, need: int, max_bytes: int):
        OSError.__init__(self, errno.EDQUOT, f"this tenant's sessions would take {need} bytes of the journal; its "
                                             f"share is {max_bytes} (RESIDENT_JOURNAL_TENANT_MAX_BYTES)")


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
    _require(isinstance(entry.cache_salt, str) and len(entry.cache_salt) <= MAX_CACHE_SALT_LEN,
             f"cache_salt must be a string of at most {MAX_CACHE_SALT_LEN} characters")
    _require(isinstance(entry.tenant, str) and len(entry.tenant) <= MAX_TENANT_LEN,
             f"tenant must be a string of at most {MAX_TENANT_LEN} characters")
    return entry


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class Journal:
    """Who calls this: ``Sessions`` on the engine loop thread (and the admin code, for adapters.json).

    ``directory``, ``sessions_dir`` and ``images_dir`` are for messages and tests: every access goes
    through the directories opened at construction (``close`` releases them)."""

    def __init__(self, directory: str | Path, max_bytes: int = 0, session_max_bytes: int = 0,
                 tenant_max_bytes: int = 0):
        self.directory = Path(directory)
        self.sessions_dir = self.directory / "sessions"
        self.images_dir = self.directory / "images"
        self.max_bytes = max_bytes  # 0: no cap
        self.session_max_bytes = session_max_bytes  # 0: no quota per session
        self.tenant_max_bytes = tenant_max_bytes  # 0: no share per tenant
        self._charged: dict[str, tuple[str, int]] = {}  # session_id -> (tenant, the bytes counted against it)
        self._tenant_bytes: Counter[str] = Counter()
        self._dir_fd = open_journal_directory(self.directory)
        fds = [self._dir_fd]
        self._close = weakref.finalize(self, _close_all, fds)
        try:
            self._sessions_fd = _open_own(self._dir_fd, "sessions", self.sessions_dir)
            fds.append(self._sessions_fd)
            self._images_fd = _open_own(self._dir_fd, "images", self.images_dir)
            fds.append(self._images_fd)
        except ConfigError:
            self.close()
            raise
        self.fsync = _device_type(os.fstat(self._dir_fd).st_dev) not in MEMORY_FILESYSTEMS
        self.num_corrupt = 0
        self.num_images_rejected = 0  # images whose bytes did not match their digest
        for folder in fds:
            for name in os.listdir(folder):
                if name.startswith(".") and name.endswith(".tmp"):  # a write a crash interrupted: never renamed
                    os.unlink(name, dir_fd=folder)
        self.nbytes = sum(_size(folder, name) for folder in (self._sessions_fd, self._images_fd)
                          for name in os.listdir(folder) if not name.endswith(CORRUPT_SUFFIX))
        self._digests_of: dict[str, frozenset[str]] = {}  # session_id -> the digests its journaled entry names
        self._num_refs: Counter[str] = Counter()  # digest -> journaled entries naming it

    def close(self) -> None:
        """Release the open directories. Idempotent; also done when the journal is collected."""
        self._close()

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
        own = self._check_quota(entry, len(data), {})
        self._write(self._sessions_fd, _entry_name(entry.session_id), data)
        self._note_refs(entry.session_id, entry.image_digests)
        self._charge(entry.session_id, entry.tenant, own)

    def remove(self, session_id: str) -> None:
        self._remove(self._sessions_fd, _entry_name(session_id))
        self._note_refs(session_id, ())
        self._charge(session_id, "", 0)

    def entries(self) -> list[JournalEntry]:
        """Every readable, valid entry whose images are here and intact; corrupt, partial or unsafe ones
        are moved aside with a log line. Who calls this: ``Sessions.restore_journal``, once at start-up."""
        out = []
        self._digests_of.clear()
        self._num_refs.clear()
        intact: set[str] = set()  # digests verified in this pass (an image many entries name is read once)
        for name in sorted(os.listdir(self._sessions_fd)):
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                entry = self._read_entry(name, intact)
            except Exception as exc:  # any defect in one entry must not stop the worker
                self.num_corrupt += 1
                logger.warning("skipping corrupt journal entry %s: %s", redact(name[:-5]) + ".json", exc)
                self.nbytes -= _size(self._sessions_fd, name)
                os.replace(name, name[:-5] + CORRUPT_SUFFIX, src_dir_fd=self._sessions_fd,
                           dst_dir_fd=self._sessions_fd)
                continue
            self._note_refs(entry.session_id, entry.image_digests)
            out.append(entry)
        self._charged.clear()
        self._tenant_bytes.clear()
        for entry in out:
            self._charge(entry.session_id, entry.tenant, self._own_bytes(entry, len(_encode(entry)), {}))
        return out

    def _read_entry(self, name: str, intact: set[str]) -> JournalEntry:
        data = json.loads(_read(self._sessions_fd, name))
        version = data.pop("version", None) if isinstance(data, dict) else None
        if not _is_int(version) or version != FORMAT_VERSION:
            raise ValueError("unknown journal format version")
        entry = check_entry(data)
        if name != f"{entry.session_id}.json":
            raise ValueError(f"its file name is not its session id {entry.session_id!r}")
        for digest in dict.fromkeys(entry.image_digests):
            if digest in intact:
                continue
            if not self.has_image(digest):
                raise ValueError(f"missing image {digest[:12]}")
            self.read_image(digest)  # raises JournalImageCorrupt for bytes that are not the image named
            intact.add(digest)
        return entry

    # ------------------------------------------------------------------ images (by sha256 digest)

    def has_image(self, digest: str) -> bool:
        return _exists(self._images_fd, validate_digest(digest))

    def write_image(self, digest: str, raw: bytes) -> None:
        if not self.has_image(digest):
            self._write(self._images_fd, digest, raw)

    def read_image(self, digest: str) -> bytes:
        """The image's bytes, verified against its digest. Raises JournalImageCorrupt (an OSError) after
        removing bytes that do not match, FileNotFoundError for an image not here."""
        raw = _read(self._images_fd, validate_digest(digest))
        if sha256(raw).hexdigest() != digest:
            self.num_images_rejected += 1
            self.remove_image(digest)
            logger.warning("image %s in the journal does not match its sha256: removed; the sessions naming it "
                           "cannot be restored", digest[:12])
            raise JournalImageCorrupt(digest)
        return raw

    def remove_image(self, digest: str) -> None:
        self._remove(self._images_fd, validate_digest(digest))

    def remove_images_except(self, keep: Container[str]) -> None:
        """Remove every image file whose name is not in ``keep`` (stray files too: the folder is ours).
        Who calls this: ``Sessions.restore_journal``, with the digests the restored sessions use."""
        for name in os.listdir(self._images_fd):
            if name not in keep:
                self._remove(self._images_fd, name)

    # ------------------------------------------------------------------ adapters

    def write_adapters(self, adapters: dict[str, dict]) -> None:
        """Adapters registered at run time (name -> {"src", "pinned"}), so a restart keeps them."""
        _atomic_write(self._dir_fd, "adapters.json", json.dumps(adapters).encode(), self.fsync)

    def adapters(self) -> dict[str, dict]:
        try:
            return json.loads(_read(self._dir_fd, "adapters.json"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("skipping corrupt %s: %s", self.directory / "adapters.json", exc)
            return {}

    # ------------------------------------------------------------------ files and bytes

    def _check_quota(self, entry: JournalEntry, entry_bytes: int, new_images: dict[str, int]) -> int:
        """Raise JournalSessionFull when the session's entry and the images only it names (``new_images``:
        digest -> bytes of those not written yet) pass its quota, JournalTenantFull when they would take
        its tenant past its share. Returns those bytes."""
        total = self._own_bytes(entry, entry_bytes, new_images)
        if self.session_max_bytes and total > self.session_max_bytes:
            raise JournalSessionFull(entry.session_id, total, self.session_max_bytes)
        if self.tenant_max_bytes:
            before = self._charged.get(entry.session_id, ("", 0))
            after = self._tenant_bytes[entry.tenant] - (before[1] if before[0] == entry.tenant else 0) + total
            if after > self.tenant_max_bytes:
                raise JournalTenantFull(after, self.tenant_max_bytes)
        return total

    def _own_bytes(self, entry: JournalEntry, entry_bytes: int, new_images: dict[str, int]) -> int:
        """The session's entry and the images no other journaled entry names (dropping it would free them)."""
        own = self._digests_of.get(entry.session_id, frozenset())
        total = entry_bytes
        for digest in set(entry.image_digests):
            if self._num_refs[digest] - (digest in own) > 0:
                continue
            total += new_images[digest] if digest in new_images else _size(self._images_fd, validate_digest(digest))
        return total

    def _charge(self, session_id: str, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` of the journal against ``tenant`` for this session (0: the session left)."""
        old_tenant, old = self._charged.pop(session_id, ("", 0))
        self._tenant_bytes[old_tenant] -= old
        if self._tenant_bytes[old_tenant] <= 0:
            del self._tenant_bytes[old_tenant]
        if nbytes:
            self._charged[session_id] = (tenant, nbytes)
            self._tenant_bytes[tenant] += nbytes

    def _note_refs(self, session_id: str, digests) -> None:
        old = self._digests_of.pop(session_id, frozenset())
        self._num_refs.subtract(old)
        for digest in old:
            if self._num_refs[digest] <= 0:
                del self._num_refs[digest]
        if digests:
            self._digests_of[session_id] = frozenset(digests)
            self._num_refs.update(self._digests_of[session_id])

    def _write(self, folder: int, name: str, data: bytes) -> None:
        old = _size(folder, name)
        if self.max_bytes and self.nbytes - old + len(data) > self.max_bytes:
            raise JournalFull(len(data) - old, self.max_bytes)
        _atomic_write(folder, name, data, self.fsync)
        self.nbytes += len(data) - old

    def _remove(self, folder: int, name: str) -> None:
        size = _size(folder, name)
        try:
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            return
        self.nbytes -= size
        if self.fsync:  # else a power loss could bring a closed session back
            os.fsync(folder)


def _encode(entry: JournalEntry) -> bytes:
    return json.dumps({"version": FORMAT_VERSION, **asdict(entry)}).encode()


def _entry_name(session_id: str) -> str:
    return f"{validate_session_id(session_id)}.json"


def _size(folder: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0


def _exists(folder: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read(folder: int, name: str) -> bytes:
    """A regular file's bytes (a link, a FIFO or a device is refused: ValueError)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return file.read()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def open_journal_directory(path: Path) -> int:
    """An open descriptor of ``path``, made (0700) where missing, once every component from ``/`` down
    is checked: each ancestor belongs to root or this uid and no one else may write to it unless it is
    sticky; the directory itself is a real directory of this uid (``_open_own``). Each component is
    opened relative to the one before without following a link: what is checked is what is opened.
    Links in the ancestors, as given, are resolved once, here. Raises ConfigError naming the path."""
    path = Path(os.path.abspath(path))
    parent = Path(os.path.realpath(path.parent))
    fd = os.open("/", _WALK)
    try:
        _check_ancestor(os.fstat(fd), Path("/"), path)
        for index, name in enumerate(parent.parts[1:], start=2):
            here = Path(*parent.parts[:index])
            try:
                child = _open_or_make(fd, name, _WALK)
            except OSError as exc:
                raise ConfigError(f"the journal directory {path} is under {here}, which cannot be opened as a "
                                  f"directory ({exc.strerror}); set RESIDENT_JOURNAL_DIR elsewhere") from None
            os.close(fd)
            fd = child
            _check_ancestor(os.fstat(fd), here, path)
        return _open_own(fd, path.name, path)
    finally:
        os.close(fd)


def _open_or_make(parent: int, name: str, flags: int) -> int:
    """Open the directory ``name`` under ``parent``, made (0700) first where missing (mkdir is not tried on
    what exists: on a read-only mount it would fail even then)."""
    try:
        return os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:  # made meanwhile, or a link to nowhere: the open says which
            pass
        return os.open(name, flags, dir_fd=parent)


def _check_ancestor(info: os.stat_result, here: Path, path: Path) -> None:
    """An ancestor another user could rename entries in (their own directory, or one writable by others
    and not sticky) could have the journal swapped under it: refused."""
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
    if info.st_uid not in (0, os.getuid()) or writable_by_others:
        who = f"belongs to uid {info.st_uid}" if info.st_uid not in (0, os.getuid()) else \
            f"is writable by other users (mode {stat.filemode(info.st_mode)}) and not sticky"
        raise ConfigError(f"the journal directory {path} is under {here}, which {who}: another user could swap the "
                          "journal for their own; set RESIDENT_JOURNAL_DIR to a directory whose every parent only "
                          "root or the server's user can write (e.g. under /dev/shm)")


def _open_own(parent: int, name: str, shown: Path) -> int:
    """``name`` under the open directory ``parent``, made (0700) where missing, opened without following a
    link and accepted only as a real directory of this uid, then made private: a symbolic link, or a
    directory another local user made first, would hand them our users' data."""
    try:
        fd = _open_or_make(parent, name, _DIRECTORY)
    except OSError as exc:  # a file, a link (to nowhere too), or a directory not ours: told apart here
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            info = None
        if info is not None and stat.S_ISLNK(info.st_mode):
            raise ConfigError(f"the journal directory {shown} is a symbolic link; refusing it: remove it or set "
                              "RESIDENT_JOURNAL_DIR to a directory of the server's own") from None
        if info is not None and not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"the journal directory {shown} exists and is not a directory; remove it or set "
                              "RESIDENT_JOURNAL_DIR elsewhere") from None
        if info is not None:
            _check_owner(info, shown)
        raise ConfigError(f"the journal directory {shown} cannot be opened ({exc.strerror}); set "
                          "RESIDENT_JOURNAL_DIR elsewhere") from None
    try:
        _check_owner(os.fstat(fd), shown)
    except ConfigError:
        os.close(fd)
        raise
    os.fchmod(fd, 0o700)  # also when it existed (an older, world-readable journal)
    return fd


def _check_owner(info: os.stat_result, shown: Path) -> None:
    if info.st_uid != os.getuid():
        raise ConfigError(f"the journal directory {shown} belongs to uid {info.st_uid}, not to this server's uid "
                          f"{os.getuid()} (another user may have created it first); remove it or set "
                          "RESIDENT_JOURNAL_DIR elsewhere")


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` ("tmpfs", "ext4", ...), or None when it cannot be told."""
    try:
        return _device_type(os.stat(path).st_dev)
    except OSError:
        return None


def _device_type(device: int) -> str | None:
    try:
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


def _atomic_write(folder: int, name: str, data: bytes, fsync: bool) -> None:
    tmp = f".{name}.{os.getpid()}.tmp"
    # 0600: never readable by other users; O_NOFOLLOW: never written through a link.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            if fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=folder)
        except FileNotFoundError:
            pass
        raise
    if fsync:  # the rename itself is durable only once the directory is
        os.fsync(folder)
