"""KV caches: sessions' keys and values, in blocks of a shared pool or in one fixed buffer.

Paged (the dynamic path): one ``KVPool`` per model and block size (session/model/kv_pool.py: the
tensors and their layout; its ``blocks``, session/model/block_pool.py: which block is free, held,
shared or idle) holds every session's keys and values. A ``PagedKVCache`` is one session's list of
block ids (its block table). It grows by taking free blocks, so growth never copies what a session
already holds, and a decode step for many sessions is one attention call per layer over the pool
(session/model/attention.py). Block 0 is the pool's padding block: rows that pad a batch (CUDA
graphs) write and read there; no session ever holds it.

Static (the fixed-shape path, session/model/static_shapes.py): ``StaticKVCache`` is one buffer
``[num_layers, num_kv_heads, max_tokens, head_dim]`` per K and V, allocated whole: the shape a
static-shape compiler (NeuronCore, torch.compile without dynamic shapes) needs.

Both satisfy ``KVCache``, the interface the engine uses.

Sharing (paged only): the pool counts each block's holders. A full block a cache has written can be
published under its content key (session/model/prefix_cache.py); another cache then holds the same
block as its own prefix (``share_prefix``) instead of recomputing it. A published or multiply held
block is never written again: caches write only past their length, and ``crop`` copies such a block
before cutting into it. A published block no cache holds is idle: kept, least recently used first,
until the pool needs it (a ``fixed`` pool, sized from a budget), the idle cap, or the memory manager
evicts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from session.model.block_pool import PAD_BLOCK
from session.model.blocks import blocks_for, slot_ids
from session.model.kv_pool import KVPool

__all__ = ["PAD_BLOCK", "KVCache", "KVPool", "PagedKVCache", "PoolAccounts", "StaticKVCache", "to_device"]


class KVCache(Protocol):
    """One session's keys and values, as the engine, the model runner and the memory manager use
    them. Who calls this: the engine loop thread only."""

    length: int  # tokens whose keys and values are stored
    max_tokens: int

    @property
    def capacity(self) -> int:
        """Positions held now (a paged cache: its blocks, whole)."""

    @property
    def nbytes(self) -> int:
        """Device bytes this cache holds."""

    @property
    def token_nbytes(self) -> int:
        """Bytes one token's keys and values take in every layer."""

    def capacity_for(self, num_tokens: int) -> int:
        """The capacity ``ensure_capacity(num_tokens)`` would leave (never less than today's)."""

    def ensure_capacity(self, num_tokens: int) -> None:
        """Hold room for ``num_tokens`` positions (before a prefill or decode run reaches them)."""

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_kv_heads, T, head_dim] for positions start .. start+T-1 of ``layer``."""

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """[num_kv_heads, end, head_dim]."""

    def values(self, layer: int, end: int) -> torch.Tensor:
        """[num_kv_heads, end, head_dim]."""

    def share_prefix(self, keys: list[bytes]) -> int:
        """Hold published blocks of the longest prefix of ``keys``; the tokens they hold (0: none)."""

    def publish(self, keys: list[bytes]) -> int:
        """Publish full written blocks under ``keys``; how many were newly published."""

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on."""

    def release(self) -> None:
        """Give back every position held; a later ``ensure_capacity`` takes room again."""

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact host copies, K and V [num_layers, num_kv_heads, length, head_dim]."""

    def load(self, k: torch.Tensor, v: torch.Tensor, keys: Sequence[bytes] = ()) -> int:
        """Store ``to_host``'s copies as this empty cache's first positions; the tokens shared."""


class PoolAccounts:
    """The bytes of several pools (a target's and its draft's) for the memory manager
    (session/state/memory.py): held (by any cache, a shared block once), idle, and by kind."""

    def __init__(self, pools: list[KVPool]):
        self.pools = pools

    def held_bytes(self) -> int:
        return sum(p.blocks.num_held * p.block_nbytes for p in self.pools)

    def idle_bytes(self) -> int:
        return sum(len(p.blocks.prefix.idle) * p.block_nbytes for p in self.pools)

    def fits(self, needs: Sequence[tuple[KVPool, int]]) -> bool:
        """Can each pool hand out the blocks asked of it (``needs``: pool, blocks) without growing?"""
        return all(pool.blocks.can_take(blocks) for pool, blocks in needs)

    def evict_idle_bytes(self, num_bytes: int) -> int:
        freed = 0
        for pool in self.pools:
            if freed < num_bytes:
                freed += pool.evict_idle_bytes(num_bytes - freed)
        return freed

    def usage_bytes(self) -> dict[str, int]:
        """"pinned" (held by one cache), "shared" (by several, counted once), "cached" (idle) bytes."""
        out = {"pinned": 0, "shared": 0, "cached": 0}
        for pool in self.pools:
            for kind, blocks in pool.blocks.usage().items():
                out[kind] += blocks * pool.block_nbytes
        return out

    def counters(self) -> dict[str, int]:
        prefixes = [p.blocks.prefix for p in self.pools]
        return {"hit_blocks": sum(p.num_hit_blocks for p in prefixes),
                "evicted_blocks": sum(p.num_evicted for p in prefixes),
                "published_blocks": sum(len(p) for p in prefixes)}


def to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as ``dtype`` on ``device``; to a GPU from pinned host memory, without waiting for the copy."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class PagedKVCache:
    """One session's keys and values: its block table into a ``KVPool``. Who calls this: the
    engine loop thread (model runner, sessions, memory manager), never two threads at once."""

    def __init__(self, pool: KVPool, *, max_tokens: int):
        self.pool = pool
        self.num_layers, self.num_kv_heads, self.head_dim = pool.num_layers, pool.num_kv_heads, pool.head_dim
        self.dtype, self.device = pool.dtype, pool.device
        self.max_tokens = max_tokens
        self.block_ids: list[int] = []  # the block table: position p lives in block_ids[p // block_tokens]
        self.length = 0  # tokens whose keys and values are stored
        self._slots: tuple[tuple, torch.Tensor] | None = None  # the last write's slots, reused by every layer

    @property
    def block_tokens(self) -> int:
        return self.pool.block_tokens

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_tokens

    @property
    def token_nbytes(self) -> int:
        return self.pool.token_nbytes

    @property
    def nbytes(self) -> int:
        """Device bytes this session holds: its blocks, whole."""
        return len(self.block_ids) * self.pool.block_nbytes

    def capacity_for(self, num_tokens: int) -> int:
        """The capacity ``ensure_capacity(num_tokens)`` would leave (never less than today's)."""
        blocks = blocks_for(num_tokens, self.block_tokens)
        return max(self.capacity, blocks * self.block_tokens)

    def ensure_capacity(self, num_tokens: int) -> None:
        """Called before a prefill or decode run with the largest length it may reach. Takes free
        blocks from the pool; what the session holds stays where it is."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"KV cache cannot hold {num_tokens} tokens (max {self.max_tokens})")
        missing = blocks_for(num_tokens, self.block_tokens) - len(self.block_ids)
        if missing > 0:
            self.block_ids += self.pool.allocate(missing)

    def slots(self, start: int, end: int) -> list[int]:
        return slot_ids(self.block_ids, self.block_tokens, start, end)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_kv_heads, T, head_dim] for positions start .. start+T-1. The slots go to the
        device once per pass, not once per layer (each copy from a list is a host sync on CUDA), and
        from pinned memory without blocking; keyed by the blocks they name, so a table changed since
        (a crop, copy-on-write) gets new ones."""
        end = start + k.shape[1]
        key = (start, end, tuple(self.block_ids[start // self.block_tokens: blocks_for(end, self.block_tokens)]))
        if self._slots is None or self._slots[0] != key:
            self._slots = key, to_device(self.slots(start, end), self.device)
        self.pool.write(layer, self._slots[1], k, v)

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """[num_kv_heads, end, head_dim]: a view of the pool when the blocks are consecutive, else a gather."""
        return self.pool.read(layer, self.block_ids, end)

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.pool.read(layer, self.block_ids, end, values=True)

    def runs(self, layer: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of positions start .. end-1 as views of the pool, [num_kv_heads, n, head_dim]
        each, one per run of consecutive blocks: no copy however the session grew (the per-row decode
        attends to each run and merges them by their log-sum-exp)."""
        return [self.pool.run(layer, *bounds) for bounds in self.run_bounds(start, end)]

    def run_bounds(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Positions start .. end-1 as runs of consecutive blocks: (first block, number of blocks, first
        token, end token within the run) each, for ``KVPool.run`` / ``run_all_layers``."""
        size, out = self.block_tokens, []
        index = start // size
        while index * size < end:
            last = index  # extend the run while the next block is the pool's next block
            while (last + 1) * size < end and self.block_ids[last + 1] == self.block_ids[last] + 1:
                last += 1
            lo, hi = max(start, index * size) - index * size, min(end, (last + 1) * size) - index * size
            out.append((self.block_ids[index], last - index + 1, lo, hi))
            index = last + 1
        return out

    def share_prefix(self, keys: list[bytes]) -> int:
        """Hold the pool's published blocks of the longest prefix of ``keys`` (block keys of the
        sequence about to be prefilled, session/model/prefix_cache.py) as this empty cache's first
        blocks; returns the tokens they hold (its new ``length``). They are read, never written: a
        cache writes only at its ``length`` and on, and ``crop`` copies a shared block it cuts into."""
        assert self.length == 0 and not self.block_ids, "share_prefix() takes an empty cache"
        self.block_ids = self.pool.blocks.lookup(keys)
        self.length = len(self.block_ids) * self.block_tokens
        return self.length

    def publish(self, keys: list[bytes]) -> int:
        """Publish this cache's full, written blocks under ``keys`` (one per block from the first) so
        that other caches' ``share_prefix`` finds them; how many were newly published."""
        full = min(len(keys), self.length // self.block_tokens)
        return self.pool.blocks.publish(self.block_ids[:full], keys[:full])

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on. Private blocks stay held; from the first block past the
        kept full ones that is shared (published or held elsewhere) on, blocks are given back, and a
        shared block that ``length`` cuts into is first copied to a private one (copy-on-write), so
        that writing there never changes what another cache reads; a full fixed pool has no block to
        copy into, and the cache then ends before that block (its owner recomputes the rest)."""
        self.length = min(self.length, length)
        size, keep = self.block_tokens, self.length // self.block_tokens
        blocks = self.pool.blocks
        cut = next((i for i in range(keep, len(self.block_ids)) if blocks.is_shared(self.block_ids[i])), None)
        if cut is None:
            return
        tail = self.block_ids[cut:]
        self.block_ids = self.block_ids[:cut]
        if not (cut == keep and self.length % size):
            blocks.free(tail)
            return
        blocks.free(tail[1:])  # first: a private block given back is one to copy into
        if not blocks.can_take(1):
            self.length = keep * size  # a full fixed pool: the partly kept block's positions are given up too
        else:  # the partly kept block: its kept positions, copied
            [copy] = self.pool.allocate(1)
            self.pool.copy_block(tail[0], copy)
            self.block_ids.append(copy)
        blocks.free(tail[:1])

    def release(self) -> None:
        """Give every block back to the pool; a later ``ensure_capacity`` takes blocks again."""
        self.pool.blocks.free(self.block_ids)
        self.block_ids = []
        self.length = 0

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact host copies of what is stored: K, V [num_layers, num_kv_heads, length, head_dim]."""
        return self.pool.host_copy(self.block_ids, self.length)

    def load(self, k: torch.Tensor, v: torch.Tensor, keys: Sequence[bytes] = ()) -> int:
        """Store ``to_host``'s copies as this (empty) cache's first ``k.shape[2]`` positions. With the
        content ``keys`` of its blocks, the longest published prefix is shared instead of copied (a
        session restored from the host tier holds what others hold once). Returns the tokens shared."""
        length = k.shape[2]
        shared = 0
        reserved = self.capacity  # what the turn took (the memory manager made room for it)
        if keys:
            self.release()  # the capacity taken for the turn: taken again past the shared prefix
            shared = self.share_prefix(list(keys[:length // self.block_tokens]))
        self.ensure_capacity(max(length, min(reserved, self.max_tokens)))
        if shared < length:
            self.pool.store(to_device(self.slots(shared, length), self.device), k[:, :, shared:], v[:, :, shared:])
        self.length = length
        return shared


STATIC_PAD_TOKENS = 16  # positions past a static cache's window that a padded step may write, never read


class StaticKVCache:
    """One session's keys and values in a buffer of ``max_tokens`` positions (and STATIC_PAD_TOKENS
    more, for the padding rows of a fixed-shape step: session/model/static_shapes.py), allocated
    whole; a step writes its new positions in place. Who calls this: the static-shape runner, the
    engine loop."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_tokens = max_tokens
        self.length = 0  # tokens whose keys and values are stored
        self.k = self._empty(max_tokens)
        self.v = self._empty(max_tokens)

    def _empty(self, capacity: int) -> torch.Tensor:
        # Read whole under a mask: masked positions get weight 0, and 0 * NaN from uninitialised
        # memory would still be NaN, so the buffers start zeroed.
        positions = capacity + STATIC_PAD_TOKENS if capacity else 0
        return torch.zeros(self.num_layers, self.num_kv_heads, positions, self.head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def capacity(self) -> int:
        """Positions the window holds (the buffer less its padding positions); 0 once released."""
        return max(0, self.k.shape[2] - STATIC_PAD_TOKENS)

    @property
    def token_nbytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (both buffers, whole, padding positions included)."""
        return self.k.shape[2] * self.token_nbytes

    def capacity_for(self, num_tokens: int) -> int:
        return self.max_tokens + STATIC_PAD_TOKENS  # in the memory manager's bytes: the whole buffer

    def ensure_capacity(self, num_tokens: int) -> None:
        """Allocates the buffers again after a ``release``; otherwise only checks ``max_tokens``."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"KV cache cannot hold {num_tokens} tokens (max {self.max_tokens})")
        if num_tokens > self.capacity:
            self.k, self.v = self._empty(self.max_tokens), self._empty(self.max_tokens)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_kv_heads, T, head_dim] for positions start .. start+T-1
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self.k[layer, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.v[layer, :, :end]

    def share_prefix(self, keys: list[bytes]) -> int:
        """A whole buffer per session shares nothing: 0 tokens."""
        return 0

    def publish(self, keys: list[bytes]) -> int:
        return 0

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on (the buffers stay allocated)."""
        self.length = min(self.length, length)

    def release(self) -> None:
        """Free the buffers; a later ``ensure_capacity`` allocates them again, in full."""
        self.length = 0
        self.k = self._empty(0)
        self.v = self._empty(0)

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length].to("cpu", copy=True), self.v[:, :, : self.length].to("cpu", copy=True)

    def load(self, k: torch.Tensor, v: torch.Tensor, keys: Sequence[bytes] = ()) -> int:
        """A whole buffer per session shares nothing: all of it is copied (0 tokens shared)."""
        length = k.shape[2]
        self.ensure_capacity(length)
        self.k[:, :, :length].copy_(k)
        self.v[:, :, :length].copy_(v)
        self.length = length
        return 0


