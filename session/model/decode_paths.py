"""How a decode step (and a multi-token ``extend``) runs: one path, chosen once per runner.

``ModelRunner.configure_decode`` (start-up, RESIDENT_ATTENTION) picks one of these into
``runner.path``; every ``decode`` and ``extend`` then goes through it:

- ``PerRowPath``: projections and MLPs batched, attention per row over that session's own cache
  (on CPU its blocks read in place by ``attend_runs``; elsewhere a gathered view through SDPA).
- ``CpuKernelPath``: the per-row step with our CPU kernels (session/model/cpu): attention for every
  row of a layer in one call over the head-major pool, each layer as one C++ call where the layer is
  one it reproduces, and the whole step as one call where it can. An ``extend`` runs as decode rows,
  so each position's logits are the bits its own decode step would give.
- ``BatchedPath``: one attention call per layer for every row over the paged pool
  (session/model/attention.py), replayed from CUDA graphs per batch bucket where configured.

Within a path, caches that are not all paged in one pool (static caches, or two pools) take the
per-row code, which serves any cache. Who calls this: the runner, on the engine loop thread.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from session.model.attention import attend_runs, causal_masks, choose_backend, columns, plan_rows, to_batch
from session.model.backend import DecodeRows, ModelInfo
from session.model.blocks import blocks_for, blocks_missing
from session.model.cpu import fused_layer
from session.model.kv_cache import KVCache, KVPool, PagedKVCache
from session.model.layer_attention import (
    KernelRowsAttention,
    LayerStack,
    block_table,
    reads_in_place,
    run_layers,
    window_start,
)

if TYPE_CHECKING:
    from session.model.cuda_graphs import DecodeGraphs
    from session.model.lora_bank import LoraBank


class Layers(LayerStack, Protocol):
    """What a path needs of its runner (``ModelRunner``): the model's layers and how one runs."""

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    info: ModelInfo
    lm: Any  # transformers' decoder stack: embed_tokens, rotary_emb, norm (its class's own parts)
    lm_head: torch.nn.Module
    windows: list[int | None]
    cpu_kernels: bool

    @property
    def plain_layers(self) -> bool: ...

    @property
    def lora(self) -> LoraBank | None: ...

    def set_adapters(self, slots: list[int] | None) -> None: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def forward_paged(self, pool, ids: torch.Tensor, batch, position_offsets: torch.Tensor | None = None): ...


class PerRowPath:
    name = "per_row"

    def __init__(self, runner: Layers):
        self.runner = runner

    def decode(self, kvs: list[KVCache], token_ids: list[int], lengths: list[int],
               offsets: list[int] | None, adapter_slots: list[int] | None) -> torch.Tensor:
        """logits [B, V]: token_ids[b] fed at position lengths[b] (+ offsets[b], M-RoPE rope deltas, host
        values) of kvs[b]."""
        runner = self.runner
        h, cos, sin = step_inputs(runner, token_ids, lengths, offsets)
        h = run_layers(runner, h, cos, sin, _RowDecodeAttention(runner, kvs, lengths))
        return runner.logits(h)[:, 0]

    def extend(self, kvs: list[KVCache], token_rows: list[list[int]], lengths: list[int],
               adapter_slots: list[int] | None) -> torch.Tensor:
        """logits [B, T, V] (T the longest row; a shorter row's padding positions are zeros):
        projections and MLPs over [B, T], attention per row over its own cache."""
        runner = self.runner
        counts = [len(row) for row in token_rows]
        width = max(counts)
        padded = [row + row[-1:] * (width - len(row)) for row in token_rows]
        for kv, length, count in zip(kvs, lengths, counts):
            kv.ensure_capacity(length + count)
        device = runner.device
        h = runner.lm.embed_tokens(torch.tensor(padded, dtype=torch.long, device=device))  # [B, T, D]
        positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(width, device=device)
        cos, sin = runner.lm.rotary_emb(h, positions)  # positions: [B, T]
        h = run_layers(runner, h, cos, sin, _RowExtendAttention(runner, kvs, lengths, counts, width))
        return runner.logits(h)


class CpuKernelPath(PerRowPath):
    """Our CPU kernels for caches in one head-major pool; the per-row path for any other caches.
    RESIDENT_ATTENTION=per_row (auto on CPU) takes it where our decode kernel builds."""

    name = "cpu_kernel"  # every row of a layer in one kernel call, not a call per row

    def __init__(self, runner: Layers):
        super().__init__(runner)
        self._lora_cached: tuple | None = None  # (rows' adapters, bank version) -> lora_arguments' tensors

    def serves(self, kvs: list[KVCache]) -> bool:
        pool = shared_pool(kvs)
        return pool is not None and pool.head_major

    @cached_property
    def fused(self) -> list[tuple] | None:
        """The layers' arguments for the C++ layer where every layer is one it reproduces (None: the
        Python layer). Planned on first use, after any LoRA install (adapter rows go in as arguments)."""
        runner = self.runner
        i = runner.info
        reproduced = runner.cpu_kernels and runner.kv_dtype == runner.dtype and runner.plain_layers
        return fused_layer.plan(runner.layers, i.num_heads, i.num_kv_heads, i.head_dim) if reproduced else None

    @cached_property
    def stack(self) -> fused_layer.Stack | None:
        """The whole step as one C++ call around the fused layers (None: a call per layer)."""
        runner = self.runner
        if self.fused is None:
            return None
        return fused_layer.stack(self.fused, runner.windows, runner.lm.embed_tokens, runner.lm.rotary_emb,
                                 runner.lm.norm, runner.lm_head, runner.info.head_dim, runner.info.max_positions)

    def decode(self, kvs, token_ids, lengths, offsets, adapter_slots):
        if not self.serves(kvs):
            return super().decode(kvs, token_ids, lengths, offsets, adapter_slots)
        return self.decode_rows(kvs, token_ids, lengths, offsets)

    def extend(self, kvs, token_rows, lengths, adapter_slots):
        """Every new token a row of one ``decode_rows`` pass, so each position's logits are the bits its
        own decode step would give (a speculative verify then accepts exactly what plain decoding would
        emit). -> [B, width, V], padding positions zero."""
        if not self.serves(kvs):
            return super().extend(kvs, token_rows, lengths, adapter_slots)
        for kv, length, row in zip(kvs, lengths, token_rows):
            kv.ensure_capacity(length + len(row))
        rows = DecodeRows.verify(kvs, token_rows, adapter_slots)
        if rows.adapter_slots is not None:  # one adapter row per new token
            self.runner.set_adapters(rows.adapter_slots)
        flat = self.decode_rows(paged_caches(rows.kvs), rows.token_ids,
                                [kv.length + a for kv, a in zip(rows.kvs, rows.ahead or [])], None)  # [N, V]
        return rows.widen(flat)

    def decode_rows(self, kvs: list[PagedKVCache], token_ids: list[int], lengths: list[int],
                    offsets: list[int] | None) -> torch.Tensor:
        """Row b feeds token_ids[b] at position lengths[b] of kvs[b]'s sequence; a sequence may own several
        rows at consecutive positions (``extend``): each attends up to its own position, as its decode step
        would, and every linear sums as for one row (session/model/cpu/linear.py). -> logits [B, V]."""
        runner, pool = self.runner, kvs[0].pool
        stack = self.stack if offsets is None else None
        if stack is not None and max(lengths) < stack.positions:  # the whole step, one C++ call
            slot_ids = [kv.slots(n, n + 1)[0] for kv, n in zip(kvs, lengths)]
            rows = len(kvs)
            ints = torch.tensor([*token_ids, *lengths, *slot_ids])  # int64: ids, positions, slots
            # int32 [windows + 1, B]: each row's first key per window, then its end
            bounds = torch.tensor([[window_start(w, n) for n in lengths] for w in stack.windows]
                                  + [[n + 1 for n in lengths]], dtype=torch.int32)
            lora, mask = self.lora_arguments()
            out = stack.step.run(ints[:rows], ints[rows:2 * rows], pool.k, pool.v, ints[2 * rows:],
                                 block_table(kvs), bounds[:-1], bounds[-1], lora, mask)
            return out if stack.head else runner.lm_head(out[:, None])[:, 0].float()
        h, cos, sin = step_inputs(runner, token_ids, lengths, offsets)
        slots = step_slots(runner, kvs, lengths)
        attention = KernelRowsAttention(kvs, lengths, runner.windows, slots)
        fused = self.fused
        if fused is not None:  # the same operators from C++, a call per layer (session/model/cpu/fused_layer.py)
            h, cos, sin = h[:, 0], cos[:, 0], sin[:, 0]
            flat_slots, table, starts = slots[:, 0].contiguous(), attention.table, attention.starts
            lora, mask = self.lora_arguments()
            for index, arguments in enumerate(fused):
                h = fused_layer.run(h, arguments, cos, sin, pool.k[index], pool.v[index], flat_slots, table,
                                    starts[runner.windows[index]], attention.ends, lora[14 * index:14 * index + 14],
                                    mask)
            if fused_layer.is_norm(runner.lm.norm):  # the final norm by the layer's own (checked at load)
                h = fused_layer.norm(h, runner.lm.norm, fused)
                return runner.lm_head(h[:, None])[:, 0].float()  # [B, 1, D]: the head sums as for one row each
            return runner.logits(h[:, None])[:, 0]
        return runner.logits(run_layers(runner, h, cos, sin, attention))[:, 0]

    def lora_arguments(self) -> tuple[list, torch.Tensor | None]:
        """This step's LoRA deltas for the C++ layer (``fused_layer.lora_arguments``), the tensor list
        kept while the rows' adapters and the bank's weights stay the same (a batch keeps its mix for
        many steps)."""
        bank = self.runner.lora
        if bank is None or (bank.single is None and bank.mixed is None):
            return [], None
        key = (bank.single, bank.mixed[0] if bank.mixed is not None else None, bank.version)
        if self._lora_cached is None or self._lora_cached[0] != key:
            self._lora_cached = (key, fused_layer.lora_arguments(bank, len(self.runner.layers))[0])
        return self._lora_cached[1], bank.row_mask


class BatchedPath(PerRowPath):
    """One attention call per layer for all rows over the paged pool; CUDA graphs where given."""

    name = "batched"

    def __init__(self, runner: Layers, graphs: DecodeGraphs | None = None):
        super().__init__(runner)
        self.graphs = graphs

    def decode(self, kvs, token_ids, lengths, offsets, adapter_slots):
        if shared_pool(kvs) is None or gathers_past_the_pool(kvs, 1):
            return super().decode(kvs, token_ids, lengths, offsets, adapter_slots)
        graphs = self.graphs
        if graphs is not None and (offsets is None or graphs.offsets) and graphs.fits(kvs, adapter_slots):
            return graphs.run(kvs, token_ids, offsets, adapter_slots)  # offsets and adapter slots in the plan
        runner = self.runner
        plan = torch.tensor([[t, *row] for t, row in zip(token_ids, plan_rows(kvs, 1))], device=runner.device)
        deltas = None if offsets is None else torch.tensor(offsets, device=runner.device)
        return runner.forward_paged(kvs[0].pool, columns(plan, 0, 1), to_batch(plan[:, 1:], 1), deltas)[:, 0]

    def extend(self, kvs, token_rows, lengths, adapter_slots):
        """One ``forward_paged`` call: shorter rows padded to T with their last token, whose keys land in
        the row's own blocks past its new length (stale there, overwritten later) and come after every
        real query of the row, so none attends to them."""
        width = max(len(row) for row in token_rows)
        if not (shared_pool(kvs) is not None and all(kv.length + width <= kv.max_tokens for kv in kvs)
                and padding_fits(kvs, lengths, width)) or gathers_past_the_pool(kvs, width):
            return super().extend(kvs, token_rows, lengths, adapter_slots)
        graphs = self.graphs
        if graphs is not None and not any(adapter_slots or ()) and graphs.fits_verify(kvs, width):
            padded_to = width if width == 1 else graphs.verify_tokens  # a graph's rows are all that wide
            if padding_fits(kvs, lengths, padded_to):
                for kv, length in zip(kvs, lengths):
                    kv.ensure_capacity(length + padded_to)
                return graphs.run_verify(kvs, token_rows)
        for kv, length in zip(kvs, lengths):
            kv.ensure_capacity(length + width)
        padded = [row + row[-1:] * (width - len(row)) for row in token_rows]
        runner = self.runner
        plan = torch.tensor([[*ids, *row] for ids, row in zip(padded, plan_rows(kvs, width))], device=runner.device)
        return runner.forward_paged(kvs[0].pool, columns(plan, 0, width), to_batch(plan[:, width:], width))


class _RowDecodeAttention:
    """``PerRowPath.decode``'s attention: each decode row over its own cache (on CPU its runs of blocks
    in place, each layer's views cut once per step and window; elsewhere a view through SDPA)."""

    def __init__(self, runner: Layers, kvs: list[KVCache], lengths: list[int]):
        self.runner, self.kvs, self.lengths = runner, kvs, lengths
        self.grouped = runner.info.grouped_query
        self.pool, self.paged = shared_pool(kvs), paged_caches(kvs)
        self.slots = step_slots(runner, self.paged, lengths)
        self.row_runs: dict[int | None, list[list[tuple]]] = {}  # window -> runs_of_rows: once per step

    def __call__(self, index, layer, q, k, v):
        """q [B, H, 1, hd]; k, v [B, KVH, 1, hd] -> [B, H, 1, hd]."""
        runner, pool, scale = self.runner, self.pool, layer.self_attn.scaling
        window = runner.windows[index]
        if pool is not None:
            pool.write_rows(index, self.slots, k, v)
        rows = []
        for b, (kv, length) in enumerate(zip(self.kvs, self.lengths)):
            if pool is None:
                kv.write(index, length, k[b], v[b])
            if runner.device.type == "cpu":  # the session's blocks in place, however it grew
                if window not in self.row_runs:
                    starts = [window_start(window, n) for n in self.lengths]
                    self.row_runs[window] = runs_of_rows(self.paged, starts, [n + 1 for n in self.lengths])
                runs = [(keys[index], values[index]) for keys, values in self.row_runs[window][b]]
                rows.append(attend_runs(q[b : b + 1], runs, scale, self.grouped))
                continue
            first = window_start(window, length)
            rows.append(F.scaled_dot_product_attention(
                q[b : b + 1], kv.keys(index, length + 1)[None, :, first:],
                kv.values(index, length + 1)[None, :, first:], scale=scale, enable_gqa=self.grouped,
            ))
        return torch.cat(rows) if len(rows) > 1 else rows[0]


class _RowExtendAttention:
    """``PerRowPath.extend``'s attention: row b's counts[b] new tokens (of ``width``, the rest padding)
    causal over its own cache; the padding positions' outputs are zeros."""

    def __init__(self, runner: Layers, kvs: list[KVCache], lengths: list[int], counts: list[int], width: int):
        device = runner.device
        self.runner, self.kvs, self.lengths, self.counts, self.width = runner, kvs, lengths, counts, width
        self.masks = [causal_masks(length, count, runner.windows, device, all_keys=count == 1)
                      for length, count in zip(lengths, counts)]
        self.grouped = runner.info.grouped_query
        self.pool = shared_pool(kvs)
        if self.pool is not None:  # every row's real new tokens (not its padding): row, column, and slot in the pool
            self.new_rows = torch.tensor([b for b, count in enumerate(counts) for _ in range(count)], device=device)
            self.new_columns = torch.tensor([t for count in counts for t in range(count)], device=device)
            self.slots = torch.tensor([slot for kv, length, count in zip(paged_caches(kvs), lengths, counts)
                                       for slot in kv.slots(length, length + count)], device=device)
        self.row_runs: list[list[tuple]] | None = None  # runs_of_rows, once per step for the layers in place

    def __call__(self, index, layer, q, k, v):
        """q [B, H, T, hd]; k, v [B, KVH, T, hd] -> [B, H, T, hd]."""
        runner, pool, kvs, scale = self.runner, self.pool, self.kvs, layer.self_attn.scaling
        window = runner.windows[index]
        if pool is not None:  # [N, KVH, hd] -> [KVH, N, hd]
            pool.write(index, self.slots, k[self.new_rows, :, self.new_columns].transpose(0, 1),
                       v[self.new_rows, :, self.new_columns].transpose(0, 1))
        rows = []
        for b, (kv, length, count) in enumerate(zip(kvs, self.lengths, self.counts)):
            if pool is None:
                kv.write(index, length, k[b, :, :count], v[b, :, :count])
            if window is None and reads_in_place(kv, runner.device):
                if self.row_runs is None:
                    self.row_runs = runs_of_rows(paged_caches(kvs), [0] * len(kvs),
                                                 [n + c for n, c in zip(self.lengths, self.counts)])
                runs = [(keys[index], values[index]) for keys, values in self.row_runs[b]]
                row = attend_runs(q[b:b + 1, :, :count], runs, scale, self.grouped, self.masks[b][window])
            else:
                row = F.scaled_dot_product_attention(
                    q[b:b + 1, :, :count], kv.keys(index, length + count)[None],
                    kv.values(index, length + count)[None], attn_mask=self.masks[b][window],
                    scale=scale, enable_gqa=self.grouped,
                )  # [1, H, count, hd]
            rows.append(row if count == self.width else F.pad(row, (0, 0, 0, self.width - count)))  # padding: zeros
        return torch.cat(rows) if len(rows) > 1 else rows[0]


def gathers_past_the_pool(kvs: list[PagedKVCache], num_new: int) -> bool:
    """Would the batched step's attention gather more blocks than the pool holds (SDPA over gathered
    blocks pads every row to the widest: rows x widest table)? Such a step attends per row, whose
    copies are each row's own blocks, so a step never copies more than 1/layers of the pool at a
    time (what the memory plan sets aside: session/engine/assembly.py)."""
    pool = kvs[0].pool
    if not pool.blocks.fixed or choose_backend(pool) != "sdpa":
        return False  # a pool without a budget (CPU default), or FlashAttention reading the pool in place
    widest = max(blocks_for(kv.length + num_new, pool.block_tokens) for kv in kvs)
    return len(kvs) * widest > pool.num_blocks


def padding_fits(kvs: list[PagedKVCache], lengths: list[int], width: int) -> bool:
    """Can every row hold ``width`` positions from its length (padding included) without a fixed pool
    growing? Rows padded past what their turn reserved take blocks the memory manager did not count."""
    pool = kvs[0].pool
    missing = sum(blocks_missing(length + width, pool.block_tokens, len(kv.block_ids))
                  for kv, length in zip(kvs, lengths))
    return pool.blocks.can_take(missing)


def step_inputs(runner: Layers, token_ids: list[int], lengths: list[int], offsets: list[int] | None):
    """A decode step's embeddings h [B, 1, D] and rotary cos/sin at positions lengths[b] (+ offsets[b])."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    h = runner.lm.embed_tokens(ids)[:, None]  # [B, 1, D]
    rotary = lengths if offsets is None else [n + delta for n, delta in zip(lengths, offsets)]
    positions = torch.tensor(rotary, device=runner.device)
    cos, sin = runner.lm.rotary_emb(h, positions[:, None])
    return h, cos, sin


def step_slots(runner: Layers, kvs: list[PagedKVCache], lengths: list[int]) -> torch.Tensor:
    """[B, 1]: the pool slot of each row's new token (at position lengths[b])."""
    return torch.tensor([kv.slots(length, length + 1) for kv, length in zip(kvs, lengths)], device=runner.device)


def runs_of_rows(kvs: list[PagedKVCache], starts: list[int], ends: list[int]) -> list[list[tuple]]:
    """Per row, the runs of blocks holding its positions starts[b] .. ends[b]-1, as (keys, values)
    views [layers, KVH, n, hd] of every layer (a step builds them once, then indexes a layer)."""
    return [[kv.pool.run_all_layers(*bounds) for bounds in kv.run_bounds(start, end)]
            for kv, start, end in zip(kvs, starts, ends)]


def shared_pool(kvs: list[KVCache]) -> KVPool | None:
    """The pool every cache is paged in, where they share one: a step stores all rows' new keys in one
    call per layer; else None."""
    pool = getattr(kvs[0], "pool", None)
    return pool if pool is not None and all(getattr(kv, "pool", None) is pool for kv in kvs) else None


def paged_caches(kvs: list[KVCache]) -> list[PagedKVCache]:
    """``kvs``, each a paged cache, for what reads blocks (slots, runs of blocks); a static cache takes
    the fixed-shape runner's steps (session/model/static_shapes.py), never a path's."""
    paged = [kv for kv in kvs if isinstance(kv, PagedKVCache)]
    if len(paged) < len(kvs):
        raise TypeError("a decode path's step reads paged caches' blocks; a static cache takes StaticRunner's")
    return paged
