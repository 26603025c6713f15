"""CUDA graphs of the batched decode step: one per (batch bucket, block-table bucket).

A decode step on a GPU is hundreds of small kernels; launched one by one from Python their launch
overhead, not the GPU, sets the step time at small batches. A captured graph replays them all with
one launch. Capture needs fixed shapes and addresses, so a step is padded to buckets:
- rows to the next batch bucket (padding rows write into and read from the pool's padding block);
- block tables to the next power of two of blocks (up to the sessions' context window), so short
  contexts do not pay for the longest one.
The inputs of a step (token ids, positions, slots, lengths, block tables) are one int64 ``plan``
buffer per graph: a step copies one pinned host tensor into it without blocking, and replays. Activations live in one
memory pool shared by all graphs, and every graph of a width writes its logits into one buffer
(``outputs``: no graph holds its own), so nothing is allocated on the device per step but the [B, V]
logits handed back (a copy: the buffer is overwritten by the next replay).

A speculative verify (``ModelRunner.extend``: each row's last token and its proposals, scored in one
pass) has graphs too, with ``verify_tokens`` new tokens per row (the most proposals plus one), for
the batch buckets a speculative step can have: a row with fewer is padded with its last token,
whose keys land past its new length and come after its every real query (stale there, overwritten
later), as the eager extend pads. A verify as wide as a decode (one token a row) replays the decode
graph.

Steps with adapter rows have their own graphs, where each row's LoRA slot is a plan column and every
adapted linear adds, per row, the product with that slot's factors gathered from the bank
(``LoraBank.slot_rows``: no host state, so a replay serves any mix; slot 0, the base model, holds
zeros). The bank is allocated at start-up on a GPU and loads adapters into its slots in place, so
the graphs read new adapters without being captured again. A verify with adapter rows runs eagerly. An
M-RoPE model's graphs (Qwen2-VL, Qwen2.5-VL) carry each row's rope delta as the plan's last column:
a generated token is text, at the same position in all three rotary rows, so the delta is all a
decode step adds to its plain position.
Every graph is captured at start-up (``capture_all``), largest first; a step whose graph is missing
captures it then. A pool that grew (session/model/kv_cache.py; not on CUDA, where the pool is
reserved from the budget) moved its tensors, so every graph is captured again.

Everything is on the model's device, named, never "the current device": every graph is captured,
after a warm-up, on one side stream of that device, so that a process serving cuda:1 captures its
kernels there rather than on a stream of GPU 0 (torch.cuda.graph's own stream, made on the current
device, would capture nothing of cuda:1's work: an empty graph, stale logits on every replay). A
replay, the copy of its plan and of its logits run on that device's current stream, in that order.

Who calls this: ``ModelRunner.decode`` on the engine loop thread, and ``capture_all`` at start-up on
that same thread; CUDA only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from session.model.attention import columns, pad_row, plan_rows, to_batch
from session.model.blocks import blocks_for
from session.model.buckets import bucket_for, power_buckets
from session.model.kv_cache import KVPool, PagedKVCache

logger = logging.getLogger(__name__)


def graph_key(kvs: list[PagedKVCache], batch_buckets: tuple[int, ...], num_new: int = 1) -> tuple[int, int] | None:
    """(rows, blocks) of the graph a step of ``kvs`` feeding ``num_new`` tokens a row replays, or None
    when it has none (more rows than the largest bucket, a row whose window cannot hold the new
    tokens, or a padded gather larger than the pool: ``worth_a_graph``)."""
    rows = bucket_for(len(kvs), batch_buckets)
    if rows is None or any(kv.length + num_new > kv.max_tokens for kv in kvs):
        return None
    block_tokens = kvs[0].block_tokens
    most = max(blocks_for(kv.max_tokens, block_tokens) for kv in kvs)  # widest table a session can have
    needed = max(blocks_for(kv.length + num_new, block_tokens) for kv in kvs)
    blocks = bucket_for(needed, power_buckets(most))
    if blocks is None:  # never: ``needed`` <= ``most``, the largest bucket
        return None
    return (rows, blocks) if worth_a_graph(rows, blocks, kvs[0].pool) else None


def worth_a_graph(num_rows: int, num_blocks: int, pool: KVPool) -> bool:
    """A graph gathers ``num_rows`` x ``num_blocks`` blocks of K and V per layer, and its memory is
    held for as long as the graphs live: none is captured past the pool's own size (a step that large,
    every row padded to a long one, is rare; it runs eagerly). With 256 rows and 4k-token contexts
    on a 7B, such a graph alone would hold 17 GB."""
    return num_rows * num_blocks <= pool.num_blocks


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    plan: torch.Tensor  # [rows, 2T + 1 + blocks] int64: T token ids, then plan_rows' row
    logits: torch.Tensor  # [rows, V] (a decode), [rows, T, V] (a verify): rows of the shared ``outputs``


class DecodeGraphs:
    def __init__(self, runner, batch_buckets: tuple[int, ...], verify_tokens: int = 0,
                 verify_buckets: tuple[int, ...] = ()):
        self.runner = runner
        self.batch_buckets = tuple(batch_buckets)
        self.offsets = bool(getattr(runner, "mrope", False))  # M-RoPE: each row's rope delta, in the plan
        self.graphs: dict[tuple[int, int], Captured] = {}
        # a speculative verify's graphs (none for an M-RoPE model, which does not speculate)
        self.verify_tokens = verify_tokens if verify_tokens > 1 and not self.offsets else 0
        self.verify_buckets = tuple(verify_buckets) if self.verify_tokens else ()
        self.verify_graphs: dict[tuple[int, int], Captured] = {}
        # decode steps with adapter rows: each row's slot in the plan (``LoraBank.slot_rows``)
        self.lora_graphs: dict[tuple[int, int], Captured] = {}
        # logits of every graph of a width (tokens a row), written by its replays: one buffer for the
        # largest batch, so that no graph keeps an output of its own in the graphs' memory pool
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory = torch.cuda.graph_pool_handle()
        # one capture stream for every graph: graphs sharing a memory pool are to be captured on the same
        # stream (torch.cuda.graph), and their warm-up runs there too, so that the state it builds per
        # stream (cuBLAS workspaces) is the state the capture finds
        self.stream = torch.cuda.Stream(runner.device)
        self.pool_address: int | None = None  # the pool tensors the graphs were captured over

    @property
    def adapters(self) -> bool:
        """Adapter rows have graphs: the runner has a LoRA bank whose factors are allocated (at start-up
        on an accelerator: session/engine/assembly.py), so their addresses never change."""
        bank = getattr(self.runner, "lora", None)
        return bank is not None and bool(bank.at)

    def capture_all(self, pool: KVPool, max_tokens: int) -> int:
        """Capture every graph a step can need, at start-up: each batch bucket with each block-table bucket
        up to ``max_tokens`` (a session's context window), for plain decode steps, verifies and steps with
        adapter rows, largest first, so the shared memory pool is sized once by the largest graph and the
        smaller ones fit in it; no step captures mid-serving (a capture synchronizes the device and empties
        its cache: a stall for every request in flight). Returns the number captured. Who calls this:
        ``ModelRunner.capture_decode_graphs``, from ``assemble``, after the pool is reserved (a pool that
        moves later is captured again)."""
        self._forget(pool)
        block_buckets = power_buckets(blocks_for(max_tokens, pool.block_tokens))
        kinds = [(rows, 1, False) for rows in self.batch_buckets]
        kinds += [(rows, self.verify_tokens, False) for rows in self.verify_buckets]
        kinds += [(rows, 1, True) for rows in self.batch_buckets if self.adapters]
        for num_rows, num_new, lora in sorted(kinds, key=lambda kind: kind[0] * kind[1] * (1 + kind[2]), reverse=True):
            for num_blocks in sorted(block_buckets, reverse=True):
                if worth_a_graph(num_rows, num_blocks, pool):
                    self._set(num_new, lora)[(num_rows, num_blocks)] = self._capture(pool, num_rows, num_blocks,
                                                                                     num_new, lora)
        return len(self.graphs) + len(self.verify_graphs) + len(self.lora_graphs)

    def _set(self, num_new: int, lora: bool) -> dict[tuple[int, int], Captured]:
        return self.lora_graphs if lora else self.graphs if num_new == 1 else self.verify_graphs

    def _forget(self, pool: KVPool) -> None:
        for graphs in (self.graphs, self.verify_graphs, self.lora_graphs):
            graphs.clear()
        self.pool_address = pool.k.data_ptr()

    def fits(self, kvs: list[PagedKVCache], adapter_slots: list[int] | None = None) -> bool:
        """Can a decode step of ``kvs`` replay a graph (with ``adapter_slots``: one with adapter rows)?"""
        return (not any(adapter_slots or ()) or self.adapters) and graph_key(kvs, self.batch_buckets) is not None

    def fits_verify(self, kvs: list[PagedKVCache], width: int) -> bool:
        """Can a verify of rows up to ``width`` tokens replay a graph (``run_verify``)?"""
        if width == 1:
            return self.fits(kvs)
        return 1 < width <= self.verify_tokens and graph_key(kvs, self.verify_buckets, self.verify_tokens) is not None

    def run_verify(self, kvs: list[PagedKVCache], token_rows: list[list[int]]) -> torch.Tensor:
        """``ModelRunner.extend`` by replaying a graph (caches sized for ``verify_tokens`` more; one
        token a row: the decode graph); logits [B, T, V], T the longest row (``fits_verify``)."""
        width = max(len(row) for row in token_rows)
        if width == 1:
            return self.run(kvs, [row[0] for row in token_rows])[:, None]
        padded = [row + row[-1:] * (self.verify_tokens - len(row)) for row in token_rows]
        return self._replay(kvs, padded, None, None, self.verify_tokens)[:, :width]

    def run(self, kvs: list[PagedKVCache], token_ids: list[int], offsets: list[int] | None = None,
            adapter_slots: list[int] | None = None) -> torch.Tensor:
        """Decode one token for each row (caches already sized) by replaying the step's graph; logits [B, V].
        ``offsets``: each row's M-RoPE rope delta (graphs of an M-RoPE model take them; None: 0);
        ``adapter_slots``: each row's LoRA slot (any non-zero: the graphs with adapter rows)."""
        slots = list(adapter_slots) if adapter_slots is not None and any(adapter_slots) else None
        return self._replay(kvs, [[token] for token in token_ids], offsets if self.offsets else None, slots, 1)

    def _replay(self, kvs: list[PagedKVCache], token_rows: list[list[int]], offsets: list[int] | None,
                adapter_slots: list[int] | None, num_new: int) -> torch.Tensor:
        pool = kvs[0].pool
        if pool.k.data_ptr() != self.pool_address:
            self._forget(pool)
        lora = adapter_slots is not None
        graphs = self._set(num_new, lora)
        key = graph_key(kvs, self.batch_buckets if num_new == 1 else self.verify_buckets, num_new)
        if key is None:
            raise RuntimeError("no graph takes this step: the runner asks fits() or fits_verify() first")
        captured = graphs.get(key)
        if captured is None:
            captured = graphs[key] = self._capture(pool, *key, num_new, lora)
        rows = graph_rows(kvs, token_rows, offsets, *key, self.offsets, num_new=num_new, adapter_slots=adapter_slots,
                          with_adapters=lora)
        # from pinned memory without blocking, on the device's current stream, then the replay on it too (a
        # pageable source would make the host wait for the copy; the pinned block is reused only after it)
        captured.plan.copy_(torch.tensor(rows).pin_memory(), non_blocking=True)
        captured.graph.replay()
        return captured.logits[: len(kvs)].clone()

    def _capture(self, pool: KVPool, num_rows: int, num_blocks: int, num_new: int = 1,
                 lora: bool = False) -> Captured:
        what = "decode step" if num_new == 1 else f"{num_new}-token verify"
        logger.info("capturing the %s%s as a CUDA graph: %d rows, %d blocks of %d tokens", what,
                    " with adapter rows" if lora else "", num_rows, num_blocks, pool.block_tokens)
        runner = self.runner
        plan = torch.tensor(graph_rows([], [], None, num_rows, num_blocks, self.offsets, pool.block_tokens, num_new,
                                       with_adapters=lora), device=runner.device)

        def step() -> torch.Tensor:
            return graph_step(runner, pool, plan, self.offsets, num_new, lora)

        device, stream = runner.device, self.stream
        # the device guard: torch.cuda.graph synchronizes and empties the cache of the current device, and
        # leaving torch.cuda.stream restores the current device's stream, whichever thread this runs on
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))  # the plan, written on the current stream
            with torch.cuda.stream(stream):
                warm = step()  # warm-up outside the capture: lazy initialisation (cuBLAS workspaces, kernel choice)
            torch.cuda.current_stream(device).wait_stream(stream)
            output = self._output(num_new, warm)[:num_rows]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory, stream=stream):
                output.copy_(step())  # the step's own logits are freed back to the pool at the end
        return Captured(graph, plan, output)

    def _output(self, num_new: int, like: torch.Tensor) -> torch.Tensor:
        """The logits buffer of the graphs ``num_new`` tokens a row wide: [largest batch, (T,) V]."""
        buffer = self.outputs.get(num_new)
        if buffer is None:
            rows = max(self.batch_buckets if num_new == 1 else self.verify_buckets)
            buffer = self.outputs[num_new] = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
        return buffer


def graph_rows(kvs: list[PagedKVCache], token_rows: list[list[int]], offsets: list[int] | None, num_rows: int,
               num_blocks: int, with_offsets: bool, block_tokens: int | None = None, num_new: int = 1,
               adapter_slots: list[int] | None = None, with_adapters: bool = False) -> list[list[int]]:
    """A graph's plan on the host: per row [*its ``num_new`` token ids, *plan_rows' row (``num_blocks``
    wide)], then (``with_offsets``, an M-RoPE model's graphs) its rope delta, then (``with_adapters``)
    its adapter slot; padding rows (slot 0, the base model) up to ``num_rows``."""
    block_tokens = block_tokens or kvs[0].block_tokens
    rows = [[*ids, *row] for ids, row in zip(token_rows, plan_rows(kvs, num_new, num_blocks))] if kvs else []
    rows += [[0] * num_new + pad_row(num_new, num_blocks, block_tokens)] * (num_rows - len(kvs))
    padding = [0] * (num_rows - len(kvs))
    if with_offsets:
        rows = [[*row, delta] for row, delta in zip(rows, list(offsets or [0] * len(kvs)) + padding)]
    if with_adapters:
        rows = [[*row, slot] for row, slot in zip(rows, list(adapter_slots or [0] * len(kvs)) + padding)]
    return rows


def graph_step(runner, pool: KVPool, plan: torch.Tensor, with_offsets: bool, num_new: int = 1,
               with_adapters: bool = False) -> torch.Tensor:
    """The step a graph captures, over its ``plan`` (``graph_rows``) -> logits [rows, V] (a decode,
    ``num_new`` 1) or [rows, T, V] (a verify). With adapters, the LoRA bank takes each row's slot from
    the plan for the step (``LoraBank.slot_rows``)."""
    width = plan.shape[1] - with_offsets - with_adapters
    deltas = columns(plan, width, width + 1)[:, 0] if with_offsets else None
    batch = to_batch(plan[:, num_new:width], num_new)
    if not with_adapters:
        logits = runner.forward_paged(pool, columns(plan, 0, num_new), batch, deltas)
    else:
        end = plan.shape[1]
        with runner.lora.slot_rows(columns(plan, end - 1, end)[:, 0]):
            logits = runner.forward_paged(pool, columns(plan, 0, num_new), batch, deltas)
    return logits[:, 0] if num_new == 1 else logits
