"""Fixed-shape prefill and decode: the form static-shape compilers need.

AWS NeuronCores (TorchNeuron's ``torch.compile(backend="neuron")``) compile one graph per input shape,
and ``torch.compile`` without dynamic shapes does the same. Here every tensor shape depends only on
buckets, and there are few of them:
- KV caches are static: one buffer per session for the context window ``C``, plus ``PAD_TOKENS``
  positions past it that padding rows may write and nothing reads (``StaticKVCache``);
- attention reads a KV-length bucket ``L`` of the buffer, not all of it: powers of two from
  ``KV_SEGMENT`` (512) up, then the whole buffer, the smallest that holds the step's last position;
  a 20-token follow-up at position 600 of a 4,096-token window reads 1,024 positions, not 4,112;
- a prefill pads its new tokens to a prompt bucket ``T`` (powers of two from 16 up to the longest
  prefill a step feeds) and attends over ``L`` under a mask, so its graph depends on ``(T, L)``. A
  prompt longer than the largest bucket, or one whose padding would pass the buffer, runs in pieces
  that are each a bucket (``_piece``), so no step ever has a shape outside the buckets;
- a decode step pads the batch to a batch bucket ``B`` (padding rows read the first row's cache)
  and its graph depends on ``(B, L)``. The graph only reads the caches: it attends over each row's
  cached positions and, apart, its new key, and returns the new keys/values, which the caller
  writes. A graph that mutated its inputs would be compiled for one aliasing of them (torch 2.13's
  AOTAutograd bakes which inputs share storage into the graph, with no guard: compiled with aliased
  padding rows and run with distinct sessions, it wrote the wrong rows).
With compilation on, ``compile_all`` runs every (T, L) and (B, L) once at start-up, largest first, so
serving never compiles (a persistent compile cache makes later start-ups fast: TorchNeuron's, or
inductor's). This module is the one place with device-specific compilation choices (``compile_step``).
It produces the same greedy tokens as the dynamic path (tests pin it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from session.errors import ConfigError
from session.model.backend import Chunk, DecodeRows, Stepper, separate_passes
from session.model.buckets import bucket_for, power_buckets
from session.model.kv_cache import STATIC_PAD_TOKENS, StaticKVCache
from session.model.layer_attention import run_layers
from session.model.runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
PAD_TOKENS = STATIC_PAD_TOKENS  # the smallest prompt bucket: a padded piece never passes the buffer
KV_SEGMENT = 512  # the shortest KV-length bucket (TorchNeuron's attention reads KV in segments of 512-4096)


def kv_buckets(capacity: int) -> tuple[int, ...]:
    """KV-length buckets of a ``capacity``-token window: powers of two from KV_SEGMENT below it, then
    the whole buffer (the window and its padding positions)."""
    return (*power_buckets(capacity, smallest=min(KV_SEGMENT, capacity))[:-1], capacity + PAD_TOKENS)


def fixed_bucket(size: int, buckets: tuple[int, ...]) -> int:
    """The bucket a fixed-shape step of ``size`` runs in; ValueError past the largest."""
    bucket = bucket_for(size, buckets)
    if bucket is None:
        raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")
    return bucket


def compile_step(fn, device: torch.device, enabled: bool, backend: str = "inductor"):
    """``torch.compile`` with static shapes where asked: one whole graph per bucket (``fullgraph``: a
    graph break is an error, not a silent slow path). ``backend`` is any torch.compile backend:
    inductor on CPU/CUDA, aot_eager in tests, the Neuron SDK's ``neuron`` on NeuronCores
    (RESIDENT_COMPILE_BACKEND; docker/Dockerfile.neuron sets it)."""
    if not enabled:
        return fn
    check_backend(backend)
    return torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)


def check_backend(backend: str) -> None:
    """Refuse at start-up, naming what is missing, a torch.compile backend this Python does not have
    (the first compile would fail while serving): above all ``neuron``, which only TorchNeuron registers."""
    import torch._dynamo

    if backend in torch._dynamo.list_backends(exclude_tags=()):
        return
    if backend == "neuron":
        from session.model.runner import NEURON_MISSING, neuron_found

        raise ConfigError(NEURON_MISSING.format(what="RESIDENT_COMPILE_BACKEND=neuron", found=neuron_found()))
    raise ConfigError(f"RESIDENT_COMPILE_BACKEND={backend}: torch.compile has no such backend here "
                      f"(it has {', '.join(sorted(torch._dynamo.list_backends()))})")


class StaticShapeRunner:
    """Prefill and batched decode with bucketed, fixed shapes over static KV caches.

    Who calls this: the engine loop thread, instead of ``ModelRunner.prefill/decode``, when
    ``static_kv`` is configured.
    """

    def __init__(self, runner: ModelRunner, capacity: int, *, batch_buckets=DEFAULT_BATCH_BUCKETS,
                 compile: bool = False, compile_backend: str = "inductor", max_prompt_tokens: int = 0):
        self.runner = runner
        self.capacity = capacity
        self.batch_buckets = tuple(batch_buckets)
        # the longest prefill a step feeds (RESIDENT_STEP_TOKEN_BUDGET): longer ones run in pieces
        self.prompt_buckets = power_buckets(min(capacity, max_prompt_tokens or capacity), smallest=PAD_TOKENS)
        self.kv_buckets = kv_buckets(capacity)
        self.compiled = compile
        self._decode = compile_step(self._decode_graph, runner.device, compile, compile_backend)
        self._prefill = compile_step(self._prefill_graph, runner.device, compile, compile_backend)
        if compile:  # one graph per shape, each a "recompile" to dynamo: let every bucket have one
            import torch._dynamo

            needed = len(self.all_shapes()) + 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, needed)
        self.graph_shapes: set[tuple] = set()  # (kind, bucket, KV bucket) seen: one compiled graph each

    def all_shapes(self) -> list[tuple[str, int, int]]:
        """Every shape a step can take, largest first: ("prefill", T, L) with T <= L, ("decode", B, L)."""
        prefill = [("prefill", t, length) for length in self.kv_buckets for t in self.prompt_buckets if t <= length]
        decode = [("decode", b, length) for length in self.kv_buckets for b in self.batch_buckets]
        return sorted(prefill + decode, key=lambda shape: (shape[2], shape[1]), reverse=True)

    @torch.inference_mode()
    def compile_all(self) -> int:
        """Run every shape once on a scratch cache, freed after (start-up, when compiling: serving then
        never compiles); how many."""
        with torch.inference_mode(False):  # a tensor as the sessions' caches are (dynamo guards its dispatch keys)
            scratch = self.runner.new_kv_cache(block_tokens=self.capacity, max_tokens=self.capacity, static=True)
        assert isinstance(scratch, StaticKVCache)  # static=True: one whole buffer, whose views each shape takes
        hidden = self.runner.info.hidden_size
        device, dtype = self.runner.device, self.runner.dtype
        self.runner.set_adapters(None)
        for kind, size, length in self.all_shapes():
            views = scratch.k[:, :, :length], scratch.v[:, :, :length]
            if kind == "prefill":
                positions = torch.arange(length - size, length, device=device)
                self._prefill(torch.zeros(size, hidden, dtype=dtype, device=device), positions, *views)
            else:
                positions = torch.full((size,), length - 1, dtype=torch.long, device=device)
                ids = torch.zeros(size, dtype=torch.long, device=device)
                self._decode(ids, positions, [scratch.k[:, :, :length] for _ in range(size)],
                             [scratch.v[:, :, :length] for _ in range(size)])  # a view each, as serving passes
            self.graph_shapes.add((kind, size, length))
        return len(self.graph_shapes)

    packs_steps = False  # a fixed shape per part: its passes run apart

    def step(self, chunks: Sequence[Chunk], rows: DecodeRows | None) -> torch.Tensor:
        """``Stepper.step``: fixed shapes take a pass per part (the decode step, each chunk's prefill)."""
        return separate_passes(cast(Stepper, self), chunks, rows)  # its caches: static ones

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, kv: StaticKVCache, embeds: torch.Tensor, all_logits: bool = False,
                adapter_slot: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``ModelRunner.prefill``; runs in pieces of bucket shapes (``_piece``)."""
        _no_mrope(positions)
        self._check(kv)
        start, num_new = kv.length, embeds.shape[0]
        if start + num_new > self.capacity:
            raise ValueError(f"KV cache cannot hold {start + num_new} tokens (max {self.capacity})")
        self.runner.set_adapters([adapter_slot])
        outputs, done = [], 0
        while done < num_new:
            piece, bucket = self._piece(start + done, num_new - done)
            logits = self._prefill_piece(kv, start + done, embeds[done: done + piece], bucket)  # [bucket, V]
            outputs.append(logits[:piece] if all_logits else logits[piece - 1: piece])
            done += piece
        kv.length = start + num_new
        return torch.cat(outputs) if all_logits else outputs[-1][0]

    def _piece(self, start: int, remaining: int) -> tuple[int, int]:
        """(tokens, their prompt bucket) of the next piece of a prefill at ``start``: all that remain,
        padded to their bucket, where that bucket fits the buffer; else the largest bucket that fits
        both, unpadded. The buffer's PAD_TOKENS past the window make the smallest always fit."""
        room = self.capacity + PAD_TOKENS - start
        bucket = bucket_for(remaining, self.prompt_buckets)
        if bucket is not None and bucket <= room:
            return remaining, bucket
        fit = max(b for b in self.prompt_buckets if b <= min(remaining, room))
        return fit, fit

    def _prefill_piece(self, kv: StaticKVCache, start: int, embeds: torch.Tensor, bucket: int) -> torch.Tensor:
        num_new = embeds.shape[0]
        padded = torch.zeros(bucket, embeds.shape[1], dtype=embeds.dtype, device=embeds.device)
        padded[:num_new] = embeds
        positions = torch.arange(start, start + bucket, device=self.runner.device)  # [T]
        length = fixed_bucket(start + bucket, self.kv_buckets)
        self.graph_shapes.add(("prefill", bucket, length))
        return self._prefill(padded, positions, kv.k[:, :, :length], kv.v[:, :, :length])

    def _prefill_graph(self, embeds, positions, k_cache, v_cache):
        # embeds: [T, D]; positions: [T]; k_cache, v_cache: [layers, KVH, L, hd] (a KV-length bucket's view)
        runner = self.runner
        lm = _decoder_stack(runner)
        h = embeds[None]
        cos, sin = lm.rotary_emb(h, positions[None])
        key_positions = torch.arange(k_cache.shape[2], device=positions.device)
        mask = key_positions[None, :] <= positions[:, None]  # [T, L]: causal, and nothing past the new tokens

        def attention(index, layer, q, k, v):  # q: [1, H, T, hd]; k, v: [1, KVH, T, hd]
            k_cache[index].index_copy_(1, positions, k[0])
            v_cache[index].index_copy_(1, positions, v[0])
            return F.scaled_dot_product_attention(q, k_cache[index][None], v_cache[index][None], attn_mask=mask,
                                                  scale=layer.self_attn.scaling, enable_gqa=runner.info.grouped_query)

        h = run_layers(runner, h, cos, sin, attention)
        return runner.lm_head(lm.norm(h)).float()[0]

    # ------------------------------------------------------------------ decode

    @torch.inference_mode()
    def decode(self, kvs: list[StaticKVCache], token_ids: list[int], adapter_slots: list[int] | None = None,
               position_offsets: list[int] | None = None) -> torch.Tensor:
        """Same contract as ``ModelRunner.decode``; pads the batch to a batch bucket."""
        _no_mrope(position_offsets if any(position_offsets or ()) else None)
        for kv in kvs:
            self._check(kv)
            if kv.length + 1 > self.capacity:
                raise ValueError(f"KV cache cannot hold {kv.length + 1} tokens (max {self.capacity})")
        num_rows = len(kvs)
        bucket = fixed_bucket(num_rows, self.batch_buckets)
        length = fixed_bucket(max(kv.length for kv in kvs) + 1, self.kv_buckets)
        pad = bucket - num_rows
        device = self.runner.device
        ids = torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=device)
        positions = torch.tensor([kv.length for kv in kvs] + [0] * pad, dtype=torch.long, device=device)
        caches = kvs + kvs[:1] * pad  # padding rows read the first row's cache (the graph never writes it)
        self.graph_shapes.add(("decode", bucket, length))
        self.runner.set_adapters(None if adapter_slots is None else list(adapter_slots) + [0] * pad)
        logits, new_k, new_v = self._decode(ids, positions, [c.k[:, :, :length] for c in caches],
                                            [c.v[:, :, :length] for c in caches])  # [B, V], [layers, B, KVH, hd]
        for row, kv in enumerate(kvs):
            kv.k[:, :, kv.length] = new_k[:, row]
            kv.v[:, :, kv.length] = new_v[:, row]
            kv.length += 1
        return logits[:num_rows]

    def _decode_graph(self, ids, positions, k_caches, v_caches):
        # ids, positions: [B]; k_caches[b], v_caches[b]: [layers, KVH, L, hd] (a KV-length bucket's
        # view), read only -> logits [B, V] and the step's keys and values [layers, B, KVH, hd]
        runner = self.runner
        lm = _decoder_stack(runner)
        h = lm.embed_tokens(ids)[:, None]  # [B, 1, D]
        cos, sin = lm.rotary_emb(h, positions[:, None])
        key_positions = torch.arange(k_caches[0].shape[2], device=ids.device)
        masks = key_positions[None, :] < positions[:, None]  # [B, L]: the cached positions before each row's
        new_k, new_v = [], []

        def attention(index, layer, q, k, v):  # q: [B, H, 1, hd]; k, v: [B, KVH, 1, hd]; the caches read only
            new_k.append(k[:, :, 0])
            new_v.append(v[:, :, 0])
            return torch.stack([_attend(q[b], k_caches[b][index], v_caches[b][index], masks[b], k[b], v[b],
                                        layer.self_attn.scaling) for b in range(ids.shape[0])])

        h = run_layers(runner, h, cos, sin, attention)
        return runner.lm_head(lm.norm(h)).float()[:, 0], torch.stack(new_k), torch.stack(new_v)

    def _check(self, kv: StaticKVCache) -> None:
        if kv.capacity != self.capacity:
            raise ValueError(f"static decoding needs KV caches of capacity {self.capacity}, got {kv.capacity}")


def _attend(q, k_cache, v_cache, mask, k_new, v_new, scale: float) -> torch.Tensor:
    """One decode row's attention over its cached keys (under ``mask``) and its own new key, without
    writing the cache: q [H, 1, hd]; k_cache, v_cache [KVH, L, hd]; mask [L]; k_new, v_new [KVH, 1, hd]
    -> [H, 1, hd]. Query head h reads KV head h // (H / KVH), as transformers' repeat_kv does."""
    heads, _, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    grouped = q.reshape(kv_heads, heads // kv_heads, head_dim)  # [KVH, G, hd]
    cached = torch.matmul(grouped, k_cache.transpose(1, 2)) * scale  # [KVH, G, L]
    cached = cached.masked_fill(~mask, float("-inf"))
    own = (grouped * k_new).sum(-1, keepdim=True) * scale  # [KVH, G, 1]
    weights = torch.softmax(torch.cat([cached, own], -1).float(), -1).to(v_cache.dtype)
    out = torch.matmul(weights[..., :-1], v_cache) + weights[..., -1:] * v_new  # [KVH, G, hd]
    return out.reshape(heads, 1, head_dim)


def _decoder_stack(runner: ModelRunner) -> Any:
    """The runner's decoder stack, transformers' module: its parts (embed_tokens, rotary_emb, norm) are its
    class's own, which torch's ``nn.Module`` typing cannot name."""
    return runner.lm


def _no_mrope(positions) -> None:
    if positions is not None:  # assembly refuses RESIDENT_STATIC_KV for M-RoPE models at start-up
        raise ConfigError("fixed-shape steps do not implement M-RoPE positions")
