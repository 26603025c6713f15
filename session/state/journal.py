"""Crash recovery: each live session's transcript and images on disk (default under /dev/shm).

A session is journaled after every turn it completes (an atomic rename, so a reader never sees
a half-written entry) and removed when it is closed or expires. When the worker process dies
and is restarted, the engine reads the journal back: every live session returns without its
KV cache and is recomputed from its transcript on its next request, answering exactly as if
nothing had happened. Images are stored once per content hash. A corrupt entry is logged,
moved aside and skipped: never a crash loop.

Privacy and bounds: the directory and every file in it are readable by the server's user only
(0700 / 0600): transcripts and images are the users' data. The journal holds at most
``max_bytes``; a write that would pass it raises ``JournalFull`` (an OSError, ENOSPC) like a full
disk would, and the caller treats both the same way (docs/ENGINE.md, "durability faults").
"""

from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


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


class Journal:
    def __init__(self, directory: str | Path, max_bytes: int = 0):
        self.directory = Path(directory)
        self.sessions_dir = self.directory / "sessions"
        self.images_dir = self.directory / "images"
        self.max_bytes = max_bytes  # 0: no cap
        for path in (self.directory, self.sessions_dir, self.images_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.chmod(0o700)  # also when it existed (an older, world-readable journal)
        self.num_corrupt = 0
        self.nbytes = sum(p.stat().st_size for d in (self.sessions_dir, self.images_dir) for p in d.iterdir()
                          if p.suffix != ".corrupt")

    def write(self, entry: JournalEntry) -> None:
        data = {"version": FORMAT_VERSION, **asdict(entry)}
        self._write(self.sessions_dir / f"{entry.session_id}.json", json.dumps(data).encode())

    def remove(self, session_id: str) -> None:
        self._remove(self.sessions_dir / f"{session_id}.json")

    def has_image(self, digest: str) -> bool:
        return (self.images_dir / digest).exists()

    def write_image(self, digest: str, raw: bytes) -> None:
        path = self.images_dir / digest
        if not path.exists():
            self._write(path, raw)

    def read_image(self, digest: str) -> bytes:
        return (self.images_dir / digest).read_bytes()

    def remove_image(self, digest: str) -> None:
        self._remove(self.images_dir / digest)

    def write_adapters(self, adapters: dict[str, dict]) -> None:
        """Adapters registered at run time (name -> {"src", "pinned"}), so a restart keeps them."""
        _atomic_write(self.directory / "adapters.json", json.dumps(adapters).encode())

    def _write(self, path: Path, data: bytes) -> None:
        old = path.stat().st_size if path.exists() else 0
        if self.max_bytes and self.nbytes - old + len(data) > self.max_bytes:
            raise JournalFull(len(data) - old, self.max_bytes)
        _atomic_write(path, data)
        self.nbytes += len(data) - old

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        path.unlink(missing_ok=True)
        self.nbytes -= size

    def adapters(self) -> dict[str, dict]:
        path = self.directory / "adapters.json"
        try:
            return json.loads(path.read_bytes()) if path.exists() else {}
        except ValueError as exc:
            logger.warning("skipping corrupt %s: %s", path, exc)
            return {}

    def entries(self) -> list[JournalEntry]:
        """Every readable entry; corrupt or partial ones are moved aside with a log line."""
        out = []
        for path in sorted(self.sessions_dir.glob("*.json")):
            try:
                data = json.loads(path.read_bytes())
                if data.pop("version") != FORMAT_VERSION:
                    raise ValueError("unknown journal format version")
                entry = JournalEntry(**data)
                missing = [d for d in entry.image_digests if not (self.images_dir / d).exists()]
                if missing:
                    raise ValueError(f"missing image(s) {missing}")
                if not all(isinstance(t, int) for t in entry.token_ids):
                    raise ValueError("token ids are not integers")
            except Exception as exc:  # any defect in one entry must not stop the worker
                self.num_corrupt += 1
                logger.warning("skipping corrupt journal entry %s: %s", path.name, exc)
                self.nbytes -= path.stat().st_size
                path.rename(path.with_suffix(".corrupt"))
                continue
            out.append(entry)
        return out


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by other users
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
