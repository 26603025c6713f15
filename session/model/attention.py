"""Batched attention over the paged KV pool: one call per layer for every row of a step.

A step feeds T new tokens to each of B rows (decode: T = 1; a multi-token verify: T > 1). Each
row's keys live in blocks of the model's ``KVPool`` (session/model/kv_cache.py), listed in its block
table. Per layer, the step writes the new keys and values into their pool slots (one indexed store
for the batch; FlashAttention's kernel does it itself) and runs one attention call for the batch:
- ``flash_attn``: FlashAttention's ``flash_attn_with_kvcache`` writes the new keys and values into
  the pool and reads it, through the block table, in one kernel (``k=``, ``v=`` appended at each
  row's ``cache_seqlens``), with a sliding window where the layer has one;
- ``varlen``: the same FlashAttention-2 paged kernel as torch ships it (``torch.nn.attention.varlen.
  varlen_attn`` with ``block_table`` and ``seqused_k``), so no extra package: the new tokens of
  all rows as one packed batch of queries (``cu_seq_q``), each row's keys read in place through
  its block table, grouped-query heads without repeating them (``enable_gqa``), causal from the
  bottom right (query t of T sits at position seq_len - T + t), windows as ``(W - 1, 0)``;
- ``sdpa``: everywhere else, PyTorch SDPA over the rows' blocks gathered into ``[B, KVH, NB*P, hd]``
  under a mask of per-row lengths, causality and windows.
Both FlashAttention kernels apply on CUDA with compute capability 8.0 or newer, half or bfloat16,
a token-major pool with blocks a multiple of 256 tokens (FlashAttention-2's paged-KV requirement)
and a head size that is a multiple of 8 up to 256 (``paged_flash_refusal`` says which is missing).
The package is taken when it imports, else torch's. The prefill of one session on such a pool runs
through the same kernel (``ModelRunner.prefill``), so a follow-up's prefill gathers nothing either.
Nothing here depends on B or T for the number of operators it dispatches (tests/unit/model/test_op_count.py).

Who calls this: ``ModelRunner`` on the engine loop thread, and its CUDA graphs (session/model/cuda_graphs.py),
which replay ``forward_paged`` with fixed-shape ``PagedBatch`` buffers.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from session.model.blocks import blocks_for
from session.model.kv_cache import PAD_BLOCK, KVPool, PagedKVCache, to_device

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
    width = num_blocks or max(blocks_for(kv.length + num_new, kv.block_tokens) for kv in kvs)
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


PAGED_FLASH_CAPABILITY = (8, 0)  # FlashAttention-2: Ampere or newer
KERNELS = {
    "flash_attn": "FlashAttention's paged kernel (flash_attn_with_kvcache)",
    "varlen": "torch's paged FlashAttention-2 (torch.nn.attention.varlen.varlen_attn with block_table)",
    "sdpa": "SDPA over gathered blocks",
}


def paged_flash_refusal(pool: KVPool) -> str | None:
    """Why neither FlashAttention kernel reads ``pool`` (None: they can); see the module docstring."""
    if pool.device.type != "cuda":
        return f"the pool is on {pool.device.type}"
    if pool.head_major:
        return "the pool is head-major"
    if pool.dtype not in (torch.float16, torch.bfloat16):
        return f"the KV dtype is {pool.dtype} (FlashAttention takes float16 and bfloat16)"
    if pool.block_tokens % FLASH_BLOCK_MULTIPLE:
        return f"KV blocks of {pool.block_tokens} tokens (paged FlashAttention-2 needs a multiple of {FLASH_BLOCK_MULTIPLE})"
    if pool.head_dim % 8 or pool.head_dim > 256:
        return f"head size {pool.head_dim} (FlashAttention takes multiples of 8 up to 256)"
    capability = torch.cuda.get_device_capability(pool.device)
    if capability < PAGED_FLASH_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} (FlashAttention-2 needs 8.0)"
    return None


@functools.cache
def torch_paged_varlen():
    """torch's ``varlen_attn`` where it takes a block table (torch 2.10 and later), else None (once)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return varlen_attn if "block_table" in parameters and "seqused_k" in parameters else None


@functools.cache
def flash_paged_varlen() -> bool:
    """Does the installed flash-attn's ``flash_attn_varlen_func`` take a block table (later 2.x releases;
    asked once)? A packed step reads the pool through it (``RaggedAttention``)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return False
    return "block_table" in inspect.signature(flash_attn_varlen_func).parameters


@functools.cache
def flash_attn_installed() -> bool:
    """Does the flash-attn package import (asked once: a failed import searches sys.path each time)?"""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(pool: KVPool) -> str:
    """flash_attn, else varlen, where FlashAttention reads the pool; else sdpa (module docstring). Asked
    once a pool: the answer is kept on it (``attention_backend``), so every pass reads the choice the
    start-up line logged."""
    chosen = getattr(pool, "attention_backend", None)
    if chosen is None:
        if paged_flash_refusal(pool) is not None:
            chosen = "sdpa"
        elif flash_attn_installed():
            chosen = "flash_attn"
        else:
            chosen = "varlen" if torch_paged_varlen() is not None else "sdpa"
        pool.attention_backend = chosen
    return chosen


def describe_backend(pool: KVPool, decode_path: str) -> str:
    """The start-up log line's words for the kernel that reads ``pool`` (``decode_path``: the runner's
    decode path's name), and why where it is SDPA over gathered blocks."""
    if pool.device.type == "cpu" and decode_path != "batched":  # ModelRunner.prefill, decode_paths.py
        return "each row's runs of blocks in place (torch's CPU flash kernel, or ours in bfloat16)"
    backend = choose_backend(pool)
    if backend != "sdpa":
        return KERNELS[backend]
    why = paged_flash_refusal(pool) or "neither flash_attn nor a torch with paged varlen_attn is installed"
    return f"{KERNELS['sdpa']} ({why})"


class PagedAttention:
    """One step's attention for every layer: built once per step (the SDPA masks are shared by the
    layers with the same window), called once per layer."""

    def __init__(self, pool: KVPool, batch: PagedBatch, windows: list[int | None], backend: str):
        self.pool = pool
        self.batch = batch
        self.backend = backend
        self.windows = windows
        if backend == "flash_attn":
            from flash_attn import flash_attn_with_kvcache

            self.flash = flash_attn_with_kvcache
            self.cached = batch.seq_lens - batch.slots.shape[1]  # [B] int32: keys before the new ones
        elif backend == "varlen":
            # every row feeds T queries; keys: each row's seq_len of them, through its block table
            rows, num_new = batch.slots.shape
            self.varlen = torch_paged_varlen()
            self.cu_q = torch.arange(0, (rows + 1) * num_new, num_new, dtype=torch.int32, device=batch.slots.device)
            first = torch.zeros(1, dtype=torch.int32, device=batch.seq_lens.device)
            self.cu_k = torch.cat([first, torch.cumsum(batch.seq_lens, 0, dtype=torch.int32)])
            self.max_k = batch.block_table.shape[1] * pool.block_tokens  # a bound known on the host
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

    @staticmethod
    def _varlen_window(window: int | None, num_new: int) -> tuple[int, int]:
        """varlen_attn's window_size: causal (-1, 0), or (W - 1, 0) in a sliding window; one query a row
        sees every key it is given, so (-1, -1), which keeps ATen's grouped-query decode layout (it
        swaps a row's query heads into the sequence dimension only without a window or causality)."""
        if window is not None:
            return (window - 1, 0)
        return (-1, -1) if num_new == 1 else (-1, 0)

    def __call__(self, index: int, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer ``index`` (a ``LayerAttention``, session/model/layer_attention.py): q [B, H, T, hd]; k, v
        [B, KVH, T, hd] (the new tokens) -> attention output [B, H, T, hd]."""
        pool, batch = self.pool, self.batch
        window, scale = self.windows[index], layer.self_attn.scaling
        if self.backend == "flash_attn":  # token-major pools only (CUDA: see choose_backend)
            # the kernel writes the new keys and values at cache_seqlens.. through the block table itself
            # (one kernel for the write and the attention), then attends over cache_seqlens + T keys
            out = self.flash(q.transpose(1, 2), pool.k[index], pool.v[index], k=k.transpose(1, 2),
                             v=v.transpose(1, 2), cache_seqlens=self.cached, block_table=batch.block_table,
                             softmax_scale=scale, causal=True,
                             window_size=(-1, -1) if window is None else (window - 1, 0))  # [B, T, H, hd]
            return out.transpose(1, 2)
        pool.write_rows(index, batch.slots, k, v)
        if self.backend == "varlen":
            rows, heads, num_new, head_dim = q.shape
            out = self.varlen(q.transpose(1, 2).reshape(rows * num_new, heads, head_dim), pool.k[index], pool.v[index],
                              self.cu_q, self.cu_k, num_new, self.max_k, scale=scale,
                              window_size=self._varlen_window(window, num_new),
                              enable_gqa=heads != pool.num_kv_heads, seqused_k=batch.seq_lens,
                              block_table=batch.block_table)  # [B*T, H, hd]
            return out.view(rows, num_new, heads, head_dim).transpose(1, 2)
        keys, values = pool.gather(index, batch.block_table)  # [B, KVH, S, hd]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.masks[window], scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])


class RaggedAttention:
    """A packed step's attention (session/model/packed_step.py) in one paged FlashAttention call per layer:
    the step's N tokens as parts of ragged length (a decode row: one query; a chunk: its tokens; a verify:
    a row per position), part p's queries the last ``counts[p]`` of its ``kv_lens[p]`` keys (causal from
    the bottom right), read in place through its own row of the block table. torch's ``varlen_attn`` or
    flash-attn's ``flash_attn_varlen_func``, as ``choose_backend`` picks for the pool; one plan copy to
    the device per step, none per layer."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, tables: list[list[int]], kv_lens: list[int],
                 counts: list[int], windows: list[int | None], backend: str):
        """``slots`` [N, 1]: where the N new keys go (on the pool's device); ``tables[p]``: part p's block
        ids (several parts may share a sequence's); ``backend``: "varlen" or "flash_attn"."""
        if backend not in ("varlen", "flash_attn"):
            raise ValueError(f"RaggedAttention runs a paged FlashAttention kernel, not {backend!r}")
        self.pool, self.slots, self.windows, self.backend = pool, slots, windows, backend
        parts, width = len(tables), max(len(table) for table in tables)
        ends = lambda sizes: [0, *itertools.accumulate(sizes)]  # noqa: E731
        padded = [block for table in tables for block in (*table, *[PAD_BLOCK] * (width - len(table)))]
        plan = to_device([*ends(counts), *ends(kv_lens), *padded], pool.device, torch.int32)  # one copy
        self.cu_q, self.cu_k = plan[:parts + 1], plan[parts + 1:2 * parts + 2]  # [P + 1] each
        self.seq_lens = self.cu_k.diff()  # [P]: keys each part sees
        self.block_table = plan[2 * parts + 2:].view(parts, width)  # [P, widest]
        self.max_q, self.max_k = max(counts), max(kv_lens)
        if backend == "varlen":
            self.kernel = torch_paged_varlen()
        else:
            from flash_attn import flash_attn_varlen_func

            self.kernel = flash_attn_varlen_func

    def __call__(self, index: int, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, 1, hd]; k, v [N, KVH, 1, hd] (one token a row) -> [N, H, 1, hd]."""
        pool, window, scale = self.pool, self.windows[index], layer.self_attn.scaling
        pool.write_rows(index, self.slots, k, v)
        size = (-1, 0) if window is None else (window - 1, 0)
        queries = q[:, :, 0]  # [N, H, hd]
        if self.backend == "varlen":
            out = self.kernel(queries, pool.k[index], pool.v[index], self.cu_q, self.cu_k, self.max_q, self.max_k,
                              scale=scale, window_size=size, enable_gqa=q.shape[1] != pool.num_kv_heads,
                              seqused_k=self.seq_lens, block_table=self.block_table)
        else:
            out = self.kernel(queries, pool.k[index], pool.v[index], self.cu_q, self.cu_k, self.max_q, self.max_k,
                              softmax_scale=scale, causal=True, window_size=size, block_table=self.block_table)
        return out[:, :, None]


MASKED = -1e30  # attend_runs' additive mask value (finite: see there)


def attend_runs(q: torch.Tensor, runs: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                gqa: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Queries q [1, H, T, hd] over keys and values given as runs of [KVH, n, hd] views (CPU);
    ``mask`` [T, L] (True: may attend; None: every key) over the runs' L keys in order.

    One run is one SDPA call, as over a contiguous cache. Several (a session whose blocks are not all
    consecutive in the pool) are attended one by one and merged by their log-sum-exp, which is exact
    up to float rounding, instead of gathering the session's whole cache (that copy made 16 sessions
    decode 2x slower than transformers' generate, and cost every follow-up's prefill and speculative
    verify a copy of the whole context). Callers gather sliding-window layers instead."""
    if len(runs) == 1:
        k, v = runs[0]
        return F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa)
    heads, num_queries, hd = q.shape[1], q.shape[2], q.shape[3]
    kv_heads = runs[0][0].shape[0]
    group = heads // kv_heads
    # a KV head's query heads, each with its T queries, as that head's G*T queries (no repeat_kv copy)
    grouped = q.reshape(1, kv_heads, group * num_queries, hd)
    bias = None
    if mask is not None:  # rows g*T + t take query t's mask; the CPU kernel takes an additive float mask
        # finite, not -inf: a causal query sees no key of a run that starts after it, and a row masked
        # whole would come out NaN; with -1e30 it comes out finite with a log-sum-exp near -1e30, so
        # the merge gives it weight 0 (exp underflows), as -inf does to masked keys within a run
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, MASKED)
        bias = bias.repeat(group, 1)
    outs, lses, first = [], [], 0
    for k, v in runs:
        n = k.shape[1]
        run_bias = None if bias is None else bias[:, first: first + n]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            grouped, k[None], v[None], attn_mask=run_bias, scale=scale)[:2]
        outs.append(out)
        lses.append(lse)
        first += n
    weights = torch.softmax(torch.stack(lses), dim=0)[..., None]  # [R, 1, KVH, G*T, 1]: each run's share
    merged = (torch.stack(outs) * weights).sum(0)  # [1, KVH, G*T, hd]
    return merged.reshape(1, heads, num_queries, hd).to(q.dtype)


def causal_masks(start: int, num_new: int, windows: list[int | None], device: torch.device,
                 all_keys: bool = False) -> dict[int | None, torch.Tensor | None]:
    """Per window size, the [num_new, start + num_new] mask (True: may attend) of new tokens after
    ``start`` cached ones: query i (position start+i) sees keys 0 .. start+i, and in a sliding-window
    layer of W only the last W of them (keys j > start+i-W). ``all_keys``: the full-attention mask is
    None instead (one query: every key is its past)."""
    causal = torch.ones(num_new, start + num_new, dtype=torch.bool, device=device).tril(diagonal=start)
    masks: dict[int | None, torch.Tensor | None] = {
        w: causal if w is None else causal.triu(diagonal=start - w + 1) for w in set(windows)}
    if all_keys and None in masks:
        masks[None] = None
    return masks
