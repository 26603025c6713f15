"""The one owner of model weights and forward passes.

Loads a Hugging Face checkpoint by path (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, or a plain
causal LM of a family ``session/families/support.py`` admits) and runs it with our own attention over our own
KV layout (``session.model.kv_cache``): prefill of one sequence's new tokens, and a decode step batched
across sessions whose contexts have different lengths. Projections, norms, MLPs and rotary embeddings are the
checkpoint's own modules, so real weights (and LoRA-wrapped linears) work unchanged.

Who calls this: the engine loop thread only. Nothing here is thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from session.config import EngineConfig
from session.errors import ConfigError
from session.families.support import check_supported
from session.model.attention import PagedAttention, PagedBatch, choose_backend, columns, plan_rows, to_batch
from session.model.cpu import attention as cpu_attention, fused_layer, linear as cpu_linear
from session.model.cpu.kernels import cpu_flags
from session.model.cpu.packed_linear import can_pack, pack_linears
from session.model.kv_cache import PAD_BLOCK, BlockPool, KVCache, PagedKVCache, StaticKVCache

logger = logging.getLogger(__name__)

# The vision-language model types the runner loads, and their transformers classes (session/families/support.py
# decides what is admitted).
VLM_CLASSES = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
               "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl")  # 3-D positions (session/families/mrope.py): prefill takes them, decode an offset


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    image_token_id: int | None  # None for text-only models
    num_image_tokens: int  # placeholder tokens every image expands to; 0 where it varies (session/families/vision.py)


def attention_windows(text_config, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (keys it attends to, counting its own), or None for full attention:
    from ``layer_types`` where the config has them, else Mistral's model-wide ``sliding_window``."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types[:num_layers]]
    if text_config.model_type == "mistral" and window:
        return [window] * num_layers
    return [None] * num_layers


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on CPU (the dtype the equivalence tests pin). bfloat16 asked for
    on a CPU without native bfloat16 (AVX512-BF16 or AMX) falls back to float32, which is faster there."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bfloat16" and device.type == "cpu" and not cpu_has_bf16():
        logger.warning("RESIDENT_DTYPE=bfloat16: this CPU has no AVX512-BF16 or AMX; using float32")
        return torch.float32
    return getattr(torch, name)


def default_attention(device: torch.device) -> str:
    """The decode attention a device gets unless RESIDENT_ATTENTION says otherwise. CUDA: batched (one
    kernel per layer instead of one per row). CPU: per_row, measured 2x faster at 16 sessions
    (benchmarks/attention_paths.py, docs/ENGINE.md): SDPA over gathered blocks copies every row's KV
    each step, while a row whose blocks are consecutive is read in place."""
    return "batched" if device.type == "cuda" else "per_row"


def cpu_has_bf16() -> bool:
    """Native bfloat16 dot products on this CPU (the flags Linux reports in /proc/cpuinfo)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class ModelRunner:
    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", kv_dtype: str = "auto",
                 pack_weights: bool = True, cpu_kernels: bool = True):
        from transformers import AutoConfig

        self.model_path = model_path
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = self.dtype if kv_dtype == "auto" else getattr(torch, kv_dtype)  # see RESIDENT_KV_DTYPE
        hf_config = AutoConfig.from_pretrained(model_path)
        check_supported(hf_config)  # refuse, naming the feature, before any weight is read
        self.hf_config = hf_config
        self.is_multimodal = hf_config.model_type in VLM_CLASSES
        text_config = hf_config.text_config if self.is_multimodal else hf_config
        self.model = self._load(model_path, hf_config)
        self.mrope = hf_config.model_type in MROPE_TYPES
        self.merge_size = hf_config.vision_config.spatial_merge_size if self.mrope else 1  # M-RoPE image grids
        if self.is_multimodal:
            self.lm = self.model.model.language_model
            self.vision_feature_layer = getattr(hf_config, "vision_feature_layer", None)  # LLaVA's
            self.vision_select = getattr(hf_config, "vision_feature_select_strategy", None)
        else:
            self.lm = self.model.model
        self.lm_head = self.model.lm_head
        self.layers = list(self.lm.layers)
        self.packed_linears, self.linear_kernels = self._pack_linears(pack_weights, cpu_kernels)
        self.windows = attention_windows(text_config, len(self.layers))  # per layer: None or W keys
        self.info = self._info(hf_config, text_config)
        # decode attention on CPU: our kernel, one call per layer (session/model/cpu/attention.py)
        self.pooled_decode = (cpu_kernels and self.device.type == "cpu" and self.info.head_dim % 16 == 0
                              and cpu_attention.supports(self.kv_dtype))
        self.lora = None  # a LoraBank once enable_lora ran
        self._lora_cached: tuple | None = None  # (rows' adapters, bank version) -> _lora_arguments' tensors
        self.cpu_kernels = cpu_kernels
        self.fused_layers: list[tuple] | None | bool = False  # False: not planned yet (_fused_plan)
        self.decode_stack: fused_layer.Stack | None | bool = False  # False: not planned yet (_decode_stack)
        self.kv_pools: dict[int, BlockPool] = {}  # block_tokens -> the pool of paged caches of that block size
        self.decode_attention = default_attention(self.device)  # "batched" or "per_row" (configure_decode)
        self.graphs = None  # DecodeGraphs once configure_decode turned CUDA graphs on

    def _pack_linears(self, pack_weights: bool, cpu_kernels: bool) -> tuple[int, dict[str, int]]:
        """Prepack the language model's linears once: (how many, how many by what). On CPU (bfloat16,
        float32): our kernel (session/model/cpu/linear.py) where it builds and reproduces oneDNN's product, oneDNN's
        packed weights (session/model/cpu/packed_linear.py) for the rest; unpacked ones run dense ``F.linear``."""
        if not (pack_weights and can_pack(self.device, self.dtype)):
            return 0, {}
        modules = self.layers + [self.lm_head]
        ours = 0
        if cpu_kernels:
            ours, why = cpu_linear.pack_linears(modules, self.dtype)
            if why:
                logger.info("%s linears on oneDNN: %s", self.dtype, why)
        onednn = pack_linears(modules)  # whatever ours did not take
        return ours + onednn, {"resident": ours, "onednn": onednn}

    def enable_lora(self, num_slots: int, max_rank: int):
        """Wrap the language model's linears for per-row LoRA adapters (once, at start-up)."""
        from session.model.lora import LoraBank, install_lora, target_shapes

        shapes = target_shapes(self.layers)
        self.lora = LoraBank(shapes, num_slots, max_rank, self.dtype, self.device)
        ours = self.cpu_kernels and self.device.type == "cpu" and self.dtype in fused_layer.KERNELS
        if ours and fused_layer.load(self.dtype):  # decode rows' deltas by our kernel (csrc/lora.h)
            self.lora.kernel = fused_layer.op("lora_add", self.dtype)
        install_lora(self.layers, self.lora)
        return self.lora, shapes

    def set_adapters(self, slots: list[int] | None) -> None:
        """The adapter slot of each row of the next forward (callers: prefill/decode, static runner)."""
        if self.lora is not None:
            self.lora.set_rows(slots)

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        # compiled graphs (RESIDENT_COMPILE) trace dense weights: dynamo does not take oneDNN's opaque tensors
        return cls(config.model_path, device=config.device, dtype=config.dtype, kv_dtype=config.kv_dtype,
                   pack_weights=config.pack_weights and not config.compile, cpu_kernels=config.cpu_kernels)

    def _load(self, path: str, hf_config):
        import transformers

        cls = getattr(transformers, VLM_CLASSES.get(hf_config.model_type, "AutoModelForCausalLM"))
        model = cls.from_pretrained(path, dtype=self.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def _info(self, hf_config, text_config) -> ModelInfo:
        attn = self.layers[0].self_attn
        eos = text_config.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos_ids = {e for e in (eos, gen_eos) for e in (e if isinstance(e, list) else [e]) if e is not None}
        num_image_tokens = 0
        if hf_config.model_type == "llava":  # llava_next: a count per image (anyres)
            vc = hf_config.vision_config
            num_image_tokens = (vc.image_size // vc.patch_size) ** 2 + (self.vision_select == "full")
        return ModelInfo(
            num_layers=len(self.layers), num_heads=text_config.num_attention_heads,
            num_kv_heads=text_config.num_key_value_heads, head_dim=attn.head_dim,
            hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
            max_positions=text_config.max_position_embeddings, eos_token_ids=tuple(sorted(eos_ids)),
            image_token_id=hf_config.image_token_id if self.is_multimodal else None,
            num_image_tokens=num_image_tokens,
        )

    def new_kv_cache(self, *, block_tokens: int, max_tokens: int, static: bool = False) -> KVCache:
        """A session's cache: blocks of this runner's pool, or (``static``) one whole fixed buffer."""
        if static:
            i = self.info
            return StaticKVCache(num_layers=i.num_layers, num_kv_heads=i.num_kv_heads, head_dim=i.head_dim,
                                 dtype=self.kv_dtype, device=self.device, max_tokens=max_tokens)
        return self.kv_pool(block_tokens).new_cache(max_tokens)

    def kv_pool(self, block_tokens: int) -> BlockPool:
        """The pool of paged caches with blocks of ``block_tokens`` (one per size; the engine uses one size)."""
        pool = self.kv_pools.get(block_tokens)
        if pool is None:
            i = self.info
            pool = self.kv_pools[block_tokens] = BlockPool(
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
        model_type = self.hf_config.model_type
        if model_type in MROPE_TYPES:
            out = self.model.model.get_image_features(torch.cat(list(pixels)).to(self.device, self.dtype),
                                                      torch.tensor(grids, device=self.device))
            return [f.contiguous() for f in out.pooler_output]
        kwargs = {}
        if model_type == "llava_next":
            kwargs["image_sizes"] = torch.tensor(sizes, device=self.device)
            pixel_values = torch.cat(list(pixels))
        else:
            pixel_values = torch.stack(list(pixels))
        out = self.model.model.get_image_features(
            pixel_values=pixel_values.to(self.device, self.dtype),
            vision_feature_layer=self.vision_feature_layer,
            vision_feature_select_strategy=self.vision_select, **kwargs,
        )
        return [f.contiguous() for f in out.pooler_output]

    # ------------------------------------------------------------------ text

    @torch.inference_mode()
    def embed(self, token_ids: list[int], image_embeds: list[torch.Tensor]) -> torch.Tensor:
        """[T] ids -> [T, hidden]; image placeholder positions take ``image_embeds`` in order."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        embeds = self.lm.embed_tokens(ids)
        if image_embeds:
            mask = ids == self.info.image_token_id
            embeds[mask] = torch.cat(image_embeds).to(embeds.dtype)
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
        self.set_adapters([adapter_slot])
        h = embeds[None]  # [1, T, D]
        if positions is None:
            positions = torch.arange(start, end)
        cos, sin = self.lm.rotary_emb(h, positions.to(self.device)[..., None, :])  # [1, T] or [3, 1, T]
        # query i (absolute position start+i) sees keys 0 .. start+i; in a sliding-window layer of W,
        # only the last W of them (keys j > start+i-W)
        causal = torch.ones(num_new, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        masks = {w: causal if w is None else causal.triu(diagonal=start - w + 1) for w in set(self.windows)}
        gqa = self.info.num_heads != self.info.num_kv_heads
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            window = self.windows[index]
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [1, H, T, hd]; k, v: [1, KVH, T, hd]
            kv.write(index, start, k[0], v[0])
            if self._in_place(kv, window):  # the cache's runs of blocks in place, however it grew
                o = attend_runs(q, kv.runs(index, 0, end), attn.scaling, gqa, masks[window])
            else:
                o = F.scaled_dot_product_attention(q, kv.keys(index, end)[None], kv.values(index, end)[None],
                                                   attn_mask=masks[window], scale=attn.scaling, enable_gqa=gqa)
            h = self.finish_layer(layer, h, o)
        kv.length = end
        return self._logits(h)[0] if all_logits else self._logits(h[:, -1:])[0, 0]

    def _in_place(self, kv: KVCache, window: int | None) -> bool:
        """Attend over a paged cache's runs of blocks in place (``attend_runs``) rather than a gathered
        copy: on CPU, in layers without a sliding window (whose masks can hide a whole run from a query)."""
        return self.device.type == "cpu" and window is None and isinstance(kv, PagedKVCache)

    def configure_decode(self, attention: str, batch_buckets: tuple[int, ...]) -> None:
        """Called once at start-up (session/engine/assembly.py) with RESIDENT_ATTENTION: auto, batched, per_row or
        cuda_graphs (batched, replayed as CUDA graphs per batch bucket; auto picks it on CUDA)."""
        if attention == "auto":
            attention = "cuda_graphs" if self.device.type == "cuda" else default_attention(self.device)
        if attention == "cuda_graphs":
            if self.device.type != "cuda":
                raise ConfigError("RESIDENT_ATTENTION=cuda_graphs needs a CUDA device")
            from session.model.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, batch_buckets)
            attention = "batched"
        self.decode_attention = attention

    @torch.inference_mode()
    def decode(self, kvs: list[KVCache], token_ids: list[int], adapter_slots: list[int] | None = None,
               position_offsets: list[int] | None = None) -> torch.Tensor:
        """One step for B sessions: feed token_ids[b] at position kvs[b].length (plus position_offsets[b],
        an M-RoPE session's rope delta: a generated token is text, the same position in all three rows);
        returns logits [B, V].

        Batched (CUDA's default, see ``default_attention``): one attention call per layer for all rows
        over the paged pool (session/model/attention.py), replayed from a CUDA graph per batch bucket where
        configured. Per row (CPU's default): each row attends over its own blocks in place.
        """
        lengths = [kv.length for kv in kvs]
        for kv, length in zip(kvs, lengths):
            kv.ensure_capacity(length + 1)
        self.set_adapters(adapter_slots)
        offsets = None if not any(position_offsets or ()) else torch.tensor(position_offsets, device=self.device)
        if self.decode_attention == "per_row":
            logits = self._decode_per_row(kvs, token_ids, lengths, offsets)
        elif self.graphs is not None and not any(adapter_slots or ()) and offsets is None and self.graphs.fits(kvs):
            logits = self.graphs.run(kvs, token_ids)  # graphs hold the base model at plain positions only
        else:
            plan = torch.tensor([[t, *row] for t, row in zip(token_ids, plan_rows(kvs, 1))], device=self.device)
            logits = self.forward_paged(kvs[0].pool, columns(plan, 0, 1), to_batch(plan[:, 1:], 1), offsets)[:, 0]
        for kv, length in zip(kvs, lengths):
            kv.length = length + 1
        return logits

    def forward_paged(self, pool: BlockPool, ids: torch.Tensor, batch: PagedBatch,
                      position_offsets: torch.Tensor | None = None) -> torch.Tensor:
        """ids: [B, T] new tokens of B rows whose caches are in ``pool`` -> logits [B, T, V]. Writes the new
        keys and values where ``batch`` says; dispatches the same operators whatever B and T (no host sync:
        CUDA graphs capture it). ``position_offsets`` [B]: M-RoPE rope deltas added to the rotary positions
        (the masks keep following token indices). Callers: ``decode``, DecodeGraphs; a multi-token verify
        can call it with T > 1."""
        h = self.lm.embed_tokens(ids)  # [B, T, D]
        positions = batch.positions if position_offsets is None else batch.positions + position_offsets[:, None]
        cos, sin = self.lm.rotary_emb(h, positions)
        attention = PagedAttention(pool, batch, self.windows, choose_backend(pool))
        for index, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [B, H, T, hd]; k, v: [B, KVH, T, hd]
            o = attention(index, q, k, v, window=self.windows[index], scale=layer.self_attn.scaling)
            h = self.finish_layer(layer, h, o)
        return self._logits(h)

    def _step_inputs(self, token_ids: list[int], lengths: list[int], position_offsets: torch.Tensor | None):
        """A decode step's embeddings h [B, 1, D] and rotary cos/sin at positions lengths[b] (+ offsets)."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        h = self.lm.embed_tokens(ids)[:, None]  # [B, 1, D]
        positions = torch.tensor(lengths, device=self.device)
        if position_offsets is not None:
            positions = positions + position_offsets
        cos, sin = self.lm.rotary_emb(h, positions[:, None])
        return h, cos, sin

    def _step_slots(self, kvs: list[KVCache], lengths: list[int]) -> torch.Tensor:
        """[B, 1]: the pool slot of each row's new token (at position lengths[b])."""
        return torch.tensor([kv.slots(length, length + 1) for kv, length in zip(kvs, lengths)], device=self.device)

    @staticmethod
    def _window_start(window: int | None, length: int) -> int:
        """The first key a decode query at position ``length`` sees: 0, or in a sliding window of W the
        last W keys, its own included."""
        return 0 if window is None else max(0, length + 1 - window)

    def _decode_per_row(self, kvs: list[PagedKVCache], token_ids: list[int], lengths: list[int],
                        position_offsets: torch.Tensor | None) -> torch.Tensor:
        # Projections and MLPs run batched; attention runs per row over that session's own cache view.
        pool, one_pool = kvs[0].pool, self._one_pool(kvs)
        if self.pooled_decode and one_pool and pool.head_major:
            return self._decode_pooled(kvs, token_ids, lengths, position_offsets)
        h, cos, sin = self._step_inputs(token_ids, lengths, position_offsets)
        gqa = self.info.num_heads != self.info.num_kv_heads
        slots = self._step_slots(kvs, lengths)
        row_runs = {}  # window -> _runs_of_rows: built once per step, not once per layer
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [B, H, 1, hd]; k, v: [B, KVH, 1, hd]
            rows = []
            window = self.windows[index]
            if one_pool:
                pool.write_rows(index, slots, k, v)
            for b, (kv, length) in enumerate(zip(kvs, lengths)):
                if not one_pool:
                    kv.write(index, length, k[b], v[b])
                if self.device.type == "cpu":  # the session's blocks in place, however it grew
                    if window not in row_runs:
                        starts = [self._window_start(window, n) for n in lengths]
                        row_runs[window] = self._runs_of_rows(kvs, starts, [n + 1 for n in lengths])
                    runs = [(keys[index], values[index]) for keys, values in row_runs[window][b]]
                    rows.append(attend_runs(q[b : b + 1], runs, attn.scaling, gqa))
                    continue
                first = self._window_start(window, length)
                rows.append(F.scaled_dot_product_attention(
                    q[b : b + 1], kv.keys(index, length + 1)[None, :, first:],
                    kv.values(index, length + 1)[None, :, first:], scale=attn.scaling, enable_gqa=gqa,
                ))
            h = self.finish_layer(layer, h, torch.cat(rows) if len(rows) > 1 else rows[0])
        return self._logits(h)[:, 0]

    def _decode_pooled(self, kvs: list[PagedKVCache], token_ids: list[int], lengths: list[int],
                       position_offsets: torch.Tensor | None) -> torch.Tensor:
        """The per-row step with attention by our CPU kernel (bfloat16, float32): every row of a layer in one call,
        reading the head-major pool through the rows' block tables (session/model/cpu/attention.py). Row b
        feeds token_ids[b] at position lengths[b] of kvs[b]'s sequence; a sequence may own several rows
        at consecutive positions (``extend``): each attends up to its own position, as its decode step
        would, and every linear sums as for one row (session/model/cpu/linear.py)."""
        pool = kvs[0].pool
        width = max(len(kv.block_ids) for kv in kvs)
        table = torch.tensor([kv.block_ids + [PAD_BLOCK] * (width - len(kv.block_ids)) for kv in kvs],
                             dtype=torch.int32)
        fused = self._fused_plan()
        stack = self._decode_stack() if fused is not None and position_offsets is None else None
        if stack is not None and max(lengths) < stack.positions:  # the whole step, one C++ call
            slot_ids = [kv.slots(n, n + 1)[0] for kv, n in zip(kvs, lengths)]
            rows = len(kvs)
            ints = torch.tensor([*token_ids, *lengths, *slot_ids])  # int64: ids, positions, slots
            # int32 [windows + 1, B]: each row's first key per window, then its end
            bounds = torch.tensor([[self._window_start(w, n) for n in lengths] for w in stack.windows]
                                  + [[n + 1 for n in lengths]], dtype=torch.int32)
            lora, mask = self._lora_arguments()
            out = stack.step.run(ints[:rows], ints[rows:2 * rows], pool.k, pool.v, ints[2 * rows:], table,
                                 bounds[:-1], bounds[-1], lora, mask)
            return out if stack.head else self.lm_head(out[:, None])[:, 0].float()
        slots = self._step_slots(kvs, lengths)
        ends = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
        h, cos, sin = self._step_inputs(token_ids, lengths, position_offsets)
        starts = {window: torch.tensor([self._window_start(window, n) for n in lengths], dtype=torch.int32)
                  for window in set(self.windows)}  # window -> [B]: each row's first key
        if fused is not None:  # the same operators from C++, a call per layer (session/model/cpu/fused_layer.py)
            h, cos, sin, flat_slots = h[:, 0], cos[:, 0], sin[:, 0], slots[:, 0].contiguous()
            lora, mask = self._lora_arguments()
            for index, arguments in enumerate(fused):
                h = fused_layer.run(h, arguments, cos, sin, pool.k[index], pool.v[index], flat_slots, table,
                                    starts[self.windows[index]], ends, lora[14 * index:14 * index + 14], mask)
            if fused_layer.is_norm(self.lm.norm):  # the final norm by the layer's own (checked at load)
                h = fused_layer.norm(h, self.lm.norm, fused_layer.lanes(fused))
                return self.lm_head(h[:, None])[:, 0].float()  # [B, 1, D]: the head sums as for one row each
            return self._logits(h[:, None])[:, 0]
        for index, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [B, H, 1, hd]; k, v: [B, KVH, 1, hd]
            pool.write_rows(index, slots, k, v)
            o = cpu_attention.decode_attention(q[:, :, 0].contiguous(), pool.k[index], pool.v[index], table,
                                               starts[self.windows[index]], ends, layer.self_attn.scaling)
            h = self.finish_layer(layer, h, o[:, :, None])
        return self._logits(h)[:, 0]

    def _fused_plan(self) -> list[tuple] | None:
        """The layers' arguments for the C++ layer where every layer is one it reproduces; planned once,
        after any LoRA install (a step's adapter rows go in as ``_lora_arguments``)."""
        if self.fused_layers is False:
            i = self.info
            self.fused_layers = (fused_layer.plan(self.layers, i.num_heads, i.num_kv_heads, i.head_dim)
                                 if self.cpu_kernels and self.kv_dtype == self.dtype
                                 and type(self).attention_inputs is ModelRunner.attention_inputs
                                 and type(self).finish_layer is ModelRunner.finish_layer else None)
        return self.fused_layers

    def _lora_arguments(self) -> tuple[list, torch.Tensor | None]:
        """This step's LoRA deltas for the C++ layer (``fused_layer.lora_arguments``), the tensor list
        kept while the rows' adapters and the bank's weights stay the same (a batch keeps its mix for
        many steps)."""
        bank = self.lora
        if bank is None or (bank.single is None and bank.mixed is None):
            return [], None
        key = (bank.single, bank.mixed[0] if bank.mixed is not None else None, bank.version)
        if self._lora_cached is None or self._lora_cached[0] != key:
            self._lora_cached = (key, fused_layer.lora_arguments(bank, len(self.layers))[0])
        return self._lora_cached[1], bank.row_mask

    def _decode_stack(self) -> fused_layer.Stack | None:
        """The whole step as one C++ call around the fused layers (session/model/cpu/fused_layer.py); planned once."""
        if self.decode_stack is False:
            fused = self._fused_plan()
            self.decode_stack = None if fused is None else fused_layer.stack(
                fused, self.windows, self.lm.embed_tokens, self.lm.rotary_emb, self.lm.norm, self.lm_head,
                self.info.head_dim, self.info.max_positions)
        return self.decode_stack

    @staticmethod
    def _runs_of_rows(kvs: list[PagedKVCache], starts: list[int], ends: list[int]) -> list[list[tuple]]:
        """Per row, the runs of blocks holding its positions starts[b] .. ends[b]-1, as (keys, values)
        views [layers, KVH, n, hd] of every layer (a step builds them once, then indexes a layer)."""
        return [[kv.pool.run_all_layers(*bounds) for bounds in kv.run_bounds(start, end)]
                for kv, start, end in zip(kvs, starts, ends)]

    @staticmethod
    def _one_pool(kvs: list[KVCache]) -> bool:
        """Every cache is paged in the same pool: a step stores all rows' new keys in one call per layer."""
        pool = getattr(kvs[0], "pool", None)
        return pool is not None and all(getattr(kv, "pool", None) is pool for kv in kvs)

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

    def _logits(self, h):
        return self.lm_head(self.lm.norm(h)).float()

    @torch.inference_mode()
    def extend(self, kvs: list[KVCache], token_rows: list[list[int]],
               adapter_slots: list[int] | None = None) -> torch.Tensor:
        """Feed token_rows[b] (one or more tokens) after kvs[b].length, for B sessions in ONE pass.

        A batched multi-token decode: speculative verification of several sessions at once (each row
        feeds its last token and its proposals) and the draft's catch-up pass. Returns logits [B, T, V],
        T = the longest row; row b's positions from len(token_rows[b]) on are padding (ignore them).
        Query i of row b (position length_b + i) sees keys 0 .. length_b + i, and in a sliding-window
        layer of W only the last W of them, as in ``prefill``. Attention as ``decode`` does it:
        batched (paged caches of one pool): one ``forward_paged`` call, shorter rows padded to T with
        their last token, whose keys land in the row's own blocks past its new length (stale there,
        overwritten later) and come after every real query of the row, so none attends to them.
        Per row (CPU's default, static caches): projections and MLPs over [B, T], attention per row over
        its own cache.
        """
        lengths = [kv.length for kv in kvs]
        counts = [len(row) for row in token_rows]
        width = max(counts)
        padded = [row + row[-1:] * (width - len(row)) for row in token_rows]
        self.set_adapters(adapter_slots)
        if self._extend_pooled(kvs):
            for kv, length, count in zip(kvs, lengths, counts):
                kv.ensure_capacity(length + count)
            logits = self._extend_as_steps(kvs, token_rows, lengths, width, adapter_slots)
        elif self._extend_batched(kvs, width):
            for kv, length in zip(kvs, lengths):
                kv.ensure_capacity(length + width)
            plan = torch.tensor([[*ids, *row] for ids, row in zip(padded, plan_rows(kvs, width))], device=self.device)
            logits = self.forward_paged(kvs[0].pool, columns(plan, 0, width), to_batch(plan[:, width:], width))
        else:
            for kv, length, count in zip(kvs, lengths, counts):
                kv.ensure_capacity(length + count)
            logits = self._extend_per_row(kvs, padded, lengths, counts)
        for kv, length, count in zip(kvs, lengths, counts):
            kv.length = length + count
        return logits

    def _extend_pooled(self, kvs: list[KVCache]) -> bool:
        return (self.pooled_decode and self.decode_attention == "per_row" and self._one_pool(kvs)
                and kvs[0].pool.head_major)

    def _extend_as_steps(self, kvs: list[PagedKVCache], token_rows: list[list[int]], lengths: list[int],
                         width: int, adapter_slots: list[int] | None) -> torch.Tensor:
        """bfloat16 on CPU: every new token a row of one ``_decode_pooled`` pass, so each position's
        logits are the bits its own decode step would give (a speculative verify then accepts exactly
        what plain decoding would emit). -> [B, width, V], padding positions zero."""
        owners = [b for b, row in enumerate(token_rows) for _ in row]
        offsets = [t for row in token_rows for t in range(len(row))]
        if adapter_slots is not None:  # one adapter row per new token
            self.set_adapters([adapter_slots[b] for b in owners])
        flat = self._decode_pooled([kvs[b] for b in owners], [token for row in token_rows for token in row],
                                   [lengths[b] + t for b, t in zip(owners, offsets)], None)  # [N, V]
        logits = flat.new_zeros(len(kvs), width, flat.shape[-1])
        logits[owners, offsets] = flat
        return logits

    def _extend_batched(self, kvs: list[KVCache], width: int) -> bool:
        return (self.decode_attention == "batched" and self._one_pool(kvs)
                and all(kv.length + width <= kv.max_tokens for kv in kvs))

    def _extend_per_row(self, kvs: list[KVCache], padded: list[list[int]], lengths: list[int],
                        counts: list[int]) -> torch.Tensor:
        width = len(padded[0])
        h = self.lm.embed_tokens(torch.tensor(padded, dtype=torch.long, device=self.device))  # [B, T, D]
        positions = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(width, device=self.device)
        cos, sin = self.lm.rotary_emb(h, positions)  # positions: [B, T]
        masks = [self._extend_masks(length, count) for length, count in zip(lengths, counts)]
        gqa = self.info.num_heads != self.info.num_kv_heads
        one_pool = self._one_pool(kvs)
        if one_pool:  # every row's real new tokens (not its padding): row, column, and slot in the pool
            new_rows = torch.tensor([b for b, count in enumerate(counts) for _ in range(count)], device=self.device)
            new_columns = torch.tensor([t for count in counts for t in range(count)], device=self.device)
            slots = torch.tensor([slot for kv, length, count in zip(kvs, lengths, counts)
                                  for slot in kv.slots(length, length + count)], device=self.device)
        row_runs = None  # _runs_of_rows, built once per step for the layers that attend in place
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            window = self.windows[index]
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [B, H, T, hd]; k, v: [B, KVH, T, hd]
            if one_pool:  # [N, KVH, hd] -> [KVH, N, hd]
                kvs[0].pool.write(index, slots, k[new_rows, :, new_columns].transpose(0, 1),
                                  v[new_rows, :, new_columns].transpose(0, 1))
            rows = []
            for b, (kv, length, count) in enumerate(zip(kvs, lengths, counts)):
                if not one_pool:
                    kv.write(index, length, k[b, :, :count], v[b, :, :count])
                if self._in_place(kv, window):
                    if row_runs is None:
                        row_runs = self._runs_of_rows(kvs, [0] * len(kvs), [n + c for n, c in zip(lengths, counts)])
                    runs = [(keys[index], values[index]) for keys, values in row_runs[b]]
                    row = attend_runs(q[b:b + 1, :, :count], runs, attn.scaling, gqa, masks[b][window])
                else:
                    row = F.scaled_dot_product_attention(
                        q[b:b + 1, :, :count], kv.keys(index, length + count)[None],
                        kv.values(index, length + count)[None], attn_mask=masks[b][window],
                        scale=attn.scaling, enable_gqa=gqa,
                    )  # [1, H, count, hd]
                rows.append(row if count == width else F.pad(row, (0, 0, 0, width - count)))  # padding: zeros
            h = self.finish_layer(layer, h, torch.cat(rows) if len(rows) > 1 else rows[0])
        return self._logits(h)

    def _extend_masks(self, length: int, count: int) -> dict[int | None, torch.Tensor | None]:
        """Per window size, the [count, length + count] mask of ``extend``'s rows (None: all keys)."""
        causal = torch.ones(count, length + count, dtype=torch.bool, device=self.device).tril(diagonal=length)
        masks = {}
        for window in set(self.windows):
            mask = causal if window is None else causal.triu(diagonal=length - window + 1)
            masks[window] = None if count == 1 and window is None else mask  # one query: every key is its past
        return masks
