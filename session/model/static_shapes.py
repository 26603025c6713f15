"""Fixed-shape prefill and decode: the form static-shape compilers need.

AWS NeuronCores (torch-neuronx) compile one graph per input shape, and ``torch.compile``
without dynamic shapes does the same. Here every tensor shape depends only on buckets:
- KV caches are static: capacity fixed at the context window ``C`` (``StaticKVCache``);
- a prefill pads its new tokens to a prompt bucket ``T`` and attends over all ``C`` positions
  under a mask, so its graph depends on ``(T, C)`` only;
- a decode step pads the batch to a batch bucket ``B`` (padding rows write into a scratch cache)
  and writes the new keys/values at per-row positions given as a tensor (``index_copy_``), so
  its graph depends on ``(B, C)`` only.
This module is the one place with device-specific compilation choices (see ``compile_step``).
It produces the same greedy tokens as the dynamic path (tests pin it).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from session.errors import ConfigError
from session.model.buckets import bucket_for, power_buckets
from session.model.kv_cache import StaticKVCache
from session.model.runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)


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
    return torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)


class StaticShapeRunner:
    """Prefill and batched decode with bucketed, fixed shapes over static KV caches.

    Who calls this: the engine loop thread, instead of ``ModelRunner.prefill/decode``, when
    ``static_kv`` is configured. Owns a scratch cache for padding rows.
    """

    def __init__(self, runner: ModelRunner, capacity: int, *, batch_buckets=DEFAULT_BATCH_BUCKETS,
                 compile: bool = False, compile_backend: str = "inductor"):
        self.runner = runner
        self.capacity = capacity
        self.batch_buckets = tuple(batch_buckets)
        self.prompt_buckets = power_buckets(capacity, smallest=16)
        self.scratch = runner.new_kv_cache(block_tokens=capacity, max_tokens=capacity, static=True)
        self._decode = compile_step(self._decode_graph, runner.device, compile, compile_backend)
        self._prefill = compile_step(self._prefill_graph, runner.device, compile, compile_backend)
        self.graph_shapes: set[tuple] = set()  # (kind, bucket) seen: one compiled graph each

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, kv: StaticKVCache, embeds: torch.Tensor, all_logits: bool = False,
                adapter_slot: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``ModelRunner.prefill``; pads the new tokens to a prompt bucket."""
        _no_mrope(positions)
        self._check(kv)
        start, num_new = kv.length, embeds.shape[0]
        bucket = fixed_bucket(num_new, self.prompt_buckets)
        if start + bucket > self.capacity:  # the padded tail must fit too: fall back to the smallest fit
            bucket = num_new
        padded = torch.zeros(bucket, embeds.shape[1], dtype=embeds.dtype, device=embeds.device)
        padded[:num_new] = embeds
        positions = torch.arange(start, start + bucket, device=self.runner.device)  # [T]
        self.graph_shapes.add(("prefill", bucket))
        self.runner.set_adapters([adapter_slot])
        logits = self._prefill(padded, positions, kv.k, kv.v)  # [T, V]
        kv.length = start + num_new
        return logits[:num_new] if all_logits else logits[num_new - 1]

    def _prefill_graph(self, embeds, positions, k_cache, v_cache):
        # embeds: [T, D]; positions: [T]; k_cache, v_cache: [L, KVH, C, hd]
        runner = self.runner
        h = embeds[None]
        cos, sin = runner.lm.rotary_emb(h, positions[None])
        key_positions = torch.arange(self.capacity, device=positions.device)
        mask = key_positions[None, :] <= positions[:, None]  # [T, C]: causal, and nothing past the new tokens
        for index, layer in enumerate(runner.layers):
            q, k, v = runner.attention_inputs(layer, h, cos, sin)  # q: [1, H, T, hd]; k, v: [1, KVH, T, hd]
            k_cache[index].index_copy_(1, positions, k[0])
            v_cache[index].index_copy_(1, positions, v[0])
            o = F.scaled_dot_product_attention(q, k_cache[index][None], v_cache[index][None], attn_mask=mask,
                                               scale=layer.self_attn.scaling, enable_gqa=_gqa(runner))
            h = runner.finish_layer(layer, h, o)
        return runner.lm_head(runner.lm.norm(h)).float()[0]

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
        pad = bucket - num_rows
        device = self.runner.device
        ids = torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=device)
        positions = torch.tensor([kv.length for kv in kvs] + [0] * pad, dtype=torch.long, device=device)
        caches = kvs + [self.scratch] * pad
        self.graph_shapes.add(("decode", bucket))
        self.runner.set_adapters(None if adapter_slots is None else list(adapter_slots) + [0] * pad)
        logits = self._decode(ids, positions, [c.k for c in caches], [c.v for c in caches])  # [B, V]
        for kv in kvs:
            kv.length += 1
        return logits[:num_rows]

    def _decode_graph(self, ids, positions, k_caches, v_caches):
        # ids, positions: [B]; k_caches[b], v_caches[b]: [L, KVH, C, hd]
        runner = self.runner
        h = runner.lm.embed_tokens(ids)[:, None]  # [B, 1, D]
        cos, sin = runner.lm.rotary_emb(h, positions[:, None])
        key_positions = torch.arange(self.capacity, device=ids.device)
        masks = key_positions[None, :] <= positions[:, None]  # [B, C]
        for index, layer in enumerate(runner.layers):
            q, k, v = runner.attention_inputs(layer, h, cos, sin)  # q: [B, H, 1, hd]
            rows = []
            for b in range(ids.shape[0]):
                k_caches[b][index].index_copy_(1, positions[b : b + 1], k[b])
                v_caches[b][index].index_copy_(1, positions[b : b + 1], v[b])
                rows.append(F.scaled_dot_product_attention(
                    q[b : b + 1], k_caches[b][index][None], v_caches[b][index][None], attn_mask=masks[b][None, :],
                    scale=layer.self_attn.scaling, enable_gqa=_gqa(runner)))  # mask: [C] broadcasts over heads
            h = runner.finish_layer(layer, h, torch.cat(rows))
        return runner.lm_head(runner.lm.norm(h)).float()[:, 0]

    def _check(self, kv: StaticKVCache) -> None:
        if kv.capacity != self.capacity:
            raise ValueError(f"static decoding needs KV caches of capacity {self.capacity}, got {kv.capacity}")


def _gqa(runner: ModelRunner) -> bool:
    return runner.info.num_heads != runner.info.num_kv_heads


def _no_mrope(positions) -> None:
    if positions is not None:  # assembly refuses RESIDENT_STATIC_KV for M-RoPE models at start-up
        raise ConfigError("fixed-shape steps do not implement M-RoPE positions")
