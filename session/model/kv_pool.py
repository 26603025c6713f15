"""The tensors of a paged KV pool: keys and values of every block, their layout, writes, reads and
host copies. Which block is free, held, shared or idle is the bookkeeping's (``BlockPool``,
session/model/block_pool.py, no torch); this module owns the memory those ids index.

On accelerators the pool is token-major, ``[num_layers, num_blocks, block_tokens, num_kv_heads,
head_dim]`` for K and for V, the layout FlashAttention's ``flash_attn_with_kvcache(block_table=...)``
reads. On CPU it is head-major, ``[num_layers, num_kv_heads, num_blocks, block_tokens, head_dim]``: a
head's keys over a run of consecutive blocks are then one contiguous stream, and torch's CPU flash
kernel reads them faster than the token-major view, with the same bits (benchmarks/attention_paths.py
--layouts; docs/MEASUREMENTS.md, "KV layout on CPU"). Only this module knows the layout (and
session/model/attention.py's FlashAttention call, token-major pools only).

Growth: a pool sized from a device budget (``reserve`` from the memory plan, then ``blocks.fixed``)
never grows: short of room, ``allocate`` refuses (CapacityExceeded) — the scheduler asked the KV
manager first (session/state/kv_manager.py), so that is a bug's symptom, not a request's fate. Where
nothing was reserved (CPU, no budget) the pool doubles its blocks when it runs out of free ones. On CPU
the tensors are address space reserved up front for as many blocks as the machine's memory holds
(``capacity``; an anonymous mapping: the OS commits a page when it is first written and reads an
untouched one as zeros), so doubling is bookkeeping. A copy of SmolLM2's 128-block pool into 256 had stopped
every session for 0.7-0.8 s on a quiet 2-core VM and 6-8 s beside another job, most of it the fresh
pages' first touch (docs/MEASUREMENTS.md, "KV pool growth"). Past ``capacity``, or where the OS refuses the mapping
(strict overcommit), or on an accelerator, growing copies the pool into new tensors (``num_grows``).

Who calls this: ``ModelRunner``, which owns it, the caches it hands out (session/model/kv_cache.py) and
the attention paths; the engine loop thread only.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from typing import TYPE_CHECKING

import torch

from session.errors import CapacityExceeded
from session.model.block_pool import BlockPool
from session.model.blocks import blocks_for

if TYPE_CHECKING:
    from session.model.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)


def physical_memory() -> int:
    """The machine's memory in bytes (a container's limit aside: reserving address space commits none)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class KVPool:
    """K and V tensors for every block of one model's pool, and its ``blocks`` (the bookkeeping)."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_tokens: int, num_blocks: int = 1, head_major: bool | None = None,
                 memory_bytes: int | None = None):
        self.head_major = device.type == "cpu" if head_major is None else head_major  # see the module docstring
        self.block_dim = 2 if self.head_major else 1  # the blocks' dimension of k and v
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.block_tokens = block_tokens
        num_blocks = max(num_blocks, 1)
        # CPU: k and v together reserve the machine's memory (or ``memory_bytes``); untouched, it costs none
        most = (memory_bytes or physical_memory()) // self.block_nbytes if device.type == "cpu" else 0
        self.k, self.v = self._tensors(num_blocks, most)
        self.blocks = BlockPool(num_blocks, copies=self)
        self.num_grows = 0  # pool copies so far (CUDA graphs captured over the old pool are stale after one)
        self.attention_backend: str | None = None  # the kernel that reads it (attention.choose_backend, once)
        # CUDA: host copies run on a side stream (``host_copy``); blocks freed while the latest may still
        # read them settle in ``blocks`` until its event is seen complete (``pending``)
        self.copy_stream: torch.cuda.Stream | None = None
        self.copying: torch.cuda.Event | None = None  # the event after the latest host copy, until seen complete

    def _tensors(self, num_blocks: int, reserved: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """New k and v, zeroed: attention over a padded block table multiplies masked positions by 0, and
        0 * NaN from uninitialised memory would still be NaN. On CPU two anonymous mappings of
        max(num_blocks, reserved) blocks (zero pages, committed as they are written). Elsewhere, or where
        the OS refuses them (strict overcommit, a ulimit on address space: a smaller try could leave the
        rest of the process too little), ``torch.zeros`` of ``num_blocks``."""
        if self.device.type == "cpu":
            most = max(num_blocks, reserved)
            try:
                return self._mapped(self._shape(most)), self._mapped(self._shape(most))
            except OSError as refused:
                logger.info("KV pool: address space for %d blocks refused (%s); %d zeroed blocks instead", most,
                            refused, num_blocks)
        shape = self._shape(num_blocks)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.head_major:
            return self.num_layers, self.num_kv_heads, num_blocks, self.block_tokens, self.head_dim
        return self.num_layers, num_blocks, self.block_tokens, self.num_kv_heads, self.head_dim

    def _mapped(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A CPU tensor over an anonymous mapping of its size (the tensor keeps the mapping alive)."""
        nbytes = self.dtype.itemsize * torch.Size(shape).numel()
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=self.dtype).view(shape)

    @property
    def num_blocks(self) -> int:
        """Blocks the bookkeeping counts (the padding block included): the pool's size as sessions see it."""
        return self.blocks.num_blocks

    @property
    def capacity(self) -> int:
        """Blocks the tensors hold: ``num_blocks`` grows to this many without a copy."""
        return self.k.shape[self.block_dim]

    @property
    def token_nbytes(self) -> int:
        """Bytes one token's keys and values take in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.block_tokens * self.token_nbytes


    def new_cache(self, max_tokens: int) -> PagedKVCache:
        from session.model.kv_cache import PagedKVCache  # the cache module builds on this one

        return PagedKVCache(self, max_tokens=max_tokens)

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free block ids, each now held once (``BlockPool.take``), the pool grown first
        when it may grow and is short; a fixed pool short of room refuses (CapacityExceeded: whoever
        asked did not ask the KV manager first)."""
        if self.blocks.fixed and not self.blocks.can_take(num_blocks):
            raise CapacityExceeded(f"the KV block pool is full ({self.num_blocks - 1} blocks of {self.block_tokens} "
                                   f"tokens, {num_blocks} more asked for); retry shortly", retry_after_s=1)
        self.pending()
        short = self.blocks.shortfall(num_blocks)
        if short:
            self.reserve(max(2 * self.num_blocks, self.num_blocks + short))
        return self.blocks.take(num_blocks)

    def copy_block(self, src: int, dst: int) -> None:
        for pool in (self.k, self.v):
            pool.select(self.block_dim, dst).copy_(pool.select(self.block_dim, src))

    def evict_idle_bytes(self, num_bytes: int) -> int:
        """Evict idle blocks, least recently used first, until ``num_bytes`` are freed or none is left
        idle; the bytes freed."""
        return len(self.blocks.evict(blocks_for(num_bytes, self.block_nbytes))) * self.block_nbytes

    # ---- host copies still running (the bookkeeping's ``HostCopies``)

    def pending(self) -> bool:
        """Is the latest host copy still running? Seen done, the blocks it held back are free."""
        if self.copying is not None and self.copying.query():
            self.copying = None
            self.blocks.settle()
        return self.copying is not None

    def wait(self) -> None:
        """Wait (on the host) for the latest host copy."""
        if self.copying is not None:
            self.copying.synchronize()
        self.copying = None

    def _settle(self) -> None:
        self.wait()
        self.blocks.settle()

    def reserve(self, num_blocks: int) -> None:
        """Grow to at least ``num_blocks`` blocks (the padding block included); a no-op when it holds that
        many. Within ``capacity`` only the bookkeeping grows; past it the tensors are copied."""
        old = self.num_blocks
        if num_blocks <= old:
            return
        if num_blocks > self.capacity:
            self._settle()  # the old tensors are freed below: no host copy may still be reading them
            if self.num_grows or old > 1:
                logger.info("KV block pool grows from %d to %d blocks of %d tokens (copies the pool)", old,
                            num_blocks, self.block_tokens)
            k, v = self._tensors(num_blocks, 2 * self.capacity)
            k.narrow(self.block_dim, 0, old).copy_(self.k.narrow(self.block_dim, 0, old))
            v.narrow(self.block_dim, 0, old).copy_(self.v.narrow(self.block_dim, 0, old))
            self.k, self.v = k, v
            self.num_grows += 1
        self.blocks.grow(num_blocks)

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
        return self._gather_of(self.k[layer], block_ids), self._gather_of(self.v[layer], block_ids)

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
        side: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if cuda:
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(self.device)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            side = torch.cuda.stream(self.copy_stream)
        shape = (self.num_layers, self.num_kv_heads, length, self.head_dim)
        out = (torch.empty(shape, dtype=self.dtype, pin_memory=cuda),
               torch.empty(shape, dtype=self.dtype, pin_memory=cuda))
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
