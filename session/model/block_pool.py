"""The bookkeeping of a paged KV pool: which blocks are free, held (and by how many caches),
published under a content key, or idle; no tensor in sight (this module does not import torch).

Block ids are ints ``1 .. num_blocks - 1``; block 0 is the padding block (rows that pad a batch write
and read there, no cache holds it). A block is in exactly one state:
- free: in ``free_ids`` (or ``settling``, below), held by none, unpublished;
- held: ``refs[block]`` caches hold it (shared when more than one);
- idle: published (session/model/prefix_cache.py) and held by none, kept for a later ``lookup``,
  least recently used first, until evicted.
``check`` verifies exactly that against every block table.

Settling: a block given back while a host copy may still be reading it (a GPU's side-stream copy,
session/model/kv_pool.py) must not be written before the copy ends; the storage tells the pool so
through its ``HostCopies``, and such blocks wait in ``settling`` until the copy is seen done.

Who calls this: ``KVPool`` (the tensors), the caches it hands out, the memory plan that sizes it
(``fixed``), the memory manager for idle bytes; the engine loop thread only.
"""

from __future__ import annotations

from typing import Protocol

from session.model.prefix_cache import PrefixTable

PAD_BLOCK = 0  # the padding block (see the module docstring)


class HostCopies(Protocol):
    """The storage's host copies, as far as the bookkeeping cares (session/model/kv_pool.py)."""

    def pending(self) -> bool:
        """May a host copy still read blocks given back now? (Seen done, it calls ``settle``.)"""

    def wait(self) -> None:
        """Block until the latest host copy is done."""


class NoHostCopies:
    """Host copies that never outlive the call that made them (CPU, tests)."""

    def pending(self) -> bool:
        return False

    def wait(self) -> None:
        pass


class BlockPool:
    """Ref counts, the free list, the prefix table and eviction of one pool's blocks."""

    def __init__(self, num_blocks: int = 1, *, copies: HostCopies | None = None):
        self.refs = [0] * max(num_blocks, 1)  # block -> caches holding it (the padding block: 0 forever)
        self.free_ids = list(range(self.num_blocks - 1, PAD_BLOCK, -1))  # popped from the end: lowest id first
        self.settling: list[int] = []  # free, but a host copy may still read them (module docstring)
        self.num_held = 0  # blocks with refs > 0
        self.num_shared = 0  # blocks with refs > 1
        self.prefix = PrefixTable()  # published blocks by content key
        self.fixed = False  # sized from a device budget: full means evict idle blocks, never grow
        self.copies = copies or NoHostCopies()

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the padding block included."""
        return len(self.refs)

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.settling)

    @property
    def available(self) -> int:
        """Blocks ``take`` can hand out without growing: the free ones and, in a fixed pool, the idle
        published ones it would evict."""
        return self.num_free + (len(self.prefix.idle) if self.fixed else 0)

    def can_take(self, num_blocks: int) -> bool:
        """Can ``take(num_blocks)`` succeed without the pool growing? (Always, for a pool that may grow.)"""
        return not self.fixed or num_blocks <= self.available

    def shortfall(self, num_blocks: int) -> int:
        """Blocks the pool must grow by before ``take(num_blocks)``: 0 when the free ones (with, in a
        fixed pool, the idle ones) suffice. A fixed pool never grows: its caller refuses instead."""
        return max(0, num_blocks - (self.available if self.fixed else self.num_free))

    def take(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free ids, each now held once; a fixed pool evicts idle blocks for them,
        least recently used first, and the host waits for the copy reading settling blocks only when
        the free ones fall short. The caller grew the pool first (``shortfall`` is 0)."""
        assert not self.shortfall(num_blocks), f"{num_blocks} blocks asked of a pool with {self.available} available"
        self.copies.pending()  # blocks a finished host copy held back are free again
        if num_blocks > self.num_free:
            self.evict(num_blocks - self.num_free)
        if num_blocks > len(self.free_ids):
            self.copies.wait()
            self.settle()
        taken = self.free_ids[len(self.free_ids) - num_blocks:][::-1]
        del self.free_ids[len(self.free_ids) - num_blocks:]
        for block in taken:
            self.refs[block] = 1
        self.num_held += num_blocks
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one hold on each block. A block no cache holds any more is free again, or, if it is
        published, idle: kept for a later ``lookup`` until evicted. A table's tail goes idle before its
        head, so eviction takes a chain's last blocks first (its head is what other requests share)."""
        freed = []
        for block in reversed(block_ids):
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} freed more often than it was held"
            self.num_shared -= self.refs[block] == 1
            if self.refs[block]:
                continue
            self.num_held -= 1
            if block in self.prefix.key_of:
                self.prefix.idle[block] = None
                self.prefix.idle.move_to_end(block)
            else:
                freed.append(block)
        self._give_back(freed)
        cap = self.prefix.max_idle_blocks
        if cap is not None and len(self.prefix.idle) > cap:
            self.evict(len(self.prefix.idle) - cap)

    def grow(self, num_blocks: int) -> None:
        """Count ``num_blocks`` blocks (the padding block included); the storage grew its tensors.
        New ids are taken after the old free ones."""
        old = self.num_blocks
        self.free_ids[:0] = range(num_blocks - 1, old - 1, -1)
        self.refs += [0] * (num_blocks - old)

    # ---- sharing: blocks published by content key (session/model/prefix_cache.py)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The published blocks of the longest prefix of ``keys``, each now held once more."""
        found = []
        for key in keys:
            block = self.prefix.block_of.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                self.prefix.idle.pop(block)
                self.num_held += 1
            self.num_shared += self.refs[block] == 1
            self.refs[block] += 1
            found.append(block)
        self.prefix.num_hit_blocks += len(found)
        return found

    def publish(self, block_ids: list[int], keys: list[bytes]) -> int:
        """Publish full, written blocks under their keys (the ones not yet published); how many were."""
        return sum(self.prefix.publish(block, key) for block, key in zip(block_ids, keys))

    def is_shared(self, block: int) -> bool:
        """May another cache read this block (published, or held more than once)? Then no cache
        writes into it: a cache copies it before cutting into it."""
        return self.refs[block] > 1 or block in self.prefix.key_of

    def evict(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` idle blocks, least recently used first: unpublished and free again."""
        evicted = self.prefix.evict(num_blocks)
        self._give_back(evicted)
        return evicted

    # ---- settling: blocks a host copy may still read

    def _give_back(self, blocks: list[int]) -> None:
        if self.copies.pending():
            self.settling.extend(blocks)
        else:
            self.free_ids.extend(sorted(blocks, reverse=True))

    def settle(self) -> None:
        """The host copy is done (or waited for): the settling blocks are free."""
        self.free_ids.extend(sorted(self.settling, reverse=True))
        self.settling = []

    # ---- what it holds

    def usage(self) -> dict[str, int]:
        """Blocks by kind: "pinned" (held by one cache), "shared" (by several), "cached" (idle)."""
        return {"pinned": self.num_held - self.num_shared, "shared": self.num_shared, "cached": len(self.prefix.idle)}

    def check(self, tables: list[list[int]]) -> list[str]:
        """Violations of the invariant, given every block table that holds the pool's blocks: each
        block's ref count equals its holders; a free block is neither held nor published; an idle
        block is published and held by none; no held block is free; every block is in one state."""
        holders = [0] * self.num_blocks
        for table in tables:
            for block in table:
                holders[block] += 1
        problems = [f"block {b}: {self.refs[b]} refs, {holders[b]} holders" for b in range(self.num_blocks)
                    if self.refs[b] != holders[b]]
        free = set(self.free_ids) | set(self.settling)
        if len(free) != self.num_free or PAD_BLOCK in free:
            problems.append("the free list repeats a block or holds the padding block")
        problems += [f"block {b}: free but held or published" for b in free
                     if holders[b] or b in self.prefix.key_of]
        problems += [f"block {b}: idle but held or unpublished" for b in self.prefix.idle
                     if holders[b] or b not in self.prefix.key_of]
        num_holding = sum(1 for h in holders if h)
        unaccounted = self.num_blocks - 1 - len(free) - len(self.prefix.idle) - num_holding
        if unaccounted or self.num_held != num_holding:
            problems.append(f"{unaccounted} blocks neither free, idle nor held; num_held {self.num_held}")
        if self.num_shared != sum(1 for h in holders if h > 1):
            problems.append(f"num_shared {self.num_shared}, but {sum(1 for h in holders if h > 1)} blocks are shared")
        return problems
