"""Image embeddings shared by content hash and reference-counted, under a byte bound.

Two sessions on the same image encode it once. Entries live in host memory: the KV cache
already carries an image's effect, so the embedding is needed again only to recompute a
session whose KV was dropped (or lost in a crash) — a few MB against the KV's hundreds.
An entry's tensor may be absent (after a restart, or evicted) until the engine recomputes it
from the image's encoded bytes. Bookkeeping only; the engine computes the tensors.

The bound: past ``max_bytes`` of tensors, ``evict`` drops tensors least recently used first
(stored or read for a prefill), keeping each entry, its references and its grid. It drops only
tensors whose image bytes can be got back (kept in memory or journaled), so an eviction costs
one re-encode on that image's next prefill, never a session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch


@dataclass
class EmbeddingEntry:
    digest: str
    tensor: torch.Tensor | None = None  # [num_image_tokens, hidden] on the host, or None until computed
    refs: int = 0  # image occurrences in live sessions and running requests
    grid: tuple[int, int, int] | None = None  # Qwen-VL: the image's (t, h, w) patch grid, set with the tensor
    num_tokens: int | None = None  # placeholder tokens the image expands to (kept like the grid), None until known

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


class EmbeddingCache:
    """Who calls this: ``Sessions`` on the engine loop thread (the stats snapshot reads the counters)."""

    def __init__(self, max_bytes: int = 0):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no bound), got {max_bytes}")
        self.max_bytes = max_bytes  # 0: no bound
        self._entries: OrderedDict[str, EmbeddingEntry] = OrderedDict()  # digest -> entry, least recently used first
        self.num_hits = 0  # an image whose embedding was already here
        self.num_misses = 0  # an image we had to encode
        self.num_evictions = 0  # tensors dropped by the bound

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: object) -> bool:
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

    def store(self, digest: str, tensor: torch.Tensor, grid: tuple[int, int, int] | None = None) -> None:
        """An acquired image's encoding (host tensor) and grid, now its most recently used."""
        entry = self._entries[digest]
        entry.tensor, entry.grid, entry.num_tokens = tensor, grid, tensor.shape[0]
        self._entries.move_to_end(digest)

    def describe(self, digest: str, num_tokens: int, grid: tuple[int, int, int] | None) -> None:
        """What an acquired image's preprocessing says of it (its placeholder count and grid), known
        before (or without) its encoding: a prefill whose shared prefix covers the image never encodes it."""
        entry = self._entries[digest]
        entry.num_tokens, entry.grid = num_tokens, entry.grid or grid

    def use(self, digest: str) -> torch.Tensor:
        """The stored tensor, read for a prefill: it becomes the most recently used."""
        entry = self._entries[digest]
        assert entry.tensor is not None, f"image {digest[:12]} has no embedding: store it first"
        self._entries.move_to_end(digest)
        return entry.tensor

    def evict(self, recoverable: Callable[[str], bool], keep: Collection[str] = ()) -> list[str]:
        """Drop tensors, least recently used first, until at most ``max_bytes`` remain (or none may go).
        Only those whose image ``recoverable(digest)`` says can be encoded again, never those in ``keep``
        (the prefill about to use them). Returns the digests whose tensors went, in that order.
        Who calls this: ``Sessions``, after each prefill's embeddings are gathered."""
        excess = self.nbytes - self.max_bytes if self.max_bytes else 0
        evicted = []
        for digest, entry in self._entries.items():
            if excess <= 0:
                break
            if entry.tensor is None or digest in keep or not recoverable(digest):
                continue
            excess -= entry.nbytes
            entry.tensor = None  # the entry, its references and its grid stay: positions need the grid
            evicted.append(digest)
        self.num_evictions += len(evicted)
        return evicted
