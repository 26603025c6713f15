"""Crash recovery: each live session's transcript and images on disk (default under /dev/shm).

A session is journaled after every turn it completes (an atomic rename, so a reader never sees
a half-written entry) and removed when it is closed or expires. When the worker process dies
and is restarted, the engine reads the journal back: every live session returns without its
KV cache and is recomputed from its transcript on its next request, answering exactly as if
nothing had happened. Images are stored once per content hash. A corrupt entry is logged,
moved aside and skipped: never a crash loop.

Trust: what is read back is checked before any of it names a file (``check_entry``,
session/state/journal_entry.py). Every method that turns an id or a digest into a path checks it
too and raises ``BadRequest`` (``InvalidSessionId`` for an id): nothing can make the journal touch a
path outside its directory, which is opened once and trusted only after its every parent is
checked (session/state/journal_files.py: privacy, no path trusted twice, durability).

Images are verified on read: the bytes must hash to the sha256 that names them. An image that does
not is removed and not restored; the sessions naming it are not crash-recoverable, with a log line.

Bounds: a cap on the whole journal, a quota per session and a share per tenant; a write past one
raises ``JournalFull`` before anything is written (session/state/journal_quota.py).

The record's names ``Sessions`` uses (``JournalEntry``, ``check_entry``, ``is_digest``,
``validate_digest``) are importable from here too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import weakref
from collections.abc import Container, Mapping
from dataclasses import asdict
from hashlib import sha256
from pathlib import Path

from session.errors import ConfigError
from session.state.journal_entry import (
    JournalEntry,
    check_entry,
    decode_entry,
    encode_entry,
    entry_file_name,
    is_digest,
    validate_digest,
)
from session.state.journal_files import (
    MEMORY_FILESYSTEMS,
    atomic_write,
    close_all,
    device_type,
    file_exists,
    file_size,
    open_journal_directory,
    open_own_directory,
    read_regular_file,
)
from session.state.journal_quota import JournalFull, JournalQuota
from session.types import redact

__all__ = ["Journal", "JournalImageCorrupt", "JournalEntry", "check_entry", "is_digest", "validate_digest"]

logger = logging.getLogger(__name__)

CORRUPT_SUFFIX = ".corrupt"  # an entry moved aside


class JournalImageCorrupt(OSError):
    """An image's bytes in the journal do not hash to the digest that names them (tampered or damaged)."""

    def __init__(self, digest: str):
        super().__init__(errno.EIO, f"image {digest[:12]} in the journal does not match its sha256; removed")


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
        self.quota = JournalQuota(session_max_bytes, tenant_max_bytes)
        self._dir_fd = open_journal_directory(self.directory)
        fds = [self._dir_fd]
        self._close = weakref.finalize(self, close_all, fds)
        try:
            self._sessions_fd = open_own_directory(self._dir_fd, "sessions", self.sessions_dir)
            fds.append(self._sessions_fd)
            self._images_fd = open_own_directory(self._dir_fd, "images", self.images_dir)
            fds.append(self._images_fd)
        except ConfigError:
            self.close()
            raise
        self.fsync = device_type(os.fstat(self._dir_fd).st_dev) not in MEMORY_FILESYSTEMS
        self.num_corrupt = 0
        self.num_images_rejected = 0  # images whose bytes did not match their digest
        for folder in fds:
            for name in os.listdir(folder):
                if name.startswith(".") and name.endswith(".tmp"):  # a write a crash interrupted: never renamed
                    os.unlink(name, dir_fd=folder)
        self.nbytes = sum(file_size(folder, name) for folder in (self._sessions_fd, self._images_fd)
                          for name in os.listdir(folder) if not name.endswith(CORRUPT_SUFFIX))

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
        own = self._check_quota(entry, len(encode_entry(entry)), {d: len(image_bytes[d]) for d in missing})
        for digest in missing:
            self.write_image(digest, image_bytes[digest])
        self.write(entry, own_bytes=own)

    def write(self, entry: JournalEntry, *, own_bytes: int | None = None) -> None:
        """The session's entry alone; the images it names must be here already (``write_session``).
        ``own_bytes``: what ``write_session`` has just checked against the quotas (``_check_quota``), so
        that a write checks them once; None: checked here."""
        check_entry(asdict(entry))
        data = encode_entry(entry)
        if own_bytes is None:
            own_bytes = self._check_quota(entry, len(data), {})
        self._write(self._sessions_fd, entry_file_name(entry.session_id), data)
        self.quota.note_refs(entry.session_id, entry.image_digests)
        self.quota.charge(entry.session_id, entry.tenant, own_bytes)

    def remove(self, session_id: str) -> None:
        self._remove(self._sessions_fd, entry_file_name(session_id))
        self.quota.note_refs(session_id, ())
        self.quota.charge(session_id, "", 0)

    def entries(self) -> list[JournalEntry]:
        """Every readable, valid entry whose images are here and intact; corrupt, partial or unsafe ones
        are moved aside with a log line. Who calls this: ``Sessions.restore_journal``, once at start-up."""
        out = []
        self.quota.clear()
        intact: set[str] = set()  # digests verified in this pass (an image many entries name is read once)
        for name in sorted(os.listdir(self._sessions_fd)):
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                entry = self._read_entry(name, intact)
            except Exception as exc:  # any defect in one entry must not stop the worker
                self.num_corrupt += 1
                logger.warning("skipping corrupt journal entry %s: %s", redact(name[:-5]) + ".json", exc)
                self.nbytes -= file_size(self._sessions_fd, name)
                os.replace(name, name[:-5] + CORRUPT_SUFFIX, src_dir_fd=self._sessions_fd,
                           dst_dir_fd=self._sessions_fd)
                continue
            self.quota.note_refs(entry.session_id, entry.image_digests)
            out.append(entry)
        if self.quota.enabled:  # what each tenant holds: only the quotas read it
            for entry in out:
                self.quota.charge(entry.session_id, entry.tenant, self._own_bytes(entry, len(encode_entry(entry)), {}))
        return out

    def _read_entry(self, name: str, intact: set[str]) -> JournalEntry:
        entry = decode_entry(read_regular_file(self._sessions_fd, name))
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
        return file_exists(self._images_fd, validate_digest(digest))

    def write_image(self, digest: str, raw: bytes) -> None:
        if not self.has_image(digest):
            self._write(self._images_fd, digest, raw)

    def read_image(self, digest: str) -> bytes:
        """The image's bytes, verified against its digest. Raises JournalImageCorrupt (an OSError) after
        removing bytes that do not match, FileNotFoundError for an image not here."""
        raw = read_regular_file(self._images_fd, validate_digest(digest))
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
        atomic_write(self._dir_fd, "adapters.json", json.dumps(adapters).encode(), self.fsync)

    def adapters(self) -> dict[str, dict]:
        try:
            return json.loads(read_regular_file(self._dir_fd, "adapters.json"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("skipping corrupt %s: %s", self.directory / "adapters.json", exc)
            return {}

    # ------------------------------------------------------------------ files and bytes

    def _check_quota(self, entry: JournalEntry, entry_bytes: int, new_images: dict[str, int]) -> int:
        """Raise JournalSessionFull when the session's entry and the images only it names (``new_images``:
        digest -> bytes of those not written yet) pass its quota, JournalTenantFull when they would take
        its tenant past its share. Returns those bytes (0 with neither quota: nothing is sized)."""
        if not self.quota.enabled:
            return 0
        total = self._own_bytes(entry, entry_bytes, new_images)
        self.quota.check(entry, total)
        return total

    def _own_bytes(self, entry: JournalEntry, entry_bytes: int, new_images: dict[str, int]) -> int:
        """The session's entry and the images no other journaled entry names (dropping it would free them)."""
        total = entry_bytes
        for digest in self.quota.own_digests(entry):
            total += new_images[digest] if digest in new_images else file_size(self._images_fd, validate_digest(digest))
        return total

    def _write(self, folder: int, name: str, data: bytes) -> None:
        old = file_size(folder, name)
        if self.max_bytes and self.nbytes - old + len(data) > self.max_bytes:
            raise JournalFull(len(data) - old, self.max_bytes)
        atomic_write(folder, name, data, self.fsync)
        self.nbytes += len(data) - old

    def _remove(self, folder: int, name: str) -> None:
        size = file_size(folder, name)
        try:
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            return
        self.nbytes -= size
        if self.fsync:  # else a power loss could bring a closed session back
            os.fsync(folder)
