"""Batched attention over the paged KV pool: one call per layer for every row of a step.

A step feeds T new tokens to each of B rows (decode: T = 1; a multi-token verify: T > 1). Each
row's keys live in blocks of the model's ``BlockPool`` (session/model/kv_cache.py), listed in its block
table. Per layer, the step writes the new keys and values into their pool slots (one
``index_copy_`` for the batch) and runs one attention call for the batch:
- ``flash_attn``: FlashAttention's ``flash_attn_with_kvcache`` reads the pool through the block
  table with per-row lengths (``cache_seqlens``) and a sliding window where the layer has one.
  Used on CUDA when the package imports, the dtype is half or bfloat16 and blocks are a multiple
  of 256 tokens (FlashAttention-2's paged-KV requirement);
- ``sdpa``: everywhere else, PyTorch SDPA over the rows' blocks gathered into ``[B, KVH, NB*P, hd]``
  under a mask of per-row lengths, causality and windows.
Nothing here depends on B or T for the number of operators it dispatches (tests/unit/model/test_op_count.py).

Who calls this: ``ModelRunner`` on the engine loop thread, and its CUDA graphs (session/model/cuda_graphs.py),
which replay ``forward_paged`` with fixed-shape ``PagedBatch`` buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from session.model.kv_cache import PAD_BLOCK, BlockPool, PagedKVCache

FLASH_BLOCK_MULTIPLE = 256  # flash_attn_with_kvcache refuses paged blocks of other sizes


@dataclass
class PagedBatch:
    """Where one step's new tokens go and what each row attends to (device tensors)."""
    block_table: torch.Tensor  # [B, NB] int32: each row's blocks, padded with PAD_BLOCK
    slots: torch.Tensor  # [B, T] int64: pool slot of each new token
    seq_lens: torch.Tensor  # [B] int32: keys each row holds once the new ones are written
    positions: torch.Tensor  # [B, T] int64: the new tokens' positions (rotary embeddings)


def plan_rows(kvs: list[PagedKVCache], num_new: int, num_blocks: int | None = None) -> list[list[int]]:
    """Host-side plan of a step, one row per cache: [seq_len, *slots(T), *block_table(NB)].
    ``num_blocks`` pads every block table to that width (CUDA graph buckets); default: the widest row."""
    width = num_blocks or max(-(-(kv.length + num_new) // kv.block_tokens) for kv in kvs)
    rows = []
    for kv in kvs:
        start, end = kv.length, kv.length + num_new
        table = kv.block_ids[:width]
        rows.append([end, *kv.slots(start, end), *table, *[PAD_BLOCK] * (width - len(table))])
    return rows


def pad_row(num_new: int, num_blocks: int, block_tokens: int) -> list[int]:
    """A plan row that pads a batch: it writes into the padding block and attends to its first keys."""
    return [num_new, *[PAD_BLOCK * block_tokens] * num_new, *[PAD_BLOCK] * num_blocks]


def columns(plan: torch.Tensor, start: int, stop: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """plan[:, start:stop] as a contiguous tensor of ``dtype``, always through one copy: a column slice
    is contiguous only when B is 1, and operators downstream would otherwise differ with B."""
    return plan[:, start:stop].to(dtype, memory_format=torch.contiguous_format, copy=True)


def to_batch(plan: torch.Tensor, num_new: int) -> PagedBatch:
    """plan: [B, 1 + T + NB] int64 on the device (``plan_rows``) -> a PagedBatch."""
    seq_lens = columns(plan, 0, 1)
    return PagedBatch(
        seq_lens=columns(plan, 0, 1, torch.int32)[:, 0], slots=columns(plan, 1, 1 + num_new),
        positions=seq_lens - num_new + torch.arange(num_new, device=plan.device),
        block_table=columns(plan, 1 + num_new, plan.shape[1], torch.int32),
    )


def choose_backend(pool: BlockPool) -> str:
    """flash_attn where it applies (see the module docstring), else sdpa."""
    if (pool.device.type != "cuda" or pool.head_major or pool.dtype not in (torch.float16, torch.bfloat16)
            or pool.block_tokens % FLASH_BLOCK_MULTIPLE):
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attn"


class PagedAttention:
    """One step's attention for every layer: built once per step (the SDPA masks are shared by the
    layers with the same window), called once per layer."""

    def __init__(self, pool: BlockPool, batch: PagedBatch, windows: list[int | None], backend: str):
        self.pool = pool
        self.batch = batch
        self.backend = backend
        if backend == "flash_attn":
            from flash_attn import flash_attn_with_kvcache

            self.flash = flash_attn_with_kvcache
        else:
            self.masks = {w: self._mask(w) for w in set(windows)}

    def _mask(self, window: int | None) -> torch.Tensor:
        # query t of row b sits at position seq_lens[b] - T + t and sees keys up to it (in a window
        # of W: only the last W, its own included); keys past seq_lens are padding or stale.
        batch = self.batch
        num_keys = batch.block_table.shape[1] * self.pool.block_tokens
        keys = torch.arange(num_keys, device=batch.positions.device)  # [S]
        queries = batch.positions[:, :, None]  # [B, T, 1]
        mask = keys <= queries
        if window is not None:
            mask = mask & (keys > queries - window)
        return mask[:, None]  # [B, 1, T, S]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None,
                 scale: float) -> torch.Tensor:
        """q: [B, H, T, hd]; k, v: [B, KVH, T, hd] (the new tokens) -> attention output [B, H, T, hd]."""
        pool, batch = self.pool, self.batch
        pool.write_rows(layer, batch.slots, k, v)
        if self.backend == "flash_attn":  # token-major pools only (CUDA: see choose_backend)
            out = self.flash(q.transpose(1, 2), pool.k[layer], pool.v[layer], cache_seqlens=batch.seq_lens,
                             block_table=batch.block_table, softmax_scale=scale, causal=True,
                             window_size=(-1, -1) if window is None else (window - 1, 0))  # [B, T, H, hd]
            return out.transpose(1, 2)
        keys, values = pool.gather(layer, batch.block_table)  # [B, KVH, S, hd]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.masks[window], scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])
