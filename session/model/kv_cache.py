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
``ensure_capacity``, ``write``, ``keys``, ``values``, ``crop``, ``release``, and for the host tier
(session/state/memory.py) ``to_host`` / ``load``.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

PAD_BLOCK = 0  # the pool's padding block (see the module docstring)


class BlockPool:
    """Fixed-size KV blocks for every paged cache of one model (who calls this: ``ModelRunner``,
    which owns it, and the caches it hands out; the engine loop thread only).

    The pool is sized once where a device budget is known (``reserve``, from session/engine/assembly.py:
    on CUDA the budget is never unlimited, so there the pool never grows). Where nothing was
    reserved (CPU, no budget) it doubles when it runs out of free blocks: that copies the pool, at
    most log2(blocks) times in a worker's life, and never on a session's own growth.
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
        self.num_grows = 0  # pool copies so far (CUDA graphs captured over the old pool are stale after one)

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

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free block ids (growing the pool if it has too few)."""
        if num_blocks > len(self.free_ids):
            self.reserve(max(2 * self.num_blocks, self.num_blocks + num_blocks - len(self.free_ids)))
        taken = self.free_ids[len(self.free_ids) - num_blocks:][::-1]
        del self.free_ids[len(self.free_ids) - num_blocks:]
        return taken

    def free(self, block_ids: list[int]) -> None:
        self.free_ids.extend(sorted(block_ids, reverse=True))

    def reserve(self, num_blocks: int) -> None:
        """Grow to at least ``num_blocks`` blocks (the padding block included); a no-op when it holds that many."""
        old = self.num_blocks
        if num_blocks <= old:
            return
        if self.num_grows or old > 1:
            logger.info("KV block pool grows from %d to %d blocks of %d tokens (copies the pool)", old,
                        num_blocks, self.block_tokens)
        k, v = self._empty(num_blocks), self._empty(num_blocks)
        k.narrow(self.block_dim, 0, old).copy_(self.k)
        v.narrow(self.block_dim, 0, old).copy_(self.v)
        self.k, self.v = k, v
        self.free_ids[:0] = range(num_blocks - 1, old - 1, -1)  # new ids go after (taken after) the old free ones
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
        used = block_ids[: -(-end // self.block_tokens)]
        first = used[0] if used else 0
        if used == list(range(first, first + len(used))):
            return self._run_of(pool, first, len(used), 0, end)[layer]
        return self._gather_of(pool[layer], torch.tensor([used], device=self.device))[0, :, :end]

    def host_copy(self, block_ids: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact host copies of positions 0 .. length-1: K, V [num_layers, KVH, length, hd]."""
        used = torch.tensor(block_ids[: -(-length // self.block_tokens)], device=self.device)
        out = []
        for pool in (self.k, self.v):
            blocks = pool.index_select(self.block_dim, used)
            flat = self._flat(blocks)  # head-major [L, KVH, S, hd]; token-major [L, S, KVH, hd]
            flat = flat[:, :, :length] if self.head_major else flat[:, :length].transpose(1, 2)
            out.append(flat.contiguous().cpu())
        return tuple(out)

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``host_copy``'s K, V [num_layers, KVH, T, hd] into ``slots`` [T] of every layer."""
        for pool, saved in ((self.k, k), (self.v, v)):
            if self.head_major:
                self._flat(pool)[:, :, slots] = saved.to(self.device)
            else:
                self._flat(pool)[:, slots] = saved.transpose(1, 2).to(self.device)


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
        blocks = -(-num_tokens // self.block_tokens)
        return max(self.capacity, blocks * self.block_tokens)

    def ensure_capacity(self, num_tokens: int) -> None:
        """Called before a prefill or decode run with the largest length it may reach. Takes free
        blocks from the pool; what the session holds stays where it is."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"KV cache cannot hold {num_tokens} tokens (max {self.max_tokens})")
        missing = -(-num_tokens // self.block_tokens) - len(self.block_ids)
        if missing > 0:
            self.block_ids += self.pool.allocate(missing)

    def slots(self, start: int, end: int) -> list[int]:
        return self.pool.slots(self.block_ids, start, end)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_kv_heads, T, head_dim] for positions start .. start+T-1
        self.pool.write(layer, torch.tensor(self.slots(start, start + k.shape[1]), device=self.device), k, v)

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

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on (the blocks stay held)."""
        self.length = min(self.length, length)

    def release(self) -> None:
        """Give every block back to the pool; a later ``ensure_capacity`` takes blocks again."""
        self.pool.free(self.block_ids)
        self.block_ids = []
        self.length = 0

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact host copies of what is stored: K, V [num_layers, num_kv_heads, length, head_dim]."""
        return self.pool.host_copy(self.block_ids, self.length)

    def load(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``to_host``'s copies as this (empty) cache's first ``k.shape[2]`` positions."""
        length = k.shape[2]
        self.ensure_capacity(length)
        self.pool.store(torch.tensor(self.slots(0, length), device=self.device), k, v)
        self.length = length


class StaticKVCache:
    """One session's keys and values in a buffer of ``max_tokens`` positions, allocated whole; a
    step writes its new positions in place. Who calls this: the static-shape runner, the engine loop."""

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
        return torch.zeros(self.num_layers, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def token_nbytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (both buffers, whole capacity)."""
        return self.capacity * self.token_nbytes

    def capacity_for(self, num_tokens: int) -> int:
        return self.max_tokens

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

    def load(self, k: torch.Tensor, v: torch.Tensor) -> None:
        length = k.shape[2]
        self.ensure_capacity(length)
        self.k[:, :, :length].copy_(k)
        self.v[:, :, :length].copy_(v)
        self.length = length


KVCache = PagedKVCache | StaticKVCache
