"""The one owner of a model's weights and forward passes: ``ModelRunner`` runs a checkpoint over our KV caches.

``session.model.loader`` loads the checkpoint (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, or a plain causal
LM of a family ``session/families/support.py`` admits); the runner runs it with our own attention over our own
KV layout (``session.model.kv_cache``, its pools ``session.model.kv_pool``): image encoding, embedding, prefill
of one sequence's new tokens, a decode step batched across sessions whose contexts have different lengths
(by the path ``session.model.decode_paths`` chose once) and one forward over the paged pool. Projections,
norms, MLPs and rotary embeddings are the checkpoint's own modules, so real weights (and LoRA-wrapped linears)
work unchanged. The functions above the class choose the dtype a runner gets (RESIDENT_DTYPE) and its
default decode attention; ``session.model.devices`` its device (RESIDENT_DEVICE).

Who calls this: the engine loop thread only (session/engine/, and session/speculative/ for a draft
model's runner). Nothing here is thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from session.config import EngineConfig
from session.errors import ConfigError
from session.model.attention import PagedAttention, PagedBatch, choose_backend, plan_rows, to_batch
from session.model.backend import Chunk, DecodeRows, separate_passes
from session.model.cpu import attention as cpu_attention, fused_layer
from session.model.cpu.kernels import cpu_flags
from session.model.decode_paths import BatchedPath, CpuKernelPath, PerRowPath
from session.model.devices import (  # NEURON_MISSING, neuron_found: importable here as before
    NEURON_MISSING as NEURON_MISSING,
    neuron_found as neuron_found,
    resolve_device,
    select_device,
)
from session.model.kv_cache import KVCache, KVPool, PagedKVCache, StaticKVCache, to_device
from session.model.layer_attention import LayerAttention, SpanAttention, run_layers
from session.model.loader import ModelLoader
from session.model.packed_step import packed_step, packing_backend, packs
from session.model.quantize import INT4_DEFAULT_GROUP

if TYPE_CHECKING:
    from session.model.lora_bank import LoraBank

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and NeuronCores, float32 on CPU (the dtype the equivalence tests pin). bfloat16 asked for
    on a CPU without native bfloat16 (AVX512-BF16 or AMX) falls back to float32, which is faster there."""
    if name == "auto":
        return torch.bfloat16 if device.type in ("cuda", "neuron") else torch.float32
    if name == "bfloat16" and device.type == "cpu" and not cpu_has_bf16():
        logger.warning("RESIDENT_DTYPE=bfloat16: this CPU has no AVX512-BF16 or AMX; using float32")
        return torch.float32
    return getattr(torch, name)


def default_attention(device: torch.device) -> str:
    """What RESIDENT_ATTENTION=auto resolves to, the one place it does (a new runner starts with it too).
    CUDA: cuda_graphs (batched, one kernel per layer instead of one per row, replayed from graphs where
    captured; eager until then). CPU: per_row, faster at many sessions (benchmarks/attention_paths.py;
    docs/MEASUREMENTS.md, "Decode attention paths"): SDPA over gathered blocks copies every row's KV
    each step, while a row whose blocks are consecutive is read in place."""
    return "cuda_graphs" if device.type == "cuda" else "per_row"


def cpu_has_bf16() -> bool:
    """Native bfloat16 dot products on this CPU (the flags Linux reports in /proc/cpuinfo)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class ImageEncoder(Protocol):
    """A multimodal transformers model's inner ``model``: what ``encode_images`` calls of it."""

    def get_image_features(self, *args: Any, **kwargs: Any) -> Any: ...


class ModelRunner:
    """Prefill, batched decode and extend of one checkpoint's model over our KV caches (one per engine,
    and one per speculative draft). ``session.model.loader`` builds the model; this class runs it."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", kv_dtype: str = "auto",
                 pack_weights: bool = True, cpu_kernels: bool = True, quantization: str = "auto",
                 activations: str = "float", int4_group: int = INT4_DEFAULT_GROUP):
        self.model_path = model_path
        self.device = resolve_device(device)
        select_device(self.device)  # before any allocation on it (the first CUDA call, "auto"'s probe aside)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = self.dtype if kv_dtype == "auto" else getattr(torch, kv_dtype)  # see RESIDENT_KV_DTYPE
        self.cpu_kernels = cpu_kernels  # RESIDENT_CPU_KERNELS: ours on CPU where they build
        self.loader = ModelLoader(model_path, self.device, self.dtype, cpu_kernels)
        self.checkpoint = self.loader.checkpoint
        loaded = self.loader.load(self._load, pack_weights=pack_weights, quantization=quantization,
                                  activations=activations, int4_group=int4_group)
        self.weights_folder = self.loader.weights_folder  # where they were read from (an AutoAWQ one: converted)
        self.hf_config, self.family, self.model = loaded.hf_config, loaded.family, loaded.model
        self.is_multimodal = self.family.multimodal
        self.mrope = self.family.mrope  # 3-D positions: prefill takes them, decode an offset
        self.merge_size = self.hf_config.vision_config.spatial_merge_size if self.mrope else 1  # M-RoPE image grids
        self.vision_feature_layer, self.vision_select = loaded.vision_feature_layer, loaded.vision_select
        self.lm, self.lm_head, self.layers = loaded.lm, loaded.lm_head, loaded.layers
        self.windows, self.info = loaded.windows, loaded.info  # windows: per layer, None or W keys
        self.quantization, self.gguf, self.compressed = loaded.quantization, loaded.gguf, loaded.compressed
        self.packed_linears, self.linear_kernels = loaded.packed_linears, loaded.linear_kernels
        # decode attention on CPU: our kernel, one call per layer (session/model/cpu/attention.py)
        self.pooled_decode = (cpu_kernels and self.device.type == "cpu" and self.info.head_dim % 16 == 0
                              and cpu_attention.supports(self.kv_dtype))
        self.lora: LoraBank | None = None  # set once enable_lora ran
        self.kv_pools: dict[int, KVPool] = {}  # block_tokens -> the pool of paged caches of that block size
        self.path: PerRowPath  # how decode and extend run: configure_decode, next, sets it
        self.num_passes = 0  # forward passes over the layers run (prefill, decode, extend, packed step)
        self.packed_steps = "auto"  # RESIDENT_PACKED_STEPS (session/model/packed_step.py's packing_backend)
        self.configure_decode("auto")

    def _load(self, hf_config):
        """The checkpoint's model (``ModelLoader.read_model``), called once by the loader; a subclass that
        builds its model in memory overrides this (benchmarks/device_check.py)."""
        return self.loader.read_model(hf_config)

    def enable_lora(self, num_slots: int, max_rank: int):
        """Wrap the language model's linears for per-row LoRA adapters (once, at start-up)."""
        from session.model.lora import LoraBank, install_lora, target_shapes

        shapes = target_shapes(self.layers)
        self.lora = bank = LoraBank(shapes, num_slots, max_rank, self.dtype, self.device)
        ours = self.cpu_kernels and self.device.type == "cpu" and self.dtype in fused_layer.KERNELS
        if ours and fused_layer.load(self.dtype):  # decode rows' deltas by our kernel (csrc/lora.h)
            bank.kernel = fused_layer.op("lora_add", self.dtype)
        install_lora(self.layers, bank)
        return bank, shapes

    def set_adapters(self, slots: list[int] | None) -> None:
        """The adapter slot of each row of the next forward (callers: prefill/decode, static runner)."""
        if self.lora is not None:
            self.lora.set_rows(slots)

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        # compiled graphs (RESIDENT_COMPILE) trace dense weights: dynamo does not take oneDNN's opaque tensors
        return cls(config.model_path, device=config.device, dtype=config.dtype, kv_dtype=config.kv_dtype,
                   pack_weights=config.pack_weights and not config.compile, cpu_kernels=config.cpu_kernels,
                   quantization=config.quantization, activations=config.activations,
                   int4_group=config.int4_group)

    def capture_decode_graphs(self, block_tokens: int, max_tokens: int) -> int:
        """RESIDENT_ATTENTION=cuda_graphs: every decode graph captured now (session/model/cuda_graphs.py,
        ``DecodeGraphs.capture_all``); the number captured, 0 on any other path."""
        graphs = getattr(self.path, "graphs", None)
        if graphs is None:
            return 0
        count = graphs.capture_all(self.kv_pool(block_tokens), max_tokens)
        logger.info("captured %d CUDA graphs of the decode step at start-up", count)
        return count

    def new_kv_cache(self, *, block_tokens: int, max_tokens: int, static: bool = False) -> KVCache:
        """A session's cache: blocks of this runner's pool, or (``static``) one whole fixed buffer."""
        if static:
            i = self.info
            return StaticKVCache(num_layers=i.num_layers, num_kv_heads=i.num_kv_heads, head_dim=i.head_dim,
                                 dtype=self.kv_dtype, device=self.device, max_tokens=max_tokens)
        return self.kv_pool(block_tokens).new_cache(max_tokens)

    def kv_pool(self, block_tokens: int) -> KVPool:
        """The pool of paged caches with blocks of ``block_tokens`` (one per size; the engine uses one size)."""
        pool = self.kv_pools.get(block_tokens)
        if pool is None:
            i = self.info
            pool = self.kv_pools[block_tokens] = KVPool(
                num_layers=i.num_layers, num_kv_heads=i.num_kv_heads, head_dim=i.head_dim, dtype=self.kv_dtype,
                device=self.device, block_tokens=block_tokens)
        return pool

    # ------------------------------------------------------------------ vision

    @torch.inference_mode()
    def encode_images(self, pixels: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]] | None = None,
                      grids: Sequence[tuple[int, int, int]] | None = None) -> list[torch.Tensor]:
        """Each image's pixels -> one [its image tokens, hidden] tensor per image. Per family, an image's
        pixels are: LLaVA-1.5 [3, H, W]; LLaVA-NeXT its own [tiles, 3, tile, tile], with its original
        (height, width) in ``sizes`` (features come back packed: unpadded, ``image_newline`` after each
        row, base tile first); Qwen-VL its [t*h*w, patch values] with its (t, h, w) in ``grids``."""
        encoder = cast(ImageEncoder, self.model.model)
        if self.family.image_tokens == "grid":
            out = encoder.get_image_features(torch.cat(list(pixels)).to(self.device, self.dtype),
                                             torch.tensor(grids, device=self.device))
            return [f.contiguous() for f in out.pooler_output]
        kwargs = {}
        if self.family.image_tokens == "anyres":
            kwargs["image_sizes"] = torch.tensor(sizes, device=self.device)
            pixel_values = torch.cat(list(pixels))
        else:
            pixel_values = torch.stack(list(pixels))
        out = encoder.get_image_features(
            pixel_values=pixel_values.to(self.device, self.dtype),
            vision_feature_layer=self.vision_feature_layer,
            vision_feature_select_strategy=self.vision_select, **kwargs,
        )
        return [f.contiguous() for f in out.pooler_output]

    # ------------------------------------------------------------------ text

    @torch.inference_mode()
    def embed(self, token_ids: list[int], image_embeds: list[torch.Tensor]) -> torch.Tensor:
        """[T] ids -> [T, hidden]; image placeholder positions take ``image_embeds`` in order. The
        placeholders are found in the host's list, not by a mask on the device (a boolean index waits
        for the device to count its hits); ids and positions go over without blocking."""
        embeds = cast(nn.Module, self.lm.embed_tokens)(to_device(token_ids, self.device))
        if image_embeds:
            image_token = self.info.image_token_id
            places = [index for index, token in enumerate(token_ids) if token == image_token]
            embeds.index_copy_(0, to_device(places, self.device), torch.cat(image_embeds).to(embeds.dtype))
        return embeds

    @torch.inference_mode()
    def prefill(self, kv: KVCache, embeds: torch.Tensor, all_logits: bool = False,
                adapter_slot: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``embeds`` [T, hidden] after the ``kv.length`` cached tokens.

        ``positions``: the rotary positions, [T] or M-RoPE's [3, T] (session/families/mrope.py); by default
        ``kv.length ..``. Masks and KV slots follow token indices whatever the positions.
        Returns the last position's logits [V], or with ``all_logits`` every position's [T, V]
        (speculative verification scores all proposed tokens in this one pass).
        """
        start, num_new = kv.length, embeds.shape[0]
        end = start + num_new
        kv.ensure_capacity(end)
        self.num_passes += 1
        self.set_adapters([adapter_slot])
        h = embeds[None]  # [1, T, D]
        if positions is None:
            positions = torch.arange(start, end)
        cos, sin = cast(nn.Module, self.lm.rotary_emb)(h, positions.to(self.device)[..., None, :])  # [1, T] or [3, 1, T]
        # query i (absolute position start+i) sees keys 0 .. start+i; in a sliding-window layer of W,
        # only the last W of them (keys j > start+i-W)
        attention: LayerAttention = self.paged_prefill(kv, num_new) or SpanAttention(
            kv, start, num_new, self.windows, self.device, self.info.grouped_query)
        h = run_layers(self, h, cos, sin, attention)
        kv.length = end
        return self.logits(h)[0] if all_logits else self.logits(h[:, -1:])[0, 0]

    def paged_prefill(self, kv: KVCache, num_new: int) -> PagedAttention | None:
        """A prefill's attention through a FlashAttention kernel reading the session's blocks in place,
        where one reads its pool (session/model/attention.py: CUDA); None elsewhere. One plan copy to
        the device per prefill, none per layer."""
        if not isinstance(kv, PagedKVCache):
            return None
        backend = choose_backend(kv.pool)
        if backend == "sdpa":
            return None
        plan = to_device(plan_rows([kv], num_new)[0], self.device)[None]
        return PagedAttention(kv.pool, to_batch(plan, num_new), self.windows, backend)

    def configure_decode(self, attention: str, batch_buckets: tuple[int, ...] = (), verify_tokens: int = 0,
                         verify_buckets: tuple[int, ...] = ()) -> None:
        """Choose the decode path once (session/engine/assembly.py, at start-up, with RESIDENT_ATTENTION):
        auto, batched, per_row or cuda_graphs (batched, replayed as CUDA graphs per batch bucket, and a
        speculative verify of ``verify_tokens`` a row per ``verify_buckets``; auto picks it on CUDA).
        Per row on a CPU our kernels serve take ``CpuKernelPath``."""
        if attention == "auto":
            attention = default_attention(self.device)
        if attention == "cuda_graphs":
            if self.device.type != "cuda":
                raise ConfigError("RESIDENT_ATTENTION=cuda_graphs needs a CUDA device")
            from session.model.cuda_graphs import DecodeGraphs

            self.path = BatchedPath(self, DecodeGraphs(self, batch_buckets, verify_tokens, verify_buckets))
        elif attention == "batched":
            self.path = BatchedPath(self)
        elif attention == "per_row":
            self.path = CpuKernelPath(self) if self.pooled_decode else PerRowPath(self)
        else:
            raise ConfigError(f"RESIDENT_ATTENTION must be auto, batched, per_row or cuda_graphs, got {attention!r}")

    @property
    def decode_attention(self) -> str:
        """The chosen path's name: "per_row", "cpu_kernel" (per_row where our CPU kernel serves) or "batched"."""
        return self.path.name

    @decode_attention.setter
    def decode_attention(self, attention: str) -> None:
        self.configure_decode(attention)

    @property
    def packs_steps(self) -> bool:
        """``step`` runs a step's parts in one pass (session/model/packed_step.py: on CPU, and on CUDA
        with RESIDENT_PACKED_STEPS=on where a paged FlashAttention kernel reads the pool). False before
        the engine made a pool: a packed pass reads one."""
        return any(packing_backend(self.packed_steps, pool) is not None for pool in self.kv_pools.values())

    @torch.inference_mode()
    def step(self, chunks: Sequence[Chunk], rows: DecodeRows | None) -> torch.Tensor:
        """A whole engine step -> logits [rows + chunks, V] (``Stepper.step``): one packed pass where
        session/model/packed_step.py takes it (``packs``), else the decode step and each chunk's prefill."""
        backend = packs(self, chunks, rows)
        if backend is not None:
            self.num_passes += 1
            return packed_step(self, chunks, rows, backend)
        return separate_passes(self, chunks, rows)

    @property
    def plain_layers(self) -> bool:
        """The layers run as this class writes them (a subclass that changes a layer's arithmetic
        cannot take the C++ layer, which reproduces this one)."""
        return (type(self).attention_inputs is ModelRunner.attention_inputs
                and type(self).finish_layer is ModelRunner.finish_layer)

    @torch.inference_mode()
    def decode(self, kvs: list[KVCache], token_ids: list[int], adapter_slots: list[int] | None = None,
               position_offsets: list[int] | None = None) -> torch.Tensor:
        """One step for B sessions: feed token_ids[b] at position kvs[b].length (plus position_offsets[b],
        an M-RoPE session's rope delta: a generated token is text, the same position in all three rows);
        returns logits [B, V]. How attention runs is the path ``configure_decode`` chose
        (session/model/decode_paths.py)."""
        lengths = [kv.length for kv in kvs]
        for kv, length in zip(kvs, lengths):
            kv.ensure_capacity(length + 1)
        self.num_passes += 1
        self.set_adapters(adapter_slots)
        # host values: see the paths
        offsets = list(position_offsets) if position_offsets is not None and any(position_offsets) else None
        logits = self.path.decode(kvs, token_ids, lengths, offsets, adapter_slots)
        for kv, length in zip(kvs, lengths):
            kv.length = length + 1
        return logits

    def forward_paged(self, pool: KVPool, ids: torch.Tensor, batch: PagedBatch,
                      position_offsets: torch.Tensor | None = None) -> torch.Tensor:
        """ids: [B, T] new tokens of B rows whose caches are in ``pool`` -> logits [B, T, V]. Writes the new
        keys and values where ``batch`` says; dispatches the same operators whatever B and T (no host sync:
        CUDA graphs capture it). ``position_offsets`` [B]: M-RoPE rope deltas added to the rotary positions
        (the masks keep following token indices). Callers: ``decode``, DecodeGraphs; a multi-token verify
        can call it with T > 1."""
        h = cast(nn.Module, self.lm.embed_tokens)(ids)  # [B, T, D]
        positions = batch.positions if position_offsets is None else batch.positions + position_offsets[:, None]
        cos, sin = cast(nn.Module, self.lm.rotary_emb)(h, positions)
        h = run_layers(self, h, cos, sin, PagedAttention(pool, batch, self.windows, choose_backend(pool)))
        return self.logits(h)

    def attention_inputs(self, layer, h, cos, sin):
        """h: [B, T, D] -> rotated q [B, H, T, hd], k and v [B, KVH, T, hd]."""
        attn = layer.self_attn
        batch, num_new, _ = h.shape
        x = layer.input_layernorm(h)
        hd = self.info.head_dim
        q = attn.q_proj(x).view(batch, num_new, -1, hd)
        k = attn.k_proj(x).view(batch, num_new, -1, hd)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head on q and k, before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(batch, num_new, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.kv_dtype != q.dtype:  # attention (and the cache) in kv_dtype (RESIDENT_KV_DTYPE)
            q, k, v = q.to(self.kv_dtype), k.to(self.kv_dtype), v.to(self.kv_dtype)
        return q, k, v

    def finish_layer(self, layer, h, attn_out):
        # attn_out: [B, H, T, hd] -> [B, T, H*hd]
        batch, _, num_new, _ = attn_out.shape
        o = attn_out.transpose(1, 2).reshape(batch, num_new, -1).to(h.dtype)
        h = h + layer.self_attn.o_proj(o)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h):
        return self.lm_head(cast(nn.Module, self.lm.norm)(h)).float()

    @torch.inference_mode()
    def extend(self, kvs: list[KVCache], token_rows: list[list[int]],
               adapter_slots: list[int] | None = None) -> torch.Tensor:
        """Feed token_rows[b] (one or more tokens) after kvs[b].length, for B sessions in ONE pass.

        A batched multi-token decode: speculative verification of several sessions at once (each row
        feeds its last token and its proposals) and the draft's catch-up pass. Returns logits [B, T, V],
        T = the longest row; row b's positions from len(token_rows[b]) on are padding (ignore them).
        Query i of row b (position length_b + i) sees keys 0 .. length_b + i, and in a sliding-window
        layer of W only the last W of them, as in ``prefill``. Attention as ``decode`` runs it.
        """
        lengths = [kv.length for kv in kvs]
        self.num_passes += 1
        self.set_adapters(adapter_slots)
        logits = self.path.extend(kvs, token_rows, lengths, adapter_slots)
        for kv, length, row in zip(kvs, lengths, token_rows):
            kv.length = length + len(row)
        return logits
