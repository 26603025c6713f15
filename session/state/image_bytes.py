"""The encoded images of live sessions that the journal does not hold, kept in memory.

Who calls this: ``Sessions`` only (session/state/sessions.py), on the engine loop thread. After a
turn, the bytes of its session's images are kept here when the journal does not hold them (no
journal, a failed write, a session over its quota), up to ``max_bytes`` in all, so that an export,
a later journal write and the re-encoding of an evicted embedding have them; the journal's copy
serves otherwise. An image's bytes leave when the journal takes them or its last reference goes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from session.errors import ResidentError
from session.state.journal import Journal, is_digest
from session.state.session import SessionState
from session.types import redact

logger = logging.getLogger(__name__)

MAX_KEPT_IMAGE_BYTES = 256 << 20  # encoded images kept in memory (those the journal does not hold)


class ImageBytes:
    """Encoded images by digest: kept in memory, else read back from the journal."""

    def __init__(self, journal: Journal | None, max_bytes: int = MAX_KEPT_IMAGE_BYTES):
        self.journal = journal
        self.max_bytes = max_bytes
        self._kept: dict[str, bytes] = {}  # digest -> encoded image the journal does not hold
        self.num_bytes = 0  # sum of len() over _kept

    @property
    def kept(self) -> Mapping[str, bytes]:
        """digest -> encoded bytes kept in memory (a read-only view: the journal's write reads it)."""
        return MappingProxyType(self._kept)

    def keep(self, session: SessionState, image_bytes: Mapping[str, bytes]) -> None:
        """Keep the session's images from ``image_bytes`` in memory, while ``max_bytes`` allows; each
        stays until the journal takes it (``drop_journaled``) or its last reference goes (``drop``)."""
        for digest in dict.fromkeys(session.image_digests):
            raw = image_bytes.get(digest)
            if raw is None or digest in self._kept:
                continue
            if self.num_bytes + len(raw) > self.max_bytes:
                logger.info("image %s of session %s is not kept in memory: %d bytes are already", digest[:12],
                            redact(session.session_id), self.num_bytes)
                continue
            self._kept[digest] = raw
            self.num_bytes += len(raw)

    def drop(self, digest: str) -> None:
        """The image's last reference is gone (``Sessions``): its bytes leave memory, if kept."""
        raw = self._kept.pop(digest, None)
        if raw is not None:
            self.num_bytes -= len(raw)

    def drop_journaled(self, digests: Iterable[str]) -> None:
        """The images of ``digests`` that the journal now holds leave memory (after a journal write)."""
        journal = self.journal
        if journal is None:  # without a journal it holds nothing: every kept image stays
            return
        for digest in dict.fromkeys(digests):
            if digest in self._kept and is_digest(digest) and journal.has_image(digest):
                self.drop(digest)

    def read(self, digest: str) -> bytes:
        """An image's encoded bytes: kept in memory, else from the journal. Raises ResidentError (500)
        when neither has them (an image that came without bytes, or memory for them was full)."""
        raw = self._kept.get(digest)
        if raw is not None:
            return raw
        if self.journal is not None and is_digest(digest):
            try:
                return self.journal.read_image(digest)
            except OSError as exc:
                logger.warning("image %s cannot be read back from the journal: %s", digest[:12], exc)
        raise ResidentError(f"image {digest[:12]}: its bytes are neither kept in memory nor in the journal")

    def has(self, digest: str) -> bool:
        """Can the image's encoded bytes be got back (kept in memory, or journaled)? The embedding
        cache's bound evicts only such images' tensors (``EmbeddingCache.evict``)."""
        return digest in self._kept or (self.journal is not None and is_digest(digest)
                                        and self.journal.has_image(digest))
