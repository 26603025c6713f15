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
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from session.checkpoints import locate, reading_once
from session.config import EngineConfig
from session.errors import ConfigError
from session.families.registry import family_of
from session.families.support import check_supported
from session.model import compressed, gguf
from session.model.attention import (
    PagedAttention,
    PagedBatch,
    attend_runs,
    causal_masks,
    choose_backend,
    plan_rows,
    to_batch,
)
from session.model.backend import ModelInfo
from session.model.cpu import attention as cpu_attention, fused_layer, linear as cpu_linear
from session.model.cpu.kernels import cpu_flags
from session.model.cpu.packed_linear import can_pack, pack_linears
from session.model.decode_paths import BatchedPath, CpuKernelPath, PerRowPath
from session.model.generation_defaults import describe as describe_unapplied, unapplied_generation_defaults
from session.model.kv_cache import KVCache, KVPool, PagedKVCache, StaticKVCache, to_device
from session.model.quantize import INT4_DEFAULT_GROUP, QuantizationReport, quantize_language_model

logger = logging.getLogger(__name__)


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


def resolve_device(name: str) -> torch.device:
    """RESIDENT_DEVICE -> a device ("auto": CUDA, else a NeuronCore where TorchNeuron has one, else the
    CPU; "neuron" without TorchNeuron is refused, naming it); a CUDA one always with its index ("auto"
    and "cuda" are cuda:0, what "cuda" means in a fresh process). Indexed, it means the same GPU on every thread: a bare "cuda" is
    each thread's current device, and a thread's current device starts at 0."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "neuron" if neuron_available() else "cpu"
    if name.split(":")[0] == "neuron" and not neuron_available():
        raise ConfigError(NEURON_MISSING.format(what="RESIDENT_DEVICE=neuron", found=neuron_found()))
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


# TorchNeuron (torch-neuronx 2.13/2.14, Neuron SDK 2.33+, Trn2 and Trn3) registers the "neuron" device and
# torch.compile's "neuron" backend; the SDK 2.31 images (torch-neuronx 2.9, NxD Inference) have neither.
NEURON_MISSING = ("{what} needs TorchNeuron: torch-neuronx matching this torch (" + torch.__version__ + "), from "
                  "Neuron SDK 2.33 or later, on a Trn2 or Trn3 instance; it registers the neuron device and "
                  "torch.compile's neuron backend, and this Python has {found}")


def neuron_available() -> bool:
    """Is the neuron device registered (TorchNeuron loaded) with a NeuronCore to use?"""
    module = getattr(torch, "neuron", None)
    return module is not None and bool(module.is_available())


def neuron_found() -> str:
    """What this Python has of Neuron's packages, for NEURON_MISSING."""
    from importlib import metadata

    try:
        return f"torch-neuronx {metadata.version('torch-neuronx')} without the neuron device"
    except metadata.PackageNotFoundError:
        return "no torch-neuronx"


def select_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device; nothing off CUDA. Who calls this:
    ``ModelRunner.__init__``, first, on the engine's compute thread, which later runs the loop too, and
    ``assemble`` again for a runner built on another thread
    (session/model/threads.py). Before it, that thread's current device is GPU 0: what CUDA does for
    "the current device" (streams torch.cuda.graph makes, its synchronize and empty_cache, the stream
    restored on leaving ``torch.cuda.stream``) would land there and open a context on GPU 0 in a
    process serving another GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


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
    """The decode attention a device gets unless RESIDENT_ATTENTION says otherwise. CUDA: batched (one
    kernel per layer instead of one per row). CPU: per_row, faster at many sessions
    (benchmarks/attention_paths.py; docs/MEASUREMENTS.md, "Decode attention paths"): SDPA over gathered blocks copies every row's KV
    each step, while a row whose blocks are consecutive is read in place."""
    return "batched" if device.type == "cuda" else "per_row"


def cpu_has_bf16() -> bool:
    """Native bfloat16 dot products on this CPU (the flags Linux reports in /proc/cpuinfo)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class ModelRunner:
    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", kv_dtype: str = "auto",
                 pack_weights: bool = True, cpu_kernels: bool = True, quantization: str = "auto",
                 activations: str = "float", int4_group: int = INT4_DEFAULT_GROUP):
        from transformers import AutoConfig

        self.model_path = model_path
        self.device = resolve_device(device)
        select_device(self.device)  # before any allocation on it (the first CUDA call, "auto"'s probe aside)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = self.dtype if kv_dtype == "auto" else getattr(torch, kv_dtype)  # see RESIDENT_KV_DTYPE
        self.checkpoint = locate(model_path)  # a Hugging Face folder or a GGUF file (session/checkpoints.py)
        if self.checkpoint is None:
            raise ConfigError(f"no Hugging Face checkpoint or GGUF file at {model_path!r}")
        self.integer_method = None  # an integer checkpoint's quant_method (set by _load: session/model/compressed.py)
        self.weights_folder = self.checkpoint.folder  # where the weights are read from (an AutoAWQ one: converted)
        with reading_once():  # a GGUF file: parsed once for the config, the weights and its blocks
            hf_config = AutoConfig.from_pretrained(self.checkpoint.folder, **self.checkpoint.kwargs)
            check_supported(hf_config)  # refuse, naming the feature, before any weight is read
            compressed.check_loadable(hf_config)
            self.hf_config = hf_config
            self.family = family_of(hf_config.model_type)  # known: check_supported passed
            self.is_multimodal = self.family.multimodal
            text_config = hf_config.text_config if self.is_multimodal else hf_config
            self.model = self._load(hf_config)
            self.mrope = self.family.mrope  # 3-D positions: prefill takes them, decode an offset
            self.merge_size = hf_config.vision_config.spatial_merge_size if self.mrope else 1  # M-RoPE image grids
            if self.is_multimodal:
                self.lm = self.model.model.language_model
                self.vision_feature_layer = getattr(hf_config, "vision_feature_layer", None)  # LLaVA's
                self.vision_select = getattr(hf_config, "vision_feature_select_strategy", None)
            else:
                self.lm = self.model.model
            self.lm_head = self.model.lm_head
            self.layers = list(self.lm.layers)
            self.cpu_kernels = cpu_kernels  # RESIDENT_CPU_KERNELS: ours on CPU where they build
            # before packing and LoRA: they take what it leaves
            self.quantization = self._quantize(quantization, activations, int4_group)
        self.lm_head = self.model.lm_head  # int8 on our kernel quantizes the head too
        self.packed_linears, self.linear_kernels = self._pack_linears(pack_weights, cpu_kernels)
        self.windows = attention_windows(text_config, len(self.layers))  # per layer: None or W keys
        self.info = self._info(hf_config, text_config)
        unapplied = unapplied_generation_defaults(self.model.generation_config)
        if unapplied:
            logger.warning(describe_unapplied(unapplied))
        # decode attention on CPU: our kernel, one call per layer (session/model/cpu/attention.py)
        self.pooled_decode = (cpu_kernels and self.device.type == "cpu" and self.info.head_dim % 16 == 0
                              and cpu_attention.supports(self.kv_dtype))
        self.lora = None  # a LoraBank once enable_lora ran
        self.kv_pools: dict[int, KVPool] = {}  # block_tokens -> the pool of paged caches of that block size
        self.path: PerRowPath | None = None  # how decode and extend run (configure_decode)
        self.configure_decode(default_attention(self.device))

    def _quantize(self, method: str, activations: str = "float", int4_group: int = INT4_DEFAULT_GROUP) -> QuantizationReport | None:
        """RESIDENT_QUANTIZATION: the decoder layers' linears weight-only int8 or int4 (session/model/quantize.py),
        once, at load; its QuantizationReport, or None for "none" (the float checkpoint as loaded). A GGUF
        file's quantized linears are kept packed first (session/model/gguf.py; "none" dequantizes them),
        and so are a compressed-tensors or AutoAWQ checkpoint's (session/model/compressed.py): int8 or int4 then
        quantize only what they left float. RESIDENT_ACTIVATIONS: whether all of them
        multiply float32 rows or rows quantized to int8 (as llama.cpp does; where that kernel builds).
        ``int4_group``: RESIDENT_INT4_GROUP, the largest input group int4 makes."""
        self.gguf = None  # GgufReport of a GGUF checkpoint
        self.compressed = None  # CompressedReport of a compressed-tensors checkpoint
        why, int8_rows = self._packed_kernels(activations)
        if self.checkpoint.gguf_path is not None and method != "none":
            self.gguf = gguf.keep_packed(self.model, self.layers, self.checkpoint.gguf_path, why, int8_rows)
            logger.info(self.gguf.describe())
        if self.integer_method is not None:  # loaded dequantized: our kernels take the file's integers
            why = "RESIDENT_QUANTIZATION=none" if method == "none" else why
            self.compressed = compressed.keep_packed(self.model, self.layers, self.weights_folder,
                                                     self.integer_method, why, int8_rows)
            logger.info(self.compressed.describe())
        if method in ("none", "auto"):
            return None
        report = quantize_language_model(self.model, self.layers, method, self.device, self.cpu_kernels,
                                         int8_rows=activations == "int8", int4_largest=int4_group)
        logger.info(report.describe())
        return report

    def _packed_kernels(self, activations: str) -> tuple[str, bool]:
        """(why a checkpoint's packed linears cannot stay packed here, or ""; whether they go to the
        int8-activation kernel): RESIDENT_ACTIVATIONS=int8 falls back to the float32-input kernels
        where only those build."""
        int8_rows = activations == "int8"
        why = gguf.can_keep(self.device, self.dtype, self.cpu_kernels, int8_rows)
        if why and int8_rows and not gguf.can_keep(self.device, self.dtype, self.cpu_kernels):
            return "", False
        return why, int8_rows

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
                   pack_weights=config.pack_weights and not config.compile, cpu_kernels=config.cpu_kernels,
                   quantization=config.quantization, activations=config.activations,
                   int4_group=config.int4_group)

    def _load(self, hf_config):
        import transformers

        cls = getattr(transformers, family_of(hf_config.model_type).hf_class)
        method = compressed.quant_method(hf_config)
        self.integer_method = method if method in ("compressed-tensors", "awq") else None
        if self.integer_method == "awq":
            self.weights_folder = compressed.convert_awq(self.checkpoint.folder, hf_config)
        with warnings.catch_warnings():  # transformers notes that dequantize=True overrides the file's config
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model = cls.from_pretrained(self.weights_folder, dtype=self.dtype, **self.checkpoint.kwargs,
                                        **compressed.load_kwargs(self.integer_method))
        return model.to(self.device).eval().requires_grad_(False)

    def _info(self, hf_config, text_config) -> ModelInfo:
        attn = self.layers[0].self_attn
        eos = text_config.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos_ids = {e for e in (eos, gen_eos) for e in (e if isinstance(e, list) else [e]) if e is not None}
        num_image_tokens = 0
        if self.family.image_tokens == "fixed":  # else a count per image (anyres, grid)
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
        if self.family.image_tokens == "grid":
            out = self.model.model.get_image_features(torch.cat(list(pixels)).to(self.device, self.dtype),
                                                      torch.tensor(grids, device=self.device))
            return [f.contiguous() for f in out.pooler_output]
        kwargs = {}
        if self.family.image_tokens == "anyres":
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
        """[T] ids -> [T, hidden]; image placeholder positions take ``image_embeds`` in order. The
        placeholders are found in the host's list, not by a mask on the device (a boolean index waits
        for the device to count its hits); ids and positions go over without blocking."""
        embeds = self.lm.embed_tokens(to_device(token_ids, self.device))
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
        self.set_adapters([adapter_slot])
        h = embeds[None]  # [1, T, D]
        if positions is None:
            positions = torch.arange(start, end)
        cos, sin = self.lm.rotary_emb(h, positions.to(self.device)[..., None, :])  # [1, T] or [3, 1, T]
        # query i (absolute position start+i) sees keys 0 .. start+i; in a sliding-window layer of W,
        # only the last W of them (keys j > start+i-W)
        paged = self.paged_prefill(kv, num_new)
        masks = causal_masks(start, num_new, self.windows, self.device) if paged is None else {}
        gqa = self.info.num_heads != self.info.num_kv_heads
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            window = self.windows[index]
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [1, H, T, hd]; k, v: [1, KVH, T, hd]
            if paged is not None:  # writes the new keys and attends through the block table, in place
                o = paged(index, q, k, v, window=window, scale=attn.scaling)
                h = self.finish_layer(layer, h, o)
                continue
            kv.write(index, start, k[0], v[0])
            if self.in_place(kv, window):  # the cache's runs of blocks in place, however it grew
                o = attend_runs(q, kv.runs(index, 0, end), attn.scaling, gqa, masks[window])
            else:
                o = F.scaled_dot_product_attention(q, kv.keys(index, end)[None], kv.values(index, end)[None],
                                                   attn_mask=masks[window], scale=attn.scaling, enable_gqa=gqa)
            h = self.finish_layer(layer, h, o)
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

    def in_place(self, kv: KVCache, window: int | None) -> bool:
        """Attend over a paged cache's runs of blocks in place (``attend_runs``) rather than a gathered
        copy: on CPU, in layers without a sliding window (whose masks can hide a whole run from a query)."""
        return self.device.type == "cpu" and window is None and isinstance(kv, PagedKVCache)

    def configure_decode(self, attention: str, batch_buckets: tuple[int, ...] = (), verify_tokens: int = 0,
                         verify_buckets: tuple[int, ...] = ()) -> None:
        """Choose the decode path once (session/engine/assembly.py, at start-up, with RESIDENT_ATTENTION):
        auto, batched, per_row or cuda_graphs (batched, replayed as CUDA graphs per batch bucket, and a
        speculative verify of ``verify_tokens`` a row per ``verify_buckets``; auto picks it on CUDA).
        Per row on a CPU our kernels serve take ``CpuKernelPath``."""
        if attention == "auto":
            attention = "cuda_graphs" if self.device.type == "cuda" else default_attention(self.device)
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
        """The chosen path's name: "per_row" or "batched"."""
        return self.path.name

    @decode_attention.setter
    def decode_attention(self, attention: str) -> None:
        self.configure_decode(attention)

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
        self.set_adapters(adapter_slots)
        offsets = list(position_offsets) if any(position_offsets or ()) else None  # host values: see the paths
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
        h = self.lm.embed_tokens(ids)  # [B, T, D]
        positions = batch.positions if position_offsets is None else batch.positions + position_offsets[:, None]
        cos, sin = self.lm.rotary_emb(h, positions)
        attention = PagedAttention(pool, batch, self.windows, choose_backend(pool))
        for index, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, h, cos, sin)  # q: [B, H, T, hd]; k, v: [B, KVH, T, hd]
            o = attention(index, q, k, v, window=self.windows[index], scale=layer.self_attn.scaling)
            h = self.finish_layer(layer, h, o)
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
        return self.lm_head(self.lm.norm(h)).float()

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
        self.set_adapters(adapter_slots)
        logits = self.path.extend(kvs, token_rows, lengths, adapter_slots)
        for kv, length, row in zip(kvs, lengths, token_rows):
            kv.length = length + len(row)
        return logits
