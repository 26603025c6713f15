"""Content keys of KV blocks, and the table that finds a block by its key (the shared prefix cache).

A full block of a sequence's KV is determined by everything up to its end: the model, the LoRA
adapter, every token before and in it, and, where tokens are image placeholders, the images they
stand for. ``block_keys`` names each full block by a hash chain over exactly that: block i's key is
``blake2b(key(i-1) + its tokens + the digests of the images whose placeholders begin in it)``, block
0 chained from the salt (the adapter). Images are named by their content digest, and each image's
placeholder count is fixed by its content, so the placeholders' assignment to images (which rows of
which image embedding fill them, and for M-RoPE their grid positions) follows from the tokens and
the ordered digests: two sequences with equal keys up to block i hold bit-equal inputs up to there.
The model is not in the key: each model has its own pool, and each pool its own table.

``PrefixTable`` (one per ``BlockPool``, session/model/block_pool.py) maps keys to the pool's published blocks and keeps the idle
ones (published, held by no cache) least recently used first, for eviction. A block table keeps the
block ids; ref counts and the free list stay in the pool (session/model/block_pool.py): why a block
table and not a radix tree is in docs/ENGINE.md, "Shared KV blocks".
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

KEY_BYTES = 16  # 128-bit keys: a collision is as likely as a random 128-bit match


def block_keys(token_ids: Sequence[int], block_tokens: int, *, salt: bytes = b"", image_token_id: int | None = None,
               image_digests: Sequence[str] = (), image_counts: Sequence[int] = ()) -> list[bytes]:
    """Keys of the full blocks of ``token_ids``: one per ``block_tokens`` tokens, a partial tail left out.

    ``image_digests`` and ``image_counts``: each image occurrence in order, with how many placeholder
    tokens (``image_token_id``) it expands to. When the counts do not add up to the placeholders in
    ``token_ids`` (an image whose count is unknown), no key is returned: nothing is shared or published."""
    starts: dict[int, list[str]] = {}  # block index -> digests of the images that begin in it
    if image_digests:
        placeholders = [i for i, t in enumerate(token_ids) if t == image_token_id]
        if len(image_counts) != len(image_digests) or sum(image_counts) != len(placeholders):
            return []
        first = 0
        for digest, count in zip(image_digests, image_counts):
            starts.setdefault(placeholders[first] // block_tokens, []).append(digest)
            first += count
    elif image_token_id is not None and image_token_id in token_ids:
        return []
    keys, parent = [], hashlib.blake2b(salt, digest_size=KEY_BYTES).digest()
    for index in range(len(token_ids) // block_tokens):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(array("q", token_ids[index * block_tokens:(index + 1) * block_tokens]).tobytes())
        for digest in starts.get(index, ()):
            h.update(b"\0image:" + digest.encode())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixTable:
    """Published blocks of one pool by key, and the idle ones in LRU order. Who calls this: the
    ``BlockPool`` that owns it (engine loop thread only)."""

    def __init__(self, max_idle_blocks: int | None = None):
        self.block_of: dict[bytes, int] = {}  # key -> the block that holds it
        self.key_of: dict[int, bytes] = {}  # block -> its key (published blocks only)
        self.idle: OrderedDict[int, None] = OrderedDict()  # published blocks no cache holds, least recent first
        self.max_idle_blocks = max_idle_blocks  # None: no cap of its own (a device budget may still evict)
        self.num_hit_blocks = 0  # blocks a lookup found (each a block of prefill skipped)
        self.num_evicted = 0  # idle blocks evicted (their keys forgotten, the blocks free again)

    def __len__(self) -> int:
        return len(self.key_of)

    def publish(self, block: int, key: bytes) -> bool:
        """Publish ``block`` under ``key``: False when the key already names another block (this one
        stays private) or the block is already published."""
        if block in self.key_of or key in self.block_of:
            return False
        self.block_of[key] = block
        self.key_of[block] = key
        return True

    def forget(self, block: int) -> None:
        key = self.key_of.pop(block)
        del self.block_of[key]
        self.idle.pop(block, None)

    def evict(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` idle blocks, least recently used first, unpublished: now free."""
        out: list[int] = []
        while self.idle and len(out) < num_blocks:
            block = next(iter(self.idle))
            self.forget(block)
            out.append(block)
        self.num_evicted += len(out)
        return out
