"""The one forward loop over the layers, and the attention seam it calls.

Every pass of the model (a prefill, a decode step, a multi-token extend, a packed step, a fixed-shape
graph) runs ``run_layers``: per layer, the projections and rotation (``attention_inputs``), the pass's
attention, then the output projection and MLP (``finish_layer``). Passes differ only in attention:
where the new keys go and which keys each query reads. A ``LayerAttention`` is that for one pass:
built once per pass (block tables, masks, slots: its plan), then called once per layer.

The implementations, one per way attention runs, and who builds them:

- ``PagedAttention`` (session/model/attention.py): every row of a batch in one call through the
  paged pool: FlashAttention's paged kernel, torch's paged varlen, or SDPA over gathered blocks
  (``ModelRunner.prefill`` where one reads the pool in place, ``forward_paged``: the batched path).
- ``SpanAttention``: one sequence's new tokens, causal over its cache: its runs of blocks in place on
  CPU (``attend_runs``), a gathered view elsewhere (``ModelRunner.prefill``, a packed step's chunks).
- ``KernelRowsAttention``: decode rows through our CPU kernel over the head-major pool, every row of a
  layer in one call (``CpuKernelPath``, a packed step's decode rows).
- ``PackedAttention``: a packed step's parts on CPU, rows first, each by its own plan (packed_step.py).
- ``RaggedAttention`` (session/model/attention.py): a packed step's parts as one ragged batch through
  a paged varlen kernel, one call per layer (CUDA, RESIDENT_PACKED_STEPS=on).
- per-row decode and extend (session/model/decode_paths.py, ``PerRowPath``) and the fixed-shape
  graphs' (session/model/static_shapes.py) keep theirs beside the code that plans them.

The C++ layer and whole step (session/model/cpu/fused_layer.py) run a layer's every operator in one
call, attention included, so they are not a ``LayerAttention``. Who calls this: the runner and its
paths, on the engine loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeGuard

import torch
import torch.nn.functional as F

from session.model.attention import attend_runs, causal_masks
from session.model.cpu import attention as cpu_attention
from session.model.kv_cache import PAD_BLOCK, KVCache, KVPool, PagedKVCache


class LayerStack(Protocol):
    """What the loop needs of its runner (``ModelRunner``): the layers and how one runs."""

    layers: list

    def attention_inputs(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor): ...

    def finish_layer(self, layer, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor: ...


class LayerAttention(Protocol):
    """One pass's attention, planned when built; called by ``run_layers`` once per layer, in order."""

    def __call__(self, index: int, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s new keys and values stored where the pass's caches take them, and its queries
        attended: q [B, H, T, hd]; k, v [B, KVH, T, hd] -> [B, H, T, hd] (B rows of T new tokens each)."""
        ...


def run_layers(runner: LayerStack, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attention: LayerAttention) -> torch.Tensor:
    """h [B, T, D] through every layer -> [B, T, D] (before the final norm); cos and sin: the rotary
    tables of h's positions."""
    for index, layer in enumerate(runner.layers):
        q, k, v = runner.attention_inputs(layer, h, cos, sin)  # q: [B, H, T, hd]; k, v: [B, KVH, T, hd]
        h = runner.finish_layer(layer, h, attention(index, layer, q, k, v))
    return h


def reads_in_place(kv: KVCache, device: torch.device) -> TypeGuard[PagedKVCache]:
    """Does attention read ``kv``'s runs of blocks in place (``attend_runs``) rather than a gathered copy,
    in layers without a sliding window (whose masks can hide a whole run from a query)? A paged cache
    on CPU."""
    return device.type == "cpu" and isinstance(kv, PagedKVCache)


class SpanAttention:
    """One sequence's ``count`` new tokens after ``start`` cached ones, causal over its cache (in a
    sliding-window layer of W, the last W keys): on CPU a paged cache's runs of blocks in place, in
    full-attention layers, else a gathered view through SDPA. As a ``LayerAttention`` (a prefill's
    [1, H, T, hd] queries) it also writes the new keys; ``attend`` alone leaves that to its caller."""

    def __init__(self, kv: KVCache, start: int, count: int, windows: list[int | None], device: torch.device,
                 grouped: bool, all_keys: bool = False):
        """``all_keys``: one query that sees every key (a decode row: no mask, as its decode step)."""
        self.kv, self.start, self.count, self.end = kv, start, count, start + count
        self.windows, self.grouped = windows, grouped
        self.masks = causal_masks(start, count, windows, device, all_keys=all_keys)
        self.in_place = kv if reads_in_place(kv, device) else None  # in full-attention layers

    def __call__(self, index, layer, q, k, v):
        self.kv.write(index, self.start, k[0], v[0])
        return self.attend(index, layer, q)

    def attend(self, index: int, layer, q: torch.Tensor) -> torch.Tensor:
        """q [1, H, T, hd] -> [1, H, T, hd], the new keys already in the cache."""
        kv, window, scale = self.kv, self.windows[index], layer.self_attn.scaling
        mask = self.masks[window]
        if self.in_place is not None and window is None:  # the cache's runs of blocks in place, however it grew
            return attend_runs(q, self.in_place.runs(index, 0, self.end), scale, self.grouped, mask)
        return F.scaled_dot_product_attention(q, kv.keys(index, self.end)[None], kv.values(index, self.end)[None],
                                              attn_mask=mask, scale=scale, enable_gqa=self.grouped)


def window_start(window: int | None, length: int) -> int:
    """The first key a decode query at position ``length`` sees: 0, or in a sliding window of W the
    last W keys, its own included."""
    return 0 if window is None else max(0, length + 1 - window)


def block_table(kvs: Sequence[PagedKVCache]) -> torch.Tensor:
    """int32 [B, widest]: row b's block ids in order, padded with PAD_BLOCK (our CPU kernels' table)."""
    width = max(len(kv.block_ids) for kv in kvs)
    return torch.tensor([kv.block_ids + [PAD_BLOCK] * (width - len(kv.block_ids)) for kv in kvs], dtype=torch.int32)


class KernelRowsAttention:
    """Decode rows, row b a query at position lengths[b] of kvs[b]'s sequence (a sequence may own several
    rows at consecutive positions: each attends up to its own), every row of a layer in one call of our
    CPU kernel over the head-major pool. As a ``LayerAttention`` it writes the rows' keys at ``slots``
    [B, 1] first; ``attend`` alone leaves that to its caller."""

    def __init__(self, kvs: Sequence[PagedKVCache], lengths: list[int], windows: list[int | None],
                 slots: torch.Tensor):
        self.pool: KVPool = kvs[0].pool
        self.slots, self.windows = slots, windows
        self.table = block_table(kvs)
        self.ends = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
        self.starts = {window: torch.tensor([window_start(window, n) for n in lengths], dtype=torch.int32)
                       for window in set(windows)}  # window -> [B]: each row's first key

    def __call__(self, index, layer, q, k, v):
        self.pool.write_rows(index, self.slots, k, v)
        return self.attend(index, layer, q)

    def attend(self, index: int, layer, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, 1, hd] -> [B, H, 1, hd], the rows' keys already in the pool."""
        o = cpu_attention.decode_attention(q[:, :, 0].contiguous(), self.pool.k[index], self.pool.v[index],
                                           self.table, self.starts[self.windows[index]], self.ends,
                                           layer.self_attn.scaling)
        return o[:, :, None]


class PackedAttention:
    """A packed step's attention: its N tokens as rows [N, H, 1, hd], every new key written at ``slots``
    [N, 1] in one call, then the decode rows (first, where ``rows`` is given) by our kernel and each
    chunk's tokens causal over its own cache (a chunk's rows turned into one [1, H, T, hd] query)."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, rows: KernelRowsAttention | None, num_rows: int,
                 chunks: list[SpanAttention]):
        self.pool, self.slots, self.rows, self.num_rows, self.chunks = pool, slots, rows, num_rows, chunks

    def __call__(self, index, layer, q, k, v):
        self.pool.write_rows(index, self.slots, k, v)
        outs = [] if self.rows is None else [self.rows.attend(index, layer, q[:self.num_rows])]
        first = self.num_rows if self.rows is not None else 0
        for chunk in self.chunks:
            queries = q[first:first + chunk.count, :, 0].transpose(0, 1)[None]  # [1, H, T, hd]
            outs.append(chunk.attend(index, layer, queries)[0].transpose(0, 1)[:, :, None])
            first += chunk.count
        return torch.cat(outs) if len(outs) > 1 else outs[0]
