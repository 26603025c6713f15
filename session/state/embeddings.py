"""Image embeddings shared by content hash and reference-counted.

Two sessions on the same image encode it once. Entries live in host memory: the KV cache
already carries an image's effect, so the embedding is needed again only to recompute a
session whose KV was dropped (or lost in a crash) — a few MB against the KV's hundreds.
An entry's tensor may be absent (after a restart) until the engine recomputes it from the
journaled image bytes. Bookkeeping only; the engine computes the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EmbeddingEntry:
    digest: str
    tensor: torch.Tensor | None = None  # [num_image_tokens, hidden] on the host, or None until computed
    refs: int = 0  # image occurrences in live sessions and running requests
    grid: tuple[int, int, int] | None = None  # Qwen-VL: the image's (t, h, w) patch grid, set with the tensor

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


class EmbeddingCache:
    def __init__(self):
        self._entries: dict[str, EmbeddingEntry] = {}  # digest -> entry
        self.num_hits = 0  # an image whose embedding was already here
        self.num_misses = 0  # an image we had to encode

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def acquire(self, digest: str) -> EmbeddingEntry:
        """Take a reference; the entry exists (perhaps without a tensor) until its last release."""
        entry = self._entries.setdefault(digest, EmbeddingEntry(digest))
        entry.refs += 1
        return entry

    def release(self, digest: str) -> bool:
        """Drop a reference; returns True when that was the last one and the entry is gone."""
        entry = self._entries[digest]
        entry.refs -= 1
        if entry.refs > 0:
            return False
        del self._entries[digest]
        return True

    def get(self, digest: str) -> EmbeddingEntry:
        return self._entries[digest]
