"""KV caches: sessions' keys and values, in blocks of a shared pool or in one fixed buffer.

Paged (the dynamic path): one ``BlockPool`` per model and block size holds every session's keys
and values. On accelerators they are token-major, ``[num_layers, num_blocks, block_tokens,
num_kv_heads, head_dim]`` each, the layout FlashAttention's ``flash_attn_with_kvcache(block_table=...)``
reads. On CPU they are head-major, ``[num_layers, num_kv_heads, num_blocks, block_tokens, head_dim]``:
a head's keys over a run of consecutive blocks are then one contiguous stream, and torch's CPU flash
kernel read them faster than the token-major view, with the same bits (benchmarks/attention_paths.py
--layouts; docs/MEASUREMENTS.md, "KV layout on CPU"). Only the pool's
methods know the layout (and session/model/attention.py's FlashAttention call, token-major pools only).
A ``PagedKVCache`` is one
session's list of block ids (its block table). It grows by taking free blocks, so growth never
copies what a session already holds, and a decode step for many sessions is one attention call per
layer over the pool (session/model/attention.py). Block 0 is the pool's padding block: rows that pad a
batch (CUDA graphs) write and read there; no session ever holds it.

Static (the fixed-shape path, session/model/static_shapes.py): ``StaticKVCache`` is one buffer
``[num_layers, num_kv_heads, max_tokens, head_dim]`` per K and V, allocated whole: the shape a
static-shape compiler (NeuronCore, torch.compile without dynamic shapes) needs.

Both answer the interface the engine uses: ``length``, ``nbytes``, ``capacity``, ``capacity_for``,
``ensure_capacity``, ``write``, ``keys``, ``values``, ``crop``, ``release``, for the host tier
(session/state/memory.py) ``to_host`` / ``load``, and for the shared prefix cache ``share_prefix`` /
``publish`` (a static cache shares nothing).

Sharing (paged only): the pool counts each block's holders. A full block a cache has written can be
published under its content key (session/model/prefix_cache.py); another cache then holds the same
block as its own prefix (``share_prefix``) instead of recomputing it. A published or multiply held
block is never written again: caches write only past their length, and ``crop`` copies such a block
before cutting into it. A published block no cache holds is idle: kept, least recently used first,
until the pool needs it (a ``fixed`` pool, sized from a budget), the idle cap, or the memory manager
evicts it.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from session.errors import CapacityExceeded
from session.model.blocks import blocks_for
from session.model.prefix_cache import PrefixTable

logger = logging.getLogger(__name__)

PAD_BLOCK = 0  # the pool's padding block (see the module docstring)


class BlockPool:
    """Fixed-size KV blocks for every paged cache of one model (who calls this: ``ModelRunner``,
    which owns it, and the caches it hands out; the engine loop thread only).

    The pool is sized once where a device budget is known (``reserve``, from session/engine/assembly.py:
    on CUDA the budget is never unlimited). Such a pool is ``fixed``: it never grows, so never holds
    a second allocation of itself on a full card. The memory manager (session/state/memory.py) makes
    room in it before a turn takes blocks (``available``), demoting sessions where its idle blocks do
    not suffice; short all the same, ``allocate`` refuses (CapacityExceeded, 503) and ``crop`` gives
    up a partly kept block rather than copy it. Where nothing was reserved (CPU, no budget) it doubles
    when it runs out of free blocks: that copies the pool, at most log2(blocks) times in a worker's
    life, and never on a session's own growth.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_tokens: int, num_blocks: int = 1, head_major: bool | None = None):
        self.head_major = device.type == "cpu" if head_major is None else head_major  # see the module docstring
        self.block_dim = 2 if self.head_major else 1  # the blocks' dimension of k and v
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.block_tokens = block_tokens
        self.k = self._empty(max(num_blocks, 1))
        self.v = self._empty(max(num_blocks, 1))
        self.free_ids = list(range(self.num_blocks - 1, PAD_BLOCK, -1))  # popped from the end: lowest id first
        self.refs = [0] * self.num_blocks  # block -> caches holding it (the padding block: 0 forever)
        self.num_held = 0  # blocks with refs > 0
        self.num_shared = 0  # blocks with refs > 1
        self.prefix = PrefixTable()  # published blocks by content key (session/model/prefix_cache.py)
        self.fixed = False  # sized from a device budget: full means evict idle blocks, never grow
        self.num_grows = 0  # pool copies so far (CUDA graphs captured over the old pool are stale after one)
        # CUDA: host copies run on a side stream (``host_copy``); blocks freed while the latest may still
        # read them wait in ``settling`` until its event is seen complete (``_give_back``)
        self.copy_stream = None
        self.copying = None  # the event after the latest host copy, until seen complete
        self.settling: list[int] = []

    def _empty(self, num_blocks: int) -> torch.Tensor:
        # Zeroed: attention over a padded block table multiplies masked positions by 0, and 0 * NaN
        # from uninitialised memory would still be NaN.
        if self.head_major:
            shape = (self.num_layers, self.num_kv_heads, num_blocks, self.block_tokens, self.head_dim)
        else:
            shape = (self.num_layers, num_blocks, self.block_tokens, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[self.block_dim]

    @property
    def token_nbytes(self) -> int:
        """Bytes one token's keys and values take in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def block_nbytes(self) -> int:
        return self.block_tokens * self.token_nbytes

    def new_cache(self, max_tokens: int) -> PagedKVCache:
        return PagedKVCache(self, max_tokens=max_tokens)

    @property
    def available(self) -> int:
        """Blocks ``allocate`` can hand out without growing: the free ones (settling ones included) and
        the idle published ones it would evict (a fixed pool's)."""
        return len(self.free_ids) + len(self.settling) + (len(self.prefix.idle) if self.fixed else 0)

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free block ids, each now held once. Short of free blocks, a ``fixed`` pool
        evicts idle published blocks (least recently used first), and past them refuses
        (CapacityExceeded: the memory manager had not made room); any other grows."""
        self._copy_pending()  # blocks a finished host copy held back are free again
        if num_blocks > len(self.free_ids) + len(self.settling) and self.fixed:
            if num_blocks > self.available:
                raise CapacityExceeded(f"the KV block pool is full ({self.num_blocks - 1} blocks of {self.block_tokens} "
                                       f"tokens, {num_blocks} more asked for); retry shortly", retry_after_s=1)
            self._free_evicted(num_blocks - len(self.free_ids) - len(self.settling))
        if num_blocks > len(self.free_ids) and self.settling:
            self._settle()  # the host waits for the copy still reading them
        if num_blocks > len(self.free_ids):
            self.reserve(max(2 * self.num_blocks, self.num_blocks + num_blocks - len(self.free_ids)))
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
            self._free_evicted(len(self.prefix.idle) - cap)

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
        writes into it: ``PagedKVCache.crop`` copies it first."""
        return self.refs[block] > 1 or block in self.prefix.key_of

    def copy_block(self, src: int, dst: int) -> None:
        for pool in (self.k, self.v):
            pool.select(self.block_dim, dst).copy_(pool.select(self.block_dim, src))

    def evict_idle_bytes(self, num_bytes: int) -> int:
        """Evict idle blocks, least recently used first, until ``num_bytes`` are freed or none is left
        idle; the bytes freed."""
        return len(self._free_evicted(blocks_for(num_bytes, self.block_nbytes))) * self.block_nbytes

    def _free_evicted(self, num_blocks: int) -> list[int]:
        evicted = self.prefix.evict(num_blocks)
        self._give_back(evicted)
        return evicted

    def _give_back(self, blocks: list[int]) -> None:
        """Blocks no cache holds: free, or, while a host copy on the side stream may still read them,
        settling (a block written before the copy read it would reach the host with the new keys)."""
        if self._copy_pending():
            self.settling.extend(blocks)
        else:
            self.free_ids.extend(sorted(blocks, reverse=True))

    def _copy_pending(self) -> bool:
        """Is the latest host copy still running? When it is seen done, the settling blocks are free."""
        if self.copying is not None and self.copying.query():
            self.copying = None
            self.free_ids.extend(sorted(self.settling, reverse=True))
            self.settling = []
        return self.copying is not None

    def _settle(self) -> None:
        """Wait (on the host) for the latest host copy, then free what it held back."""
        if self.copying is not None:
            self.copying.synchronize()
        self.copying = None
        self.free_ids.extend(sorted(self.settling, reverse=True))
        self.settling = []

    def check(self, tables: list[list[int]]) -> list[str]:
        """Violations of the pool's invariant, given every block table that holds its blocks: each
        block's ref count equals its holders; a free block is neither held nor published; an idle
        block is published and held by none; no held block is free."""
        holders = [0] * self.num_blocks
        for table in tables:
            for block in table:
                holders[block] += 1
        problems = [f"block {b}: {self.refs[b]} refs, {holders[b]} holders" for b in range(self.num_blocks)
                    if self.refs[b] != holders[b]]
        free = set(self.free_ids) | set(self.settling)
        if len(free) != len(self.free_ids) + len(self.settling) or PAD_BLOCK in free:
            problems.append("the free list repeats a block or holds the padding block")
        problems += [f"block {b}: free but held or published" for b in free
                     if holders[b] or b in self.prefix.key_of]
        problems += [f"block {b}: idle but held or unpublished" for b in self.prefix.idle
                     if holders[b] or b not in self.prefix.key_of]
        unaccounted = self.num_blocks - 1 - len(free) - len(self.prefix.idle) - sum(1 for h in holders if h)
        if unaccounted or self.num_held != sum(1 for h in holders if h):
            problems.append(f"{unaccounted} blocks neither free, idle nor held; num_held {self.num_held}")
        if self.num_shared != sum(1 for h in holders if h > 1):
            problems.append(f"num_shared {self.num_shared}, but {sum(1 for h in holders if h > 1)} blocks are shared")
        return problems

    def usage(self) -> dict[str, int]:
        """Blocks by kind: "pinned" (held by one cache), "shared" (by several), "cached" (idle)."""
        return {"pinned": self.num_held - self.num_shared, "shared": self.num_shared, "cached": len(self.prefix.idle)}

    def reserve(self, num_blocks: int) -> None:
        """Grow to at least ``num_blocks`` blocks (the padding block included); a no-op when it holds that many."""
        old = self.num_blocks
        if num_blocks <= old:
            return
        self._settle()  # the old tensors are freed below: no host copy may still be reading them
        if self.num_grows or old > 1:
            logger.info("KV block pool grows from %d to %d blocks of %d tokens (copies the pool)", old,
                        num_blocks, self.block_tokens)
        k, v = self._empty(num_blocks), self._empty(num_blocks)
        k.narrow(self.block_dim, 0, old).copy_(self.k)
        v.narrow(self.block_dim, 0, old).copy_(self.v)
        self.k, self.v = k, v
        self.free_ids[:0] = range(num_blocks - 1, old - 1, -1)  # new ids go after (taken after) the old free ones
        self.refs += [0] * (num_blocks - old)
        self.num_grows += 1

    def slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Flat slot numbers (block * block_tokens + offset) of positions start .. end-1 of a block table."""
        size = self.block_tokens
        return [block_ids[p // size] * size + p % size for p in range(start, end)]

    # ---- the layout, in one place: views and copies by slot, block and layer

    def _flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """k or v (or one layer of it) with its blocks and tokens merged into slots: head-major
        [..., KVH, slots, hd], token-major [..., slots, KVH, hd] (views)."""
        lead = tensor.shape[:-4]
        if self.head_major:
            return tensor.view(*lead, self.num_kv_heads, -1, self.head_dim)
        return tensor.view(*lead, -1, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [KVH, T, hd] into ``slots`` [T] of ``layer``."""
        for pool, new in ((self.k, k), (self.v, v)):
            if self.head_major:
                self._flat(pool[layer]).index_copy_(1, slots, new)
            else:
                self._flat(pool[layer]).index_copy_(0, slots, new.transpose(0, 1))

    def write_rows(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, KVH, T, hd] into ``slots`` [B, T] of ``layer`` (no host sync: CUDA graphs capture it)."""
        for pool, new in ((self.k, k), (self.v, v)):
            if self.head_major:
                self._flat(pool[layer])[:, slots] = new.transpose(0, 1)  # [KVH, B, T, hd]
            else:  # index_put_, not item assignment: that views away leading 1s
                self._flat(pool[layer]).index_put_((slots,), new.transpose(1, 2))

    def run(self, layer: int, first_block: int, num_blocks: int, lo: int, hi: int):
        """Keys and values of tokens lo .. hi-1 of ``num_blocks`` consecutive blocks from ``first_block``:
        [KVH, hi - lo, hd] views of the pool (no copy)."""
        return tuple(t[layer] for t in self.run_all_layers(first_block, num_blocks, lo, hi))

    def run_all_layers(self, first_block: int, num_blocks: int, lo: int, hi: int):
        """``run`` for every layer at once: [num_layers, KVH, hi - lo, hd] views (a decode step builds
        them once per row, then takes one layer's with an index)."""
        return tuple(self._run_of(pool, first_block, num_blocks, lo, hi) for pool in (self.k, self.v))

    def _run_of(self, pool: torch.Tensor, first_block: int, num_blocks: int, lo: int, hi: int) -> torch.Tensor:
        flat = self._flat(pool.narrow(self.block_dim, first_block, num_blocks))
        return flat[:, :, lo:hi] if self.head_major else flat[:, lo:hi].transpose(1, 2)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks ``block_ids`` [B, NB] (a copy): [B, KVH, NB * block_tokens, hd] each."""
        return tuple(self._gather_of(pool[layer], block_ids) for pool in (self.k, self.v))

    def _gather_of(self, blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        num_rows = block_ids.shape[0]
        if self.head_major:  # [KVH, B, NB, bt, hd] -> [B, KVH, S, hd] (a view of the gathered copy)
            return blocks[:, block_ids].view(self.num_kv_heads, num_rows, -1, self.head_dim).transpose(0, 1)
        return blocks[block_ids].view(num_rows, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def read(self, layer: int, block_ids: list[int], end: int, values: bool = False) -> torch.Tensor:
        """The keys (or ``values``) of positions 0 .. end-1 of a block table, [KVH, end, hd]: a view
        when the blocks are consecutive, else a gather."""
        pool = self.v if values else self.k
        used = block_ids[: blocks_for(end, self.block_tokens)]
        first = used[0] if used else 0
        if used == list(range(first, first + len(used))):
            return self._run_of(pool, first, len(used), 0, end)[layer]
        return self._gather_of(pool[layer], torch.tensor([used], device=self.device))[0, :, :end]

    def host_copy(self, block_ids: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact host copies of positions 0 .. length-1: K, V [num_layers, KVH, length, hd]. Each run of
        consecutive blocks is copied straight from the pool into its place (no staging copy of the whole
        session on the device); from a GPU into pinned memory without blocking, on the pool's side
        stream (after what the current stream has queued: the keys are written), so the copy overlaps
        the next steps. Blocks freed before its event is seen complete settle first (``_give_back``),
        and a restore's copy back waits for it on the device (``store``)."""
        cuda = self.device.type == "cuda"
        side = contextlib.nullcontext()
        if cuda:
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(self.device)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            side = torch.cuda.stream(self.copy_stream)
        shape = (self.num_layers, self.num_kv_heads, length, self.head_dim)
        out = tuple(torch.empty(shape, dtype=self.dtype, pin_memory=cuda) for _ in range(2))
        size, used = self.block_tokens, block_ids[: blocks_for(length, self.block_tokens)]
        with side:
            self._copy_runs(out, used, size, length, cuda)
        if cuda:
            self.copying = torch.cuda.Event()
            self.copying.record(self.copy_stream)
        return out

    def _copy_runs(self, out: tuple[torch.Tensor, torch.Tensor], used: list[int], size: int, length: int,
                   cuda: bool) -> None:
        start = 0
        while start < len(used):
            end = start + 1
            while end < len(used) and used[end] == used[end - 1] + 1:
                end += 1
            first, last = start * size, min(end * size, length)  # positions of this run
            slot = used[start] * size
            for pool, host in zip((self.k, self.v), out):
                flat = self._flat(pool)
                run = flat[:, :, slot:slot + last - first] if self.head_major else \
                    flat[:, slot:slot + last - first].transpose(1, 2)
                host[:, :, first:last].copy_(run, non_blocking=cuda)
            start = end

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``host_copy``'s K, V [num_layers, KVH, T, hd] into ``slots`` [T] of every layer. From pinned
        memory (a GPU's host tier) the copy to the device does not block the host: it and the store
        after it are queued on the current stream, in that order; torch's pinned-memory allocator keeps
        the host copy until the device has read it, whatever the session does with it next. A slice
        past a shared prefix is not contiguous: it is first copied into pinned memory on the host (a
        pageable staging copy would make the transfer wait)."""
        pinned = self.device.type == "cuda" and k.is_pinned()
        if self.copying is not None:  # the host copy these may come from is written on the side stream
            torch.cuda.current_stream(self.device).wait_event(self.copying)
        for pool, saved in ((self.k, k), (self.v, v)):
            if pinned and not saved.is_contiguous():  # a slice past a shared prefix: staged in pinned memory
                self._settle()  # read on the host: the side stream's copy into it must be done, not queued
                saved = torch.empty(saved.shape, dtype=saved.dtype, pin_memory=True).copy_(saved)
            on_device = saved.to(self.device, non_blocking=pinned)
            if self.head_major:
                self._flat(pool)[:, :, slots] = on_device
            else:
                self._flat(pool)[:, slots] = on_device.transpose(1, 2)


class PoolAccounts:
    """The bytes of several pools (a target's and its draft's) for the memory manager
    (session/state/memory.py): held (by any cache, a shared block once), idle, and by kind."""

    def __init__(self, pools: list[BlockPool]):
        self.pools = pools

    def held_bytes(self) -> int:
        return sum(p.num_held * p.block_nbytes for p in self.pools)

    def idle_bytes(self) -> int:
        return sum(len(p.prefix.idle) * p.block_nbytes for p in self.pools)

    def fits(self, needs: list[tuple[BlockPool, int]]) -> bool:
        """Can each fixed pool hand out the blocks asked of it (``needs``: pool, blocks) without growing?"""
        return all(not pool.fixed or pool.available >= blocks for pool, blocks in needs)

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
            for kind, blocks in pool.usage().items():
                out[kind] += blocks * pool.block_nbytes
        return out

    def counters(self) -> dict[str, int]:
        return {"hit_blocks": sum(p.prefix.num_hit_blocks for p in self.pools),
                "evicted_blocks": sum(p.prefix.num_evicted for p in self.pools),
                "published_blocks": sum(len(p.prefix) for p in self.pools)}


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device``; to a GPU from pinned host memory, without waiting for the copy."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class PagedKVCache:
    """One session's keys and values: its block table into a ``BlockPool``. Who calls this: the
    engine loop thread (model runner, sessions, memory manager), never two threads at once."""

    def __init__(self, pool: BlockPool, *, max_tokens: int):
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
        return self.pool.slots(self.block_ids, start, end)

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
        token, end token within the run) each, for ``BlockPool.run`` / ``run_all_layers``."""
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
        self.block_ids = self.pool.lookup(keys)
        self.length = len(self.block_ids) * self.block_tokens
        return self.length

    def publish(self, keys: list[bytes]) -> int:
        """Publish this cache's full, written blocks under ``keys`` (one per block from the first) so
        that other caches' ``share_prefix`` finds them; how many were newly published."""
        full = min(len(keys), self.length // self.block_tokens)
        return self.pool.publish(self.block_ids[:full], keys[:full])

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on. Private blocks stay held; from the first block past the
        kept full ones that is shared (published or held elsewhere) on, blocks are given back, and a
        shared block that ``length`` cuts into is first copied to a private one (copy-on-write), so
        that writing there never changes what another cache reads; a full fixed pool has no block to
        copy into, and the cache then ends before that block (its owner recomputes the rest)."""
        self.length = min(self.length, length)
        size, keep = self.block_tokens, self.length // self.block_tokens
        cut = next((i for i in range(keep, len(self.block_ids)) if self.pool.is_shared(self.block_ids[i])), None)
        if cut is None:
            return
        tail = self.block_ids[cut:]
        self.block_ids = self.block_ids[:cut]
        if not (cut == keep and self.length % size):
            self.pool.free(tail)
            return
        self.pool.free(tail[1:])  # first: a private block given back is one to copy into
        if self.pool.fixed and not self.pool.available:
            self.length = keep * size  # a full fixed pool: the partly kept block's positions are given up too
        else:  # the partly kept block: its kept positions, copied
            [copy] = self.pool.allocate(1)
            self.pool.copy_block(tail[0], copy)
            self.block_ids.append(copy)
        self.pool.free(tail[:1])

    def release(self) -> None:
        """Give every block back to the pool; a later ``ensure_capacity`` takes blocks again."""
        self.pool.free(self.block_ids)
        self.block_ids = []
        self.length = 0

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact host copies of what is stored: K, V [num_layers, num_kv_heads, length, head_dim]."""
        return self.pool.host_copy(self.block_ids, self.length)

    def load(self, k: torch.Tensor, v: torch.Tensor, keys: list[bytes] = ()) -> int:
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

    def load(self, k: torch.Tensor, v: torch.Tensor, keys: list[bytes] = ()) -> int:
        """A whole buffer per session shares nothing: all of it is copied (0 tokens shared)."""
        length = k.shape[2]
        self.ensure_capacity(length)
        self.k[:, :, :length].copy_(k)
        self.v[:, :, :length].copy_(v)
        self.length = length
        return 0


KVCache = PagedKVCache | StaticKVCache
