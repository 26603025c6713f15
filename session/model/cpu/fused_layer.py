"""A decode step's layers on CPU as one C++ call each (and the whole step as one, ``stack``), in
bfloat16 and float32 (csrc/decode_layer.h): the Python step's bits, minus Python.

With our attention and linear kernels, about half of a one-session bfloat16 step was ~300 small torch
operators (RMSNorm's eight, the rotary embedding's seven per tensor, residual adds, views) and the
interpreter and ``nn.Module`` calls around them. ``csrc/decode_layer.cpp`` runs a layer in one call:
our kernels through the dispatcher, RMSNorm, the rotary embedding and the residual adds written out
with the ATen kernels' arithmetic, SiLU by ATen. Same bits (tests/integration/test_bf16_decode.py);
docs/MEASUREMENTS.md, "The C++ decode layer", has the step's times.

RMSNorm's mean is where the bits are fragile: ATen sums a row in vectors of 8 or 16 floats (its AVX2
or AVX512 code; this torch build ran the 8-lane sum on an AVX-512 CPU), four vectors side by side,
cascaded every 16. ``sum_lanes`` tries both widths against transformers' RMSNorm at load and the
plan is dropped (the Python layer runs) where neither reproduces it.

It applies where the layer is one it reproduces: transformers' Llama-family modules (Llama, Mistral,
Qwen2, Qwen3 with its q/k norms; LLaVA's language model is a Llama), an RMSNorm of the Llama form, a
SiLU MLP, and all seven linears on one of our kernels (session/model/cpu/linear.py): bfloat16 or
float32 weights, or int8 or int4 weights on our kernels (RESIDENT_QUANTIZATION with float32
activations, session/model/quantize.py; the float32 layer's arithmetic around them). The packed
weights' dtype names the format (KERNELS' keys; int4's is uint8; int16: int8 or int4 weights with
int8-quantized activations, RESIDENT_ACTIVATIONS=int8, csrc/linear_q8.h). Anything else (ATen's quantized
linears: bfloat16 activations) runs the Python layer. Who calls this: ``CpuKernelPath.decode_rows`` (session/model/decode_paths.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn

from session.model.cpu.kernels import AVX2, AVX2_F16C, AVX512, AVX512_BF16, AVX512_VNNI, CppKernel
from session.model.cpu.linear import KernelLinear
from session.model.quantize import QuantizedLinear, is_quantized

logger = logging.getLogger(__name__)

KERNELS = {  # per format (the packed linears' dtype): the library, with its linear tiles' instructions
    torch.bfloat16: CppKernel("fused bfloat16 decode layer", "decode_layer.cpp", (AVX512_BF16,)),
    torch.float32: CppKernel("fused float32 decode layer", "decode_layer_f32.cpp", (AVX512, AVX2)),
    torch.int8: CppKernel("fused int8-weight decode layer", "decode_layer_i8.cpp", (AVX512, AVX2)),
    torch.uint8: CppKernel("fused int4-weight decode layer", "decode_layer_i4.cpp", (AVX512, AVX2)),
    torch.int16: CppKernel("fused int8-activation decode layer", "decode_layer_q8.cpp", (AVX512_VNNI, AVX2_F16C)),
}
KERNEL = KERNELS[torch.bfloat16]
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32", torch.int8: "i8", torch.uint8: "i4",
          torch.int16: "q8"}  # operators per format
STACKS = {torch.bfloat16: "DecodeStack", torch.float32: "DecodeStackF32", torch.int8: "DecodeStackI8",
          torch.uint8: "DecodeStackI4", torch.int16: "DecodeStackQ8"}
# The RMSNorm classes whose forward is LlamaRMSNorm's, operator for operator (weight * normed, not
# Gemma's 1 + weight)
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUM_LANES = (8, 16)  # ATen's float vector widths (AVX2, AVX512) its sum kernel may run


def load(dtype: torch.dtype = torch.bfloat16) -> bool:
    return KERNELS[dtype].load()


def op(name: str, dtype: torch.dtype):
    """``torch.ops.resident.<name>_<bf16|f32|i8|i4>``: the C++ layer's operator for the format ``dtype``."""
    return getattr(torch.ops.resident, f"{name}_{SUFFIX[dtype]}")


def base_linear(module: nn.Module | None) -> nn.Module | None:
    """A LoRA-wrapped linear's base (session/model/lora_bank.py), else the module."""
    return getattr(module, "base", module)


def is_norm(module: object) -> bool:
    return module is not None and type(module).__name__ in NORMS


def ours(linear: nn.Module | None) -> TypeGuard[KernelLinear | QuantizedLinear]:
    """A linear on one of our kernels: a KernelLinear, or a QuantizedLinear on our int8 or int4 kernel."""
    return type(linear) is KernelLinear or (type(linear) is QuantizedLinear and linear.ours)


def one_row_block(linear: KernelLinear | QuantizedLinear) -> int:
    """The input block size a decode row sums in: the probe's for a KernelLinear, the whole row for int8,
    the group for int4."""
    return linear.one_row_block if isinstance(linear, KernelLinear) else linear.block


def layer_arguments(layer: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple | None:
    """(weights, biases, sizes, floats) for ``decode_layer_bf16`` (f32, i8, i4), or None where the layer is
    not one the C++ layer reproduces. ``layer``: a transformers decoder layer, whose parts (self_attn,
    mlp, the norms) are its class's own."""
    attn, mlp = layer.self_attn, layer.mlp
    found = [base_linear(getattr(attn if i < 4 else mlp, name, None)) for i, name in enumerate(LINEARS)]
    linears = [linear for linear in found if ours(linear)]
    if len(linears) < len(found) or len({linear.packed.dtype for linear in linears}) != 1:
        return None
    if not (is_norm(layer.input_layernorm) and is_norm(layer.post_attention_layernorm)):
        return None
    if not isinstance(getattr(mlp, "act_fn", None), nn.SiLU) and type(getattr(mlp, "act_fn", None)).__name__ != "SiLUActivation":
        return None
    qk_norm = getattr(attn, "q_norm", None) is not None
    if qk_norm and not (is_norm(attn.q_norm) and is_norm(attn.k_norm)):
        return None
    weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *(lin.packed for lin in linears)]
    if qk_norm:
        weights += [attn.q_norm.weight, attn.k_norm.weight]
    sizes = [num_heads, num_kv_heads, head_dim, *(lin.out_features for lin in linears),
             *(one_row_block(lin) for lin in linears), int(qk_norm)]
    floats = [layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon,
              attn.q_norm.variance_epsilon if qk_norm else 0.0, attn.scaling]
    return [w.detach() for w in weights], [lin.bias for lin in linears], sizes, floats


def sum_lanes(widths: set[int], dtype: torch.dtype = torch.bfloat16, rows: int = 256, seed: int = 0,
              fmt: torch.dtype | None = None) -> int | None:
    """The width (8 or 16) of the float vectors ATen's sum kernel runs here, found by comparing our
    RMSNorm with transformers' on random rows of every width the layers normalize; None where neither
    reproduces it (then the Python layer runs). ``fmt``: the library's format (default ``dtype``)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm  # NORMS' forward, the reference

    generator = torch.Generator().manual_seed(seed)
    for lanes in SUM_LANES:
        for width in sorted(widths):
            scales = torch.exp2(torch.randint(-8, 8, (rows, 1), generator=generator).float())
            x = (torch.randn(rows, width, generator=generator) * scales).to(dtype)
            reference = LlamaRMSNorm(width, eps=1e-6).to(dtype)
            with torch.no_grad():
                reference.weight.copy_(torch.randn(width, generator=generator))
            if not torch.equal(op("rms_norm", fmt or dtype)(x, reference.weight, 1e-6, lanes), reference(x)):
                break
        else:
            return lanes
    return None


def plan(layers: list[nn.Module], num_heads: int, num_kv_heads: int, head_dim: int) -> list[tuple] | None:
    """Every layer's arguments, or None (with the reason logged) where any layer cannot be fused, the
    library cannot be had, or our RMSNorm does not reproduce transformers' here."""
    found = [layer_arguments(layer, num_heads, num_kv_heads, head_dim) for layer in layers]
    arguments = [a for a in found if a is not None]
    if len(arguments) < len(found):
        quantized = any(is_quantized(module) for layer in layers for module in layer.modules())
        logger.info("fused decode layers: %s; the Python layer runs",
                    "linears quantized for ATen's kernels (bfloat16 activations)" if quantized
                    else "a layer the C++ layer does not reproduce")
        return None
    dtype = arguments[0][0][0].dtype  # the input norm's weight: the activations'
    fmt = weight_format(arguments)
    if fmt not in KERNELS or not load(fmt):
        return None
    widths = {weights[0].numel() for weights, *_ in arguments} | {weights[9].numel() for weights, *_ in arguments
                                                                   if len(weights) > 9}  # hidden size, head dim
    with torch.inference_mode():
        lanes = sum_lanes(widths, dtype, fmt=fmt)
    if lanes is None:
        logger.info("fused decode layers: our RMSNorm does not reproduce ATen's sum here; the Python layer runs")
        return None
    for _, _, sizes, _ in arguments:
        sizes.append(lanes)
    return arguments


def lanes(arguments: list[tuple]) -> int:
    """The sum lanes ``plan`` found (the last of every layer's sizes)."""
    return arguments[0][2][-1]


def weight_format(arguments: list[tuple]) -> torch.dtype:
    """The layers' format (KERNELS' key): their packed q projection's dtype."""
    return arguments[0][0][2].dtype


def norm(h: torch.Tensor, module: Any, arguments: list[tuple]) -> torch.Tensor:
    """``module`` (an RMSNorm of NORMS: transformers', its weight and variance_epsilon its own) applied
    to h [B, D] by the C++ layer's RMSNorm."""
    return op("rms_norm", weight_format(arguments))(h, module.weight, module.variance_epsilon, lanes(arguments))


def run(h: torch.Tensor, arguments: tuple, cos: torch.Tensor, sin: torch.Tensor, k_layer: torch.Tensor,
        v_layer: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, starts: torch.Tensor,
        ends: torch.Tensor, lora: Sequence[torch.Tensor | None] = (), mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer: h [B, D], cos/sin [B, hd], one layer of the head-major pool, slots [B] -> h [B, D].
    ``lora``: this layer's 14 LoRA tensors (``lora_arguments``) or empty; ``mask``: a mix's row mask."""
    weights, biases, sizes, floats = arguments
    return op("decode_layer", weights[2].dtype)(h, weights, biases, sizes, floats, cos, sin, k_layer, v_layer, slots, table,
                                      starts, ends, list(lora), mask)


def lora_arguments(bank, num_layers: int) -> tuple[list, torch.Tensor | None]:
    """The LoRA deltas of a step with adapter rows (``bank``: session/model/lora_bank.py's LoraBank, its rows
    set), as LoRALinear computes them: per layer and linear (LINEARS' order) A^T [in, R] and B^T [R,
    out], None and None where no adapter targets that linear, then the mix's row mask [B, 1, R] (None
    where every row has one adapter). ([], None) for a step without adapter rows."""
    if bank is None or (bank.single is None and bank.mixed is None) or not bank.at:
        return [], None
    tensors: list = []
    for index in range(num_layers):
        for name in LINEARS:
            key = (index, name)
            tensors += list(bank.factors(key)) if key in bank.at else [None, None]
    return tensors, bank.row_mask


ROPE_TABLE_POSITIONS = 32768  # at most; a step past them runs the layers one call each


def rope_table(rotary: nn.Module, head_dim: int, max_positions: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin [P, hd] for positions 0 .. P-1, computed by the model's rotary module itself; None where
    a table cannot stand for it: a rope type that follows the sequence length, or a batch of positions
    the module computes otherwise than the table's rows (its cos and sin run vectorized, with scalar
    tails where B * hd is not a whole number of vectors; checked here on random batches)."""
    if getattr(rotary, "rope_type", "default") != "default":
        return None
    count = min(max_positions, ROPE_TABLE_POSITIONS)
    x = torch.zeros(1, 1, head_dim, dtype=dtype)  # the module reads only its device and dtype
    cos, sin = (t[0].contiguous() for t in rotary(x, torch.arange(count)[None]))
    if cos.shape != (count, head_dim) or cos.dtype != dtype:
        return None
    generator = torch.Generator().manual_seed(0)
    for batch in (1, 2, 3, 5, 7, 16, 33):
        positions = torch.randint(0, count, (batch, 1), generator=generator)
        positions[0, 0] = count - 1
        step_cos, step_sin = rotary(x, positions)
        if not (torch.equal(step_cos[:, 0], cos[positions[:, 0]]) and torch.equal(step_sin[:, 0], sin[positions[:, 0]])):
            return None
    return cos, sin


@dataclass
class Stack:
    """A whole decode step in one C++ call (``DecodeStack``, ``DecodeStackF32``: csrc/decode_layer.h)."""
    step: Any  # a torch.classes.resident.DecodeStack*: its methods are the C++ class's, unknown to torch's stubs
    windows: list  # the distinct attention windows, in the order of run's ``starts`` rows
    positions: int  # the rotary table's length: a step at a later position runs the layers one by one
    head: bool  # the head is ours (run returns logits), else run returns the normed hidden state


def stack(arguments: list[tuple], windows: list, embedding: nn.Module, rotary: nn.Module, final_norm: Any,
          head: nn.Module, head_dim: int, max_positions: int) -> Stack | None:
    """The layers ``plan`` found, with the embedding, rotary table, final norm (transformers' RMSNorm: its
    weight and variance_epsilon its own) and head around them; None (the layers run one call each) where
    those are not ones the step reproduces."""
    if type(embedding) is not nn.Embedding or not is_norm(final_norm):
        return None
    weight = embedding.weight.detach()
    table = rope_table(rotary, head_dim, max_positions, weight.dtype)
    if table is None:
        logger.info("decode stack: the rotary module is not a table of positions here; layers run one call each")
        return None
    distinct = list(dict.fromkeys(windows))
    fmt = weight_format(arguments)
    step = getattr(torch.classes.resident, STACKS[fmt])()
    for (weights, biases, sizes, floats), window in zip(arguments, windows):
        step.add_layer(weights, biases, sizes, floats, distinct.index(window))
    ours_head = head if ours(head) and head.packed.dtype == fmt else None  # else the model's head runs after the step
    if ours_head is not None:
        head_ends: tuple = (ours_head.packed, ours_head.bias, ours_head.out_features, one_row_block(ours_head))
    else:
        head_ends = (None, None, 0, 0)
    step.set_ends(weight, *table, final_norm.weight.detach(), final_norm.variance_epsilon, *head_ends)
    return Stack(step, distinct, len(table[0]), ours_head is not None)
