"""Loading a checkpoint into what ``ModelRunner`` runs: ``ModelLoader`` builds a ``LoadedModel``.

Reads a Hugging Face checkpoint or a GGUF file by path (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, or a
plain causal LM of a family ``session/families/support.py`` admits), refusing an unsupported one before any
weight is read; builds the model on the runner's device in its dtype; keeps a GGUF or integer checkpoint's
linears packed and quantizes the rest (RESIDENT_QUANTIZATION); prepacks the linears for our CPU kernels; and
describes the model (``ModelInfo``, each layer's attention window).

Who calls this: ``ModelRunner.__init__`` only, once, on the thread that builds the runner (the engine's
compute thread). The device and dtype come resolved (session/model/runner.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from session.checkpoints import Checkpoint, reading_once, require
from session.families.registry import Family, family_of
from session.families.support import check_supported
from session.model import compressed, gguf
from session.model.backend import ModelInfo
from session.model.cpu import linear as cpu_linear
from session.model.cpu.packed_linear import can_pack, pack_linears
from session.model.generation_defaults import describe as describe_unapplied, unapplied_generation_defaults
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


@dataclass
class LoadedModel:
    """What a runner runs, built once by ``ModelLoader.load``."""

    hf_config: Any  # the checkpoint's transformers config: its fields are its family's (no common type names them)
    family: Family
    model: torch.nn.Module  # the transformers model, on the device, eval, no grads
    lm: torch.nn.Module  # its language model: embed_tokens, layers, norm, rotary_emb
    lm_head: torch.nn.Module  # after quantization (int8 on our kernel replaces the head)
    layers: list[torch.nn.Module]
    windows: list[int | None]  # per layer: None or its sliding window of W keys
    info: ModelInfo
    vision_feature_layer: int | None  # LLaVA's; None for other families
    vision_select: str | None  # LLaVA's vision_feature_select_strategy
    quantization: QuantizationReport | None  # RESIDENT_QUANTIZATION int8/int4, else None
    gguf: gguf.GgufReport | None  # a GGUF checkpoint's linears kept packed
    compressed: compressed.CompressedReport | None  # a compressed-tensors or AutoAWQ checkpoint's
    packed_linears: int  # linears prepacked for CPU kernels
    linear_kernels: dict[str, int]  # kernel ("resident", "onednn") -> linears it took


class ModelLoader:
    """One checkpoint, read onto ``device`` in ``dtype``. ``cpu_kernels``: RESIDENT_CPU_KERNELS, ours on
    CPU where they build."""

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, cpu_kernels: bool = True):
        self.device, self.dtype, self.cpu_kernels = device, dtype, cpu_kernels
        self.checkpoint: Checkpoint = require(model_path)  # a Hugging Face folder or a GGUF file
        # an integer checkpoint's quant_method (set by read_model: session/model/compressed.py)
        self.integer_method: str | None = None
        self.weights_folder = self.checkpoint.folder  # where the weights are read from (an AutoAWQ one: converted)

    def load(self, read_model: Callable | None = None, *, pack_weights: bool = True, quantization: str = "auto",
             activations: str = "float", int4_group: int = INT4_DEFAULT_GROUP) -> LoadedModel:
        """Config, checks, weights, packing and quantization, in that order. ``read_model`` (hf_config -> the
        model) stands in for ``self.read_model``: ``ModelRunner._load``, which a subclass may override."""
        from transformers import AutoConfig

        with reading_once():  # a GGUF file: parsed once for the config, the weights and its blocks
            hf_config = AutoConfig.from_pretrained(self.checkpoint.folder, **self.checkpoint.kwargs)
            check_supported(hf_config)  # refuse, naming the feature, before any weight is read
            compressed.check_loadable(hf_config)
            family = known_family(hf_config.model_type)
            text_config = hf_config.text_config if family.multimodal else hf_config
            model = (read_model or self.read_model)(hf_config)
            lm = language_model(model, family)
            layers = list(cast(torch.nn.ModuleList, lm.layers))
            # before packing and LoRA: they take what it leaves
            report, gguf_report, compressed_report = self.quantize(model, layers, quantization, activations,
                                                                   int4_group)
        lm_head = cast(torch.nn.Module, model.lm_head)  # int8 on our kernel quantizes the head too
        packed, kernels = self.pack_linears(layers + [lm_head], pack_weights)
        vision_select = getattr(hf_config, "vision_feature_select_strategy", None) if family.multimodal else None
        unapplied = unapplied_generation_defaults(model.generation_config)
        if unapplied:
            logger.warning(describe_unapplied(unapplied))
        return LoadedModel(
            hf_config=hf_config, family=family, model=model, lm=lm, lm_head=lm_head, layers=layers,
            windows=attention_windows(text_config, len(layers)),
            info=model_info(hf_config, text_config, family, model, layers, vision_select),
            vision_feature_layer=getattr(hf_config, "vision_feature_layer", None) if family.multimodal else None,
            vision_select=vision_select, quantization=report, gguf=gguf_report, compressed=compressed_report,
            packed_linears=packed, linear_kernels=kernels)

    def read_model(self, hf_config) -> torch.nn.Module:
        """The checkpoint's model of its family's transformers class, on the device, eval, no grads; an
        integer checkpoint's dequantized by transformers (``quantize`` keeps its integers packed)."""
        import transformers

        cls = getattr(transformers, known_family(hf_config.model_type).hf_class)
        method = compressed.quant_method(hf_config)
        self.integer_method = method if method in ("compressed-tensors", "awq") else None
        if self.integer_method == "awq":
            self.weights_folder = compressed.convert_awq(self.checkpoint.folder, hf_config)
        with warnings.catch_warnings():  # transformers notes that dequantize=True overrides the file's config
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model = cls.from_pretrained(self.weights_folder, dtype=self.dtype, **self.checkpoint.kwargs,
                                        **compressed.load_kwargs(self.integer_method))
        return model.to(self.device).eval().requires_grad_(False)

    def quantize(self, model, layers, method: str, activations: str = "float", int4_group: int = INT4_DEFAULT_GROUP
                 ) -> tuple[QuantizationReport | None, gguf.GgufReport | None, compressed.CompressedReport | None]:
        """RESIDENT_QUANTIZATION: the decoder layers' linears weight-only int8 or int4 (session/model/quantize.py),
        once, at load; its QuantizationReport, or None for "none" (the float checkpoint as loaded). A GGUF
        file's quantized linears are kept packed first (session/model/gguf.py; "none" dequantizes them),
        and so are a compressed-tensors or AutoAWQ checkpoint's (session/model/compressed.py): int8 or int4 then
        quantize only what they left float; their reports come second and third. RESIDENT_ACTIVATIONS: whether
        all of them multiply float32 rows or rows quantized to int8 (as llama.cpp does; where that kernel builds).
        ``int4_group``: RESIDENT_INT4_GROUP, the largest input group int4 makes."""
        gguf_report = compressed_report = None
        why, int8_rows = self.packed_kernels(activations)
        if self.checkpoint.gguf_path is not None and method != "none":
            gguf_report = gguf.keep_packed(model, layers, self.checkpoint.gguf_path, why, int8_rows)
            logger.info(gguf_report.describe())
        if self.integer_method is not None:  # loaded dequantized: our kernels take the file's integers
            why = "RESIDENT_QUANTIZATION=none" if method == "none" else why
            compressed_report = compressed.keep_packed(model, layers, self.weights_folder, self.integer_method, why,
                                                       int8_rows)
            logger.info(compressed_report.describe())
        if method in ("none", "auto"):
            return None, gguf_report, compressed_report
        report = quantize_language_model(model, layers, method, self.device, self.cpu_kernels,
                                         int8_rows=activations == "int8", int4_largest=int4_group)
        logger.info(report.describe())
        return report, gguf_report, compressed_report

    def packed_kernels(self, activations: str) -> tuple[str, bool]:
        """(why a checkpoint's packed linears cannot stay packed here, or ""; whether they go to the
        int8-activation kernel): RESIDENT_ACTIVATIONS=int8 falls back to the float32-input kernels
        where only those build."""
        int8_rows = activations == "int8"
        why = gguf.can_keep(self.device, self.dtype, self.cpu_kernels, int8_rows)
        if why and int8_rows and not gguf.can_keep(self.device, self.dtype, self.cpu_kernels):
            return "", False
        return why, int8_rows

    def pack_linears(self, modules: list[torch.nn.Module], pack_weights: bool) -> tuple[int, dict[str, int]]:
        """Prepack the language model's linears once: (how many, how many by what). On CPU (bfloat16,
        float32): our kernel (session/model/cpu/linear.py) where it builds and reproduces oneDNN's product, oneDNN's
        packed weights (session/model/cpu/packed_linear.py) for the rest; unpacked ones run dense ``F.linear``."""
        if not (pack_weights and can_pack(self.device, self.dtype)):
            return 0, {}
        ours = 0
        if self.cpu_kernels:
            ours, why = cpu_linear.pack_linears(modules, self.dtype)
            if why:
                logger.info("%s linears on oneDNN: %s", self.dtype, why)
        onednn = pack_linears(modules)  # whatever ours did not take
        return ours + onednn, {"resident": ours, "onednn": onednn}


def known_family(model_type: str) -> Family:
    """The registry's family of a model type ``check_supported`` admitted (it refuses every unregistered one)."""
    family = family_of(model_type)
    assert family is not None, f"{model_type!r} passed check_supported, which admits only registered families"
    return family


def language_model(model: torch.nn.Module, family: Family) -> torch.nn.Module:
    """The decoder stack of a transformers model: ``model.model``, a multimodal one's ``.language_model``.
    Casts: torch types a module's attributes as Tensor | Module, and these are modules."""
    inner = cast(torch.nn.Module, model.model)
    return cast(torch.nn.Module, inner.language_model) if family.multimodal else inner


def model_info(hf_config, text_config, family: Family, model, layers, vision_select: str | None) -> ModelInfo:
    """The shapes and ids the engine sizes and stops by: layers, heads, vocabulary, EOS ids (the config's
    and generation_config's), a LLaVA-1.5 image's fixed token count."""
    eos = text_config.eos_token_id
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos_ids = {e for e in (eos, gen_eos) for e in (e if isinstance(e, list) else [e]) if e is not None}
    num_image_tokens = 0
    if family.image_tokens == "fixed":  # else a count per image (anyres, grid)
        vc = hf_config.vision_config
        num_image_tokens = (vc.image_size // vc.patch_size) ** 2 + (vision_select == "full")
    return ModelInfo(
        num_layers=len(layers), num_heads=text_config.num_attention_heads,
        num_kv_heads=text_config.num_key_value_heads, head_dim=layers[0].self_attn.head_dim,
        hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
        max_positions=text_config.max_position_embeddings, eos_token_ids=tuple(sorted(eos_ids)),
        image_token_id=hf_config.image_token_id if family.multimodal else None,
        num_image_tokens=num_image_tokens,
    )
