"""One forward pass for a whole engine step: its decode rows and its prefill chunks packed together.

A step of the token-budget scheduler feeds some decode rows (one token each) and some prefill chunks
(many tokens each). Run apart, that is one pass per chunk and one for the rows, each reading every
weight; packed, the step's N tokens go through each layer's projections and MLP once, as [N, 1, D]
(one token per row, as a decode step's rows: per-row LoRA slots and rotary positions apply as they
do there), and only attention is per part:

- the decode rows (first): every row of a layer in one call of our CPU kernel over the head-major
  pool (``KernelRowsAttention``), as ``CpuKernelPath`` runs a decode step;
- each chunk: its queries over its session's blocks in place (``attend_runs``, causal) or, in a
  sliding-window layer, a gathered copy (``SpanAttention``), as ``ModelRunner.prefill`` runs it.

(``PackedAttention`` in session/model/layer_attention.py, through the one loop ``run_layers``.)

Each row gets the bits its own pass would: our linears sum the decode rows in their one-row blocks
and a chunk's tokens in the several-row ones (``several_rows_from``, session/model/cpu/linear.py), and
the logits are taken at each part's last position only, as [R, 1, D] (one row each, as both passes do).

Where it runs (``packing_backend``, RESIDENT_PACKED_STEPS): CPU, every cache paged in the runner's one
pool. Without our decode attention kernel (``ModelRunner.pooled_decode``: RESIDENT_CPU_KERNELS=0, a
head size or dtype it does not take) each decode row attends as a one-token chunk. On CUDA, with
RESIDENT_PACKED_STEPS=on and a pool a paged FlashAttention kernel reads, every part attends in one
kernel call per layer (``RaggedAttention``: each part a sequence of its own in a ragged batch, its
keys through its block table); "auto" leaves CUDA's steps apart until that has run on a GPU (its
plan is tested on CPU against the kernels' contracts: tests/unit/model/test_packed_varlen.py).
Elsewhere, and for a step of one part, the runner runs its passes apart (``separate_passes``). Who
calls this: ``ModelRunner.step``, on the engine loop thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from session.model.attention import RaggedAttention, choose_backend, flash_paged_varlen, torch_paged_varlen
from session.model.backend import Chunk, DecodeRows
from session.model.cpu.linear import several_rows_from
from session.model.kv_cache import KVPool, PagedKVCache, to_device
from session.model.layer_attention import (
    KernelRowsAttention,
    LayerAttention,
    PackedAttention,
    SpanAttention,
    run_layers,
)

if TYPE_CHECKING:
    from session.model.runner import ModelRunner


def packs(runner: ModelRunner, chunks: Sequence[Chunk], rows: DecodeRows | None) -> str | None:
    """How ``packed_step`` attends this step (``packing_backend``), or None where it does not take it: one
    part, caches not all in one pool, or a pool no packed plan reads."""
    kvs = [chunk.kv for chunk in chunks] + (list(rows.kvs) if rows is not None else [])
    if len(chunks) + (1 if rows is not None and len(rows) else 0) < 2 or not isinstance(kvs[0], PagedKVCache):
        return None
    pool = kvs[0].pool
    if not all(isinstance(kv, PagedKVCache) and kv.pool is pool for kv in kvs):
        return None
    return packing_backend(runner.packed_steps, pool)


def packing_backend(mode: str, pool: KVPool) -> str | None:
    """How a packed step over ``pool`` attends, under RESIDENT_PACKED_STEPS ``mode``: "cpu" (our kernels
    and the runs of blocks in place), "varlen" or "flash_attn" (``RaggedAttention``: on CUDA, where a
    paged FlashAttention kernel reads the pool, and only with ``on``: not yet checked on a GPU), or None
    (the step's passes run apart: ``off``, or a pool no packed plan reads)."""
    if mode == "off":
        return None
    backend = choose_backend(pool)
    if backend == "flash_attn" and not flash_paged_varlen():  # an older flash-attn: torch's kernel, if any
        backend = "varlen" if torch_paged_varlen() is not None else "sdpa"
    if backend != "sdpa" and mode == "on":
        return backend
    return "cpu" if pool.device.type == "cpu" else None


def packed_step(runner: ModelRunner, chunks: Sequence[Chunk], rows: DecodeRows | None, backend: str) -> torch.Tensor:
    """The step as one pass, attended as ``backend`` (what ``packs`` answered) -> logits [rows + chunks,
    V]: each decode row's, then each chunk's last position's. Every cache's length advances by what it fed."""
    decode = rows if rows is not None else DecodeRows([], [])
    kvs: list[PagedKVCache] = [kv for kv in [*decode.kvs, *(chunk.kv for chunk in chunks)]
                               if isinstance(kv, PagedKVCache)]
    # a verify's rows of one sequence (``DecodeRows.ahead``) sit at consecutive positions, in order: each
    # row's length is its own, and the last row of a sequence leaves its cache's length past all of them
    aheads = (decode.ahead or [0] * len(decode)) + [0] * len(chunks)
    lengths = [kv.length + ahead for kv, ahead in zip(kvs, aheads)]
    counts = [1] * len(decode) + [chunk.embeds.shape[0] for chunk in chunks]
    for kv, length, count in zip(kvs, lengths, counts):
        kv.ensure_capacity(length + count)
    num_rows = len(decode)
    runner.set_adapters([*(decode.adapter_slots or [0] * num_rows),
                         *(chunk.adapter_slot for chunk, count in zip(chunks, counts[num_rows:])
                           for _ in range(count))])
    h = _embeddings(runner, decode, chunks)  # [N, 1, D]
    cos, sin = cast(nn.Module, runner.lm.rotary_emb)(h, _positions(runner, decode, chunks, lengths))
    slots = to_device([slot for kv, length, count in zip(kvs, lengths, counts)
                       for slot in kv.slots(length, length + count)], runner.device)[:, None]  # [N, 1]
    if backend != "cpu":
        attention: LayerAttention = RaggedAttention(
            kvs[0].pool, slots, [kv.block_ids for kv in kvs], [n + count for n, count in zip(lengths, counts)],
            counts, runner.windows, backend)
    else:
        attention = _cpu_attention(runner, kvs, lengths, counts, slots, num_rows)
    with several_rows_from(num_rows):
        h = run_layers(runner, h, cos, sin, attention)
    for kv, length, count in zip(kvs, lengths, counts):
        kv.length = length + count
    ends = list(itertools.accumulate(counts))  # past each part's last token
    last = h.index_select(0, to_device([end - 1 for end in ends], runner.device)) if len(ends) < h.shape[0] else h
    return runner.logits(last)[:, 0]  # [R, 1, D]: the head sums as for one row each


def _cpu_attention(runner: ModelRunner, kvs: list[PagedKVCache], lengths: list[int], counts: list[int],
                   slots: torch.Tensor, num_rows: int) -> PackedAttention:
    """The decode rows by our kernel where it reads the pool (else each a one-token chunk), then each
    chunk over its runs of blocks in place."""
    pool = kvs[0].pool
    kernel = bool(num_rows) and runner.pooled_decode and pool.head_major  # else each row a one-token chunk
    rows_attention = (KernelRowsAttention(kvs[:num_rows], lengths[:num_rows], runner.windows, slots[:num_rows])
                      if kernel else None)
    grouped = runner.info.grouped_query
    chunks_attention = [SpanAttention(kv, length, count, runner.windows, runner.device, grouped, all_keys=index < num_rows)
                        for index, (kv, length, count) in enumerate(zip(kvs, lengths, counts))
                        if index >= (num_rows if kernel else 0)]
    return PackedAttention(pool, slots, rows_attention, num_rows, chunks_attention)


def _embeddings(runner: ModelRunner, decode: DecodeRows, chunks: Sequence[Chunk]) -> torch.Tensor:
    """[N, 1, D]: the decode rows' tokens embedded, then every chunk's embeddings."""
    parts = [chunk.embeds for chunk in chunks]
    if len(decode):
        parts.insert(0, cast(nn.Module, runner.lm.embed_tokens)(to_device(decode.token_ids, runner.device)))
    return torch.cat(parts)[:, None] if len(parts) > 1 else parts[0][:, None]


def _positions(runner: ModelRunner, decode: DecodeRows, chunks: Sequence[Chunk], lengths: list[int]) -> torch.Tensor:
    """The rotary positions of the N tokens: [N, 1], or M-RoPE's [3, N, 1] (a decode row's in all three)."""
    offsets = decode.position_offsets or [0] * len(decode)
    parts = [torch.tensor([n + delta for n, delta in zip(lengths, offsets)], dtype=torch.long)]
    for chunk, length in zip(chunks, lengths[len(decode):]):
        count = chunk.embeds.shape[0]
        parts.append(torch.arange(length, length + count) if chunk.positions is None else chunk.positions.cpu())
    if runner.mrope:
        parts = [part.expand(3, -1) if part.dim() == 1 else part for part in parts]
    return torch.cat(parts, dim=-1)[..., None].to(runner.device)
