"""compressed-tensors checkpoints kept packed: llm-compressor's W4A16 and W8A16 served from their own integers.

A checkpoint whose ``config.json`` says ``"quant_method": "compressed-tensors"`` (what llm-compressor
writes, and what most int4/int8 checkpoints on the hub for vLLM are) loads through transformers with
the ``compressed-tensors`` library: its quantized linears arrive as ``nn.Linear`` modules holding the
library's parameters (``weight_packed``/``weight`` in integers, ``weight_scale``, maybe
``weight_zero_point``) and no float weight, to be decompressed on the model's first ``forward``, which
the engine never calls (it runs the layers itself). So ``keep_packed`` runs at load, on every such
module of the decoder layers:

- on CPU with float32 activations and our kernels (``gguf.can_keep``), integer weights go to our
  int8/int4 kernels as they are: ``pack-quantized`` 4-bit (signed q in -8..7, w = (q - zero point)
  scale) -> our int4 with q + 8 and offset -(8 + zero point) scale, exactly; ``int-quantized`` /
  ``naive-quantized`` 8-bit symmetric (w = q scale) -> our int8. Per channel, per group of 32, 64 or
  128, or any other group a multiple of 32 (its scales repeated per 32 inputs: the same weights).
  Unpacked with the library's own ``unpack_from_int32``; each is checked against the library's
  ``dequantize`` of the same parameters, element for element (``same_weights``: within the ulp or
  two the library's float32 steps round), before it replaces the module;
- every other quantized module (another device or dtype, asymmetric 8-bit, activation ordering
  with a shuffled ``g_idx``, a shape no kernel takes, a module outside the decoder layers such as a
  quantized head or vision tower) is decompressed to float by the library (``decompress_module``)
  and counted in the start-up line with the reason. RESIDENT_QUANTIZATION int8 or int4 then quantizes
  what is left float (session/model/quantize.py).

With RESIDENT_ACTIVATIONS=int8 the kept linears go to the int8-activation kernel (csrc/linear_q8.h).

Who calls this: ``ModelRunner`` once at load, before RESIDENT_QUANTIZATION, packing and LoRA.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from session.model.quantize import QuantizedLinear, dequantize_int8, model_bytes, target_linears

KERNEL_GROUPS = (32, 64, 128)  # int4 groups our kernel takes as they are; others a multiple of 32 are regrouped


@dataclass(frozen=True)
class CompressedReport:
    """What ``keep_packed`` did; ``describe`` is the start-up log line."""

    kept: dict[str, int]  # "int4 (groups of 128)" / "int8 (per channel)" -> linears kept packed
    dequantized: dict[str, int]  # why -> modules decompressed to float
    model_bytes_before: int
    model_bytes_after: int
    int8_rows: bool = False

    @property
    def num_kept(self) -> int:
        return sum(self.kept.values())

    def describe(self) -> str:
        kept = ", ".join(f"{count} {kind}" for kind, count in sorted(self.kept.items())) or "none"
        inputs = "inputs quantized to int8 per 32" if self.int8_rows else "float32 inputs"
        line = f"weights: compressed-tensors, kept packed on our kernels ({inputs}): {kept}"
        if self.dequantized:
            floats = "; ".join(f"{count} {why}" for why, count in sorted(self.dequantized.items()))
            line += f"; decompressed to float by compressed-tensors: {floats}"
        return line + f"; {self.model_bytes_before / 1e6:.0f} MB -> {self.model_bytes_after / 1e6:.0f} MB"


def is_compressed(model: nn.Module) -> bool:
    """Did transformers load ``model`` from a compressed-tensors checkpoint?"""
    config = getattr(model.config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(getattr(method, "value", method)) == "compressed-tensors"


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` that still holds compressed-tensors parameters (a scheme and scales)."""
    return [(name, module) for name, module in model.named_modules()
            if getattr(module, "quantization_scheme", None) is not None and hasattr(module, "weight_scale")]


# ------------------------------------------------------------------ one module -> our formats


def integers(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str]:
    """The module's signed integers q [out, in] (int8 tensor), scales [out, groups] and zero points
    [out, groups] or None, as the library stores them, and its format."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    args = linear.quantization_scheme.weights
    if hasattr(linear, "weight_packed"):
        shape = torch.Size(int(d) for d in linear.weight_shape)
        q = unpack_from_int32(linear.weight_packed.data, args.num_bits, shape)
        zero = getattr(linear, "weight_zero_point", None)
        if zero is not None and not args.symmetric:  # packed along the outputs
            groups = linear.weight_scale.shape[1]
            zero = unpack_from_int32(zero.data, args.num_bits, torch.Size((shape[0], groups)), packed_dim=0)
        return q, linear.weight_scale.data, None if args.symmetric else zero, "pack-quantized"
    zero = None if args.symmetric else getattr(linear, "weight_zero_point", None)
    return linear.weight.data, linear.weight_scale.data, None if zero is None else zero.data, "int-quantized"


def in_features_of(linear: nn.Linear) -> int:
    return int(linear.weight_shape[1]) if hasattr(linear, "weight_shape") else linear.weight.shape[1]


def why_not_ours(linear: nn.Linear) -> str:
    """"" where ``kept_linear`` takes the module, else why not (counted in the start-up line)."""
    args = linear.quantization_scheme.weights
    if args.type != "int" or args.num_bits not in (4, 8):
        return f"{args.num_bits}-bit {args.type} weights (our kernels take int4 and int8)"
    if getattr(linear.quantization_scheme, "input_activations", None) is not None:
        return "activations quantized by the checkpoint (our kernels take float32 or int8 rows of their own)"
    g_idx = getattr(linear, "weight_g_idx", None)
    if g_idx is not None:
        in_features = in_features_of(linear)
        group = in_features // linear.weight_scale.shape[1]
        if not torch.equal(g_idx.long(), torch.arange(in_features) // group):
            return "activation ordering (inputs grouped out of order)"
    if args.num_bits == 8 and not args.symmetric:
        return "asymmetric int8 (our int8 kernel has no zero points)"
    group = in_features_of(linear) // linear.weight_scale.shape[1]
    if args.num_bits == 4 and group not in KERNEL_GROUPS and group % 32:
        return f"int4 in groups of {group} inputs (our kernel takes multiples of 32)"
    return ""


def kept_linear(linear: nn.Linear, int8_rows: bool = False) -> tuple[QuantizedLinear, torch.Tensor, str]:
    """The module as our QuantizedLinear, the float64 weights it multiplies by, and its kind."""
    q, scales, zero, _ = integers(linear)
    out_features, in_features = q.shape
    scales = scales.float().reshape(out_features, -1)
    group = in_features // scales.shape[1]
    where = "per channel" if scales.shape[1] == 1 else f"groups of {group}"
    if linear.quantization_scheme.weights.num_bits == 8:
        quantized = QuantizedLinear.from_int8(q.to(torch.int8), scales if scales.shape[1] > 1 else scales[:, 0],
                                              linear.bias, ours=True, int8_rows=int8_rows)
        return quantized, dequantize_int8(q, scales), f"int8 ({where})"
    if group not in KERNEL_GROUPS:  # the same scales repeated per 32 inputs
        scales = scales.repeat_interleave(group // 32, dim=1)
        zero = None if zero is None else zero.reshape(out_features, -1).repeat_interleave(group // 32, dim=1)
    zero = torch.zeros_like(scales) if zero is None else zero.reshape(scales.shape).float()
    offsets = -(8 + zero) * scales  # exact: a small integer times a float32 scale, in float32's range
    unsigned = q.int() + 8
    quantized = QuantizedLinear.from_int4(unsigned, scales, None, linear.bias, ours=True, offsets=offsets,
                                          int8_rows=int8_rows)
    rows = unsigned.double().view(out_features, scales.shape[1], -1)
    weights = (rows * scales.double()[..., None] + offsets.double()[..., None]).view(out_features, in_features)
    return quantized, weights, f"int4 ({where})"


def library_weights(linear: nn.Linear) -> torch.Tensor:
    """The float32 weights compressed-tensors' own ``dequantize`` gives for the module's parameters."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q, scales, zero, _ = integers(linear)
    args = linear.quantization_scheme.weights
    return dequantize(q.float(), scales.float(), None if zero is None else zero.float(), args).float()


def same_weights(ours: torch.Tensor, library: torch.Tensor) -> bool:
    """Our exact weights (float64) against the library's float32 ones, which round (q - zero point) *
    scale in steps (an asymmetric group's may differ by an ulp or two): equal within 2^-20 of each
    row's largest weight. A misread layout is off by whole scale steps (a sixteenth of a 4-bit row's
    range at the least), far past that."""
    tolerance = ours.abs().amax(dim=1, keepdim=True) * 2 ** -20
    return ours.shape == library.shape and bool(((ours - library.double()).abs() <= tolerance).all())


# ------------------------------------------------------------------ the model


def keep_packed(model: nn.Module, layers: list[nn.Module], why_float: str, int8_rows: bool = False) -> CompressedReport:
    """Replace, in place, each compressed-tensors linear of ``layers`` our kernels take by its
    QuantizedLinear; decompress every other quantized module of ``model`` to float (``why_float``,
    from ``gguf.can_keep``, not "": all of them, for that reason). Returns what it did."""
    from compressed_tensors.compressors.base import decompress_module

    before = model_bytes(model)
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:  # the library's decompress-on-first-forward: done here instead
        hook.remove()
        del model.ct_decompress_hook
    kept, dequantized = Counter(), Counter()
    reasons = {}  # id(module) -> why a decoder-layer module stays float
    for parent, attribute, linear in ([] if why_float else target_linears(layers)):
        if getattr(linear, "quantization_scheme", None) is None or not hasattr(linear, "weight_scale"):
            continue
        reasons[id(linear)] = why_not_ours(linear)
        if reasons[id(linear)]:
            continue
        quantized, weights, kind = kept_linear(linear, int8_rows)
        if not same_weights(weights, library_weights(linear)):
            reasons[id(linear)] = "their integers did not give the library's weights"
            continue
        setattr(parent, attribute, quantized)
        kept[kind] += 1
    for _, module in quantized_modules(model):  # what is left: decompressed by the library
        dequantized[why_float or reasons.get(id(module), "outside the decoder layers")] += 1
        decompress_module(module, leave_decompressed=False)
        if "forward" in vars(module):  # the library's restored forward, bound on the instance: the class's
            del module.forward  # again, so that a later class change (our packed float kernels) takes effect
    return CompressedReport(dict(kept), dict(dequantized), before, model_bytes(model), int8_rows)

