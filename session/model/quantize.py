"""Weight-only quantization of the language model's linears, chosen per deployment (RESIDENT_QUANTIZATION).

Made at load from any float checkpoint; activations, norms, attention and the KV cache stay in the
model's float dtype, only the weights of the decoder layers' linears are stored in fewer bits:

- ``int8``: per output channel, symmetric. Row o of W [out, in] gets scale_o = max|W[o]| / 127 and
  q = round(W / scale) in [-127, 127]; W ~ q * scale, each weight within scale_o / 2.
- ``int4``: per group of RESIDENT_INT4_GROUP inputs (32 by default, as llama.cpp's Q4_0/Q4_1; 64 or
  128 store less and read less; a width the chosen size does not divide takes the next smaller that
  does), asymmetric in the form the int4 kernels (tinygemm's layout) take: per group
  scale = (max - min) / 15, a float zero = min + 8 * scale, q = round((W - zero) / scale + 8) in
  [0, 15]; W ~ (q - 8) * scale + zero, each weight within scale / 2.

Quantized: every ``nn.Linear`` of every decoder layer (attention and MLP projections), and on our
kernels (int8 and int4 alike) also ``lm_head`` (``quantize_head``), in int8: an int8 copy of the head beside the float
embeddings it may be tied to, which stay float for the lookup. On SmolLM2-135M-Instruct (1,024 tokens
of Python source) the int8 head moved perplexity from 9.654 (int8 layers, float head) to 9.647
(float32: 9.664) and greedy next-token agreement with float32 from 97.8% to 97.4%; the head is a
fifth of that model's weights and half of what an int8 decode step reads with a float head. Not: the
vision tower, the multimodal projector, the embeddings, and the head on ATen's kernels and torchao's.

Kernels, chosen once by device (``choose_kernel``, ``our_kernel``):
- CPU with float32 activations: ours, through ``QuantizedLinear`` (``ours``): csrc/linear_i8.cpp and
  csrc/linear_i4.cpp, the float32 linear's tiles on int8 lines with per-output scales and on nibble
  lines with per-group scales and offsets (session/model/cpu/linear.py packs them; AVX-512 or AVX2,
  the same bits), each row as if alone; the C++ decode layer and step take them
  (session/model/cpu/fused_layer.py), LoRA rows included. RESIDENT_CPU_KERNELS=0, or a CPU or
  toolchain that cannot build them, leaves ATen's.
- CPU with RESIDENT_ACTIVATIONS=int8: ours on rows quantized to int8 per 32 inputs (``int8_rows``;
  csrc/linear_q8.h, AVX512-VNNI or AVX2): integer dot products, as llama.cpp multiplies its files; the
  same weights (scales repeated per 32 inputs), less exact products, in the C++ step too.
- CPU otherwise (bfloat16 activations): ATen's, through ``QuantizedLinear``: ``aten._weight_int8pack_mm`` (int8 [out, in], scales [out])
  and ``aten._weight_int4pack_mm_for_cpu`` on weights packed by ``aten._convert_weight_to_int4pack_for_cpu``
  (scales and zeros [in / group, out, 2]). Both compute each row of x as if alone, whatever the other
  rows and the thread count (checked on this project's CPU for row counts 1..300 and 1 or 2 threads;
  tests/unit/model/test_quantize.py keeps checking the rows), so a decode batch's rows and a multi-turn session's deltas give what a
  batch-of-one forward gives, as the equivalence tests need.
- CUDA: torchao's documented API, ``quantize_(model, Int8WeightOnlyConfig())`` and
  ``Int4WeightOnlyConfig(group_size=...)`` on the same linears (their weights become torchao tensors
  inside the same ``nn.Linear`` modules); without torchao, start-up refuses (ConfigError).

On ATen's kernels the fused C++ decode layer is off (it logs why) and the layers run in Python. LoRA
(session/model/lora_bank.py) wraps a QuantizedLinear as it wraps an ``nn.Linear``: its deltas are added in
the float dtype to the quantized product.

``python -m benchmarks.quantization`` measures agreement with float32, perplexity, bytes and decode
speed; ``python -m benchmarks.vs_llama_cpp`` decode speed beside llama.cpp's Q8_0 and Q4 files
(docs/MEASUREMENTS.md, "Quantized weights on CPU").

Who calls this: ``ModelRunner`` once, right after loading, before packing and LoRA.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn

from session.errors import ConfigError
from session.model.cpu import linear as cpu_linear

METHODS = ("none", "int8", "int4")
INT8_MAX = 127  # symmetric: -128 is never used, so q and -q both fit
INT4_LEVELS = 15  # q in 0..15, centred on 8
INT4_GROUP_SIZES = (128, 64, 32)  # along the input dim: the largest allowed that divides it (kernels: 32..256)
# Groups of 32 by default. On SmolLM2-135M-Instruct (whose weights are its Q4_1 file's, groups of 32)
# groups of 64 raised perplexity on 2,048 tokens of Python source from 8.45 to 11.44 and groups of 32
# reproduced every weight (8.45); on the deep demo target (trained in float16) every size stayed
# within 0.3% (docs/MEASUREMENTS.md, "Quantized weights on CPU").
INT4_DEFAULT_GROUP = 32
INT4_OUT_MULTIPLE = 16  # ATen's int4 packing takes out_features in multiples of 16
# ATen's int8 CPU kernel in bfloat16 reads inputs 16 at a time: other widths crashed or summed wrong on
# this torch build (float32 and float16 took every width tried)
INT8_BF16_IN_MULTIPLE = 16
KERNELS = {
    ("int8", "cpu"): "aten._weight_int8pack_mm (CPU)",
    ("int4", "cpu"): "aten._weight_int4pack_mm_for_cpu (CPU)",
    ("int8", "cuda"): "torchao Int8WeightOnlyConfig (CUDA)",
    ("int4", "cuda"): "torchao Int4WeightOnlyConfig (CUDA)",
}


@dataclass(frozen=True)
class QuantizationReport:
    """What ``quantize_language_model`` did; ``describe`` is the start-up log line."""

    method: str  # int8 or int4
    kernel: str  # one of KERNELS
    num_linears: int  # linears now quantized
    num_float: int  # target linears left float: a shape the kernel does not take
    group_sizes: tuple[int, ...]  # int4: the input group sizes used; int8: ()
    model_bytes_before: int  # every parameter and buffer of the model, each storage once
    model_bytes_after: int
    head: bool = False  # lm_head quantized too (in int8, on our kernels: ``quantize_head``)

    def describe(self) -> str:
        if self.method == "int8":
            scheme = "int8 weight-only, per-channel scales"
        else:
            groups = "/".join(str(g) for g in self.group_sizes) or "-"
            scheme = f"int4 weight-only, groups of {groups} inputs, scales and zero points"
        kept = f" ({self.num_float} left float: shapes the kernel does not take)" if self.num_float else ""
        head = " and the head" if self.head else ""
        return (f"weights: {scheme}, {self.num_linears} linears{head}{kept}, {self.model_bytes_before / 1e6:.0f} MB -> "
                f"{self.model_bytes_after / 1e6:.0f} MB; kernel: {self.kernel}")


# ------------------------------------------------------------------ the maths (pure functions)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> q int8 [out, in], scales [out] in ``dtype`` (the kernel's: the activations')."""
    w = weight.detach().float()
    scales = round_up(w.abs().amax(dim=1) / INT8_MAX, dtype)
    q = (w / scales.float()[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight the int8 kernel multiplies by, in float64: q * scale per row, or per row and group of
    inputs where ``scales`` is [out, in / group] (GGUF's Q8_0)."""
    per_group = scales.double().reshape(q.shape[0], -1)
    return (q.double().view(q.shape[0], per_group.shape[1], -1) * per_group[..., None]).view(q.shape)


def quantize_int4(weight: torch.Tensor, group: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> q int32 [out, in] in 0..15, scales and zeros [out, in / group] in ``dtype``."""
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = round_up((high - low) / INT4_LEVELS, dtype)
    zeros = (low + 8 * scales.float()).to(dtype)
    # from the stored scale and zero, so that dequantizing gives back each weight within scale / 2
    q = ((w - zeros.float()[..., None]) / scales.float()[..., None] + 8).round().clamp(0, INT4_LEVELS)
    return q.to(torch.int32).view(out_features, in_features), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The weight the int4 kernel multiplies by, in float64: (q - 8) * scale + zero per group."""
    out_features, in_features = q.shape
    groups = scales.shape[1]
    grouped = q.double().view(out_features, groups, in_features // groups)
    return ((grouped - 8) * scales.double()[..., None] + zeros.double()[..., None]).view(out_features, in_features)


def round_up(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 scales in ``dtype``, never smaller than asked (a scale rounded down would push a row's
    largest weight past the top level, to be clamped); a zero scale (a constant row or group) is 1."""
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    stored = scales.to(dtype)
    return torch.where(stored.float() < scales, torch.nextafter(stored, torch.full_like(stored, math.inf)), stored)


def int4_group(out_features: int, in_features: int, largest: int = INT4_DEFAULT_GROUP) -> int | None:
    """The input group size int4 takes for an [out, in] weight: the largest of INT4_GROUP_SIZES up to
    ``largest`` (RESIDENT_INT4_GROUP) that divides ``in_features``; None where the kernels take none."""
    if out_features % INT4_OUT_MULTIPLE:
        return None
    return next((group for group in INT4_GROUP_SIZES if group <= largest and in_features % group == 0), None)


# ------------------------------------------------------------------ the CPU module


class QuantizedLinear(nn.Module):
    """A linear whose weight is held quantized, run by ATen's CPU kernels: x [..., in] in the model's
    float dtype -> [..., out] in that dtype. ``in_features`` and ``out_features`` as an ``nn.Linear``'s
    (LoRA reads them); no dense ``weight`` is kept. Made by ``from_int8`` / ``from_int4``."""

    # buffers (``register_buffer`` in __init__)
    packed: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, method: str, in_features: int, out_features: int, packed: torch.Tensor,
                 scales: torch.Tensor | None, bias: torch.Tensor | None, group_size: int = 0):
        super().__init__()
        self.method, self.in_features, self.out_features, self.group_size = method, in_features, out_features, group_size
        # on ATen: int8 packed int8 [out, in], scales [out]; int4 packed uint8 [out, in / 2] (ATen's
        # layout), scales [in / group, out, 2] (each group's scale and zero). On ours (``ours``): packed
        # with the scales (and int4's offsets) inside, scales None: session/model/cpu/linear.py's
        # pack_int8 (int8 [NB, in + 4, 16]) and pack_int4 (uint8 [NB, in + 16 in / group, 8])
        self.ours = scales is None
        self.block = group_size or in_features  # the input block our kernels sum in (``ours``)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                  ours: bool = False, int8_rows: bool = False) -> QuantizedLinear:
        """``ours``: packed for our kernel (float32 activations; ``our_kernel`` loaded), else ATen's.
        ``int8_rows`` (ours only): packed for the int8-activation kernel (``can_take_int8_rows``)."""
        out_features, in_features = q.shape
        if ours and int8_rows:  # every scale repeated over its groups of 32 inputs: the same weights
            packed = cpu_linear.pack_q8(q, scales, None, 8)
            return cls("int8", in_features, out_features, packed, None, bias, cpu_linear.Q8_GROUP)
        if ours:  # scales [out], or [out, in / group] (GGUF's Q8_0)
            group = in_features // scales.shape[1] if scales.dim() == 2 else 0
            return cls("int8", in_features, out_features, cpu_linear.pack_int8(q, scales), None, bias, group)
        return cls("int8", in_features, out_features, q.contiguous(), scales.contiguous(), bias)

    @classmethod
    def from_int4(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  bias: torch.Tensor | None = None, ours: bool = False,
                  offsets: torch.Tensor | None = None, int8_rows: bool = False) -> QuantizedLinear:
        """``ours``: packed for our kernel (float32 activations; ``our_kernel`` loaded), else ATen's.
        ``offsets`` (ours only) instead of ``zeros``: weights q scale + offset (GGUF's Q4_0 and Q4_1).
        ``int8_rows`` (ours only): packed for the int8-activation kernel (the same weights q scale + offset)."""
        out_features, in_features = q.shape
        group = in_features // scales.shape[1]
        if ours and int8_rows:
            packed = cpu_linear.pack_q8(q, scales, cpu_linear.int4_weight_offsets(scales, zeros, offsets), 4)
            return cls("int4", in_features, out_features, packed, None, bias, cpu_linear.Q8_GROUP)
        if ours:
            packed = cpu_linear.pack_int4(q, scales, zeros, offsets)
            return cls("int4", in_features, out_features, packed, None, bias, group)
        if zeros is None:
            raise ValueError("ATen's int4 kernel takes zero points: give zeros (offsets are for our kernel)")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)  # innerKTiles: unused on CPU
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [in / group, out, 2]
        return cls("int4", in_features, out_features, packed, scales_and_zeros, bias, group)

    @property
    def int8_rows(self) -> bool:
        """Packed for the int8-activation kernel (csrc/linear_q8.h: RESIDENT_ACTIVATIONS=int8)."""
        return self.packed.dtype == torch.int16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:  # int8: one block of inputs; int4: a block per group
            return cpu_linear.linear(x, self.packed, self.bias, self.out_features, self.block)
        rows = x.reshape(-1, self.in_features).contiguous()  # both kernels take 2-D, dense rows
        if self.method == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        kernel = ", resident" if self.ours else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}{group}{kernel}"


def quantize_linear(linear: nn.Linear, method: str, ours: bool = False, int8_rows: bool = False,
                    int4_largest: int = INT4_DEFAULT_GROUP) -> QuantizedLinear | None:
    """``linear`` as a QuantizedLinear in its own dtype, or None where ATen's kernel does not take its
    shape (``int4_group``, INT8_BF16_IN_MULTIPLE). ``ours``: on our kernels (float32 scales; int8 takes
    any shape, int4 the shapes ``int4_group`` gives a group); ``int8_rows``: on the int8-activation one
    where its inputs come in whole groups of 32 (``can_take_int8_rows``), else as ``ours``;
    ``int4_largest``: RESIDENT_INT4_GROUP."""
    weight, dtype = linear.weight, linear.weight.dtype
    int8_rows = int8_rows and linear.in_features % cpu_linear.Q8_GROUP == 0
    if method == "int8":
        if ours:
            return QuantizedLinear.from_int8(*quantize_int8(weight, torch.float32), linear.bias, ours=True,
                                             int8_rows=int8_rows)
        if dtype == torch.bfloat16 and linear.in_features % INT8_BF16_IN_MULTIPLE:
            return None
        return QuantizedLinear.from_int8(*quantize_int8(weight, dtype), linear.bias)
    group = int4_group(linear.out_features, linear.in_features, int4_largest)
    if group is None:
        return None
    return QuantizedLinear.from_int4(*quantize_int4(weight, group, torch.float32 if ours else dtype), linear.bias,
                                     ours=ours, int8_rows=int8_rows)


def is_quantized(module: nn.Module) -> bool:
    """A QuantizedLinear, or one a LoRA wrapper holds (session/model/lora_bank.py ``LoRALinear.base``)."""
    return isinstance(getattr(module, "base", module), QuantizedLinear)


# ------------------------------------------------------------------ the model


def choose_kernel(method: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel ``method`` runs on ``device`` (a KERNELS value); ConfigError where there is none:
    CUDA without torchao, int4 on CUDA in a dtype other than bfloat16, another device type."""
    if method not in METHODS[1:]:
        raise ConfigError(f"RESIDENT_QUANTIZATION must be none, int8 or int4, got {method!r}")
    if device.type == "cuda":
        try:
            importlib.import_module("torchao.quantization")
        except ImportError:
            raise ConfigError(f"RESIDENT_QUANTIZATION={method} on CUDA runs torchao's kernels, and torchao is not "
                              "installed: pip install torchao (the 'cuda' extra), or set RESIDENT_QUANTIZATION=none") from None
        if method == "int4" and dtype != torch.bfloat16:
            raise ConfigError(f"RESIDENT_QUANTIZATION=int4 on CUDA: torchao's int4 weight-only kernels take bfloat16 "
                              f"weights, not {dtype}; set RESIDENT_DTYPE=bfloat16 (CUDA's auto) or use int8")
    elif device.type != "cpu":
        raise ConfigError(f"RESIDENT_QUANTIZATION={method} runs on CPU (ATen's kernels) or CUDA (torchao's), "
                          f"not {device.type}; set RESIDENT_QUANTIZATION=none")
    return KERNELS[(method, device.type)]


def target_linears(layers: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every ``nn.Linear`` inside the decoder layers, each once."""
    found: dict[int, tuple[nn.Module, str, nn.Linear]] = {}
    for layer in layers:
        for parent in layer.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    found[id(child)] = (parent, name, child)
    return list(found.values())


def our_kernel(method: str, device: torch.device, dtype: torch.dtype, cpu_kernels: bool,
               int8_rows: bool = False) -> str | None:
    """The label of our int8 or int4 kernel where it runs the linears (CPU, float32 activations,
    RESIDENT_CPU_KERNELS on, and the kernel builds: session/model/cpu/kernels.py), else None (ATen's).
    ``int8_rows`` (RESIDENT_ACTIVATIONS=int8): the int8-activation kernel where it builds."""
    if not (device.type == "cpu" and dtype == torch.float32 and cpu_kernels):
        return None
    if int8_rows and cpu_linear.Q8_KERNEL.load():
        return f"resident::linear_q8 (CPU, {cpu_linear.Q8_KERNEL.isa_name}: our kernel, inputs quantized to int8)"
    kernel = cpu_linear.INT8_KERNEL if method == "int8" else cpu_linear.INT4_KERNEL
    if not kernel.load():
        return None
    operator = {"int8": "linear_i8", "int4": "linear_i4"}[method]
    return f"resident::{operator} (CPU, {kernel.isa_name}: our kernel, float32 inputs)"


def quantize_language_model(model: nn.Module, layers: list[nn.Module], method: str,
                            device: torch.device, cpu_kernels: bool = True, int8_rows: bool = False,
                            int4_largest: int = INT4_DEFAULT_GROUP) -> QuantizationReport:
    """Quantize the linears of ``layers`` (the language model's decoder layers, inside ``model``) with
    ``method`` (int8 or int4), in place, by the kernel ``choose_kernel`` picks for ``device``, or ours
    (``our_kernel``; ``cpu_kernels``: RESIDENT_CPU_KERNELS; ``int8_rows``: RESIDENT_ACTIVATIONS=int8),
    which also takes ``model.lm_head``; ``int4_largest``: RESIDENT_INT4_GROUP."""
    targets = target_linears(layers)
    dtype = targets[0][2].weight.dtype if targets else torch.float32
    kernel = choose_kernel(method, device, dtype)
    ours = our_kernel(method, device, dtype, cpu_kernels, int8_rows)
    int8_rows = ours is not None and "linear_q8" in ours
    before = model_bytes(model)
    if device.type == "cuda":
        num_linears, groups = quantize_with_torchao(model, [linear for _, _, linear in targets], method, int4_largest)
    else:
        num_linears, groups = replace_linears(targets, method, ours is not None, int8_rows, int4_largest)
    head = ours is not None and quantize_head(model, int8_rows)  # int8 for either method: see the module docstring
    return QuantizationReport(method, ours or kernel, num_linears, len(targets) - num_linears, groups, before,
                              model_bytes(model), head)


def replace_linears(targets: list[tuple[nn.Module, str, nn.Linear]], method: str, ours: bool = False,
                    int8_rows: bool = False, int4_largest: int = INT4_DEFAULT_GROUP) -> tuple[int, tuple[int, ...]]:
    """CPU: each target replaced by its QuantizedLinear in its parent (its float weight then freed);
    (how many, the int4 group sizes used). ``ours``: on our kernels."""
    count, groups = 0, set()
    for parent, name, linear in targets:
        quantized = quantize_linear(linear, method, ours, int8_rows, int4_largest)
        if quantized is not None:
            setattr(parent, name, quantized)
            count += 1
            groups.add(quantized.group_size)
    return count, tuple(sorted(groups - {0}, reverse=True))


def quantize_head(model: nn.Module, int8_rows: bool = False) -> bool:
    """``model.lm_head`` (a plain ``nn.Linear``) replaced by its int8 QuantizedLinear on our int8 kernel
    (loaded here: an int4 model's layers load only the int4 one); a head tied to the embeddings leaves
    them float (the lookup reads them). False where there is no such head or the kernel cannot be had."""
    head = getattr(model, "lm_head", None)
    kernel = cpu_linear.Q8_KERNEL if int8_rows else cpu_linear.INT8_KERNEL
    if type(head) is not nn.Linear or not kernel.load():
        return False
    quantized = quantize_linear(head, "int8", ours=True, int8_rows=int8_rows)
    assert quantized is not None  # int8 on our kernel takes any shape
    model.lm_head = quantized
    return True


def quantize_with_torchao(model: nn.Module, linears: list[nn.Linear], method: str,
                         int4_largest: int = INT4_DEFAULT_GROUP) -> tuple[int, tuple[int, ...]]:
    """CUDA: torchao's ``quantize_`` on exactly ``linears`` (its filter picks them by identity; int4
    once per group size, shapes no group fits left float); (how many, the int4 group sizes used)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    if method == "int8":
        chosen = {id(linear) for linear in linears}
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, fqn: id(module) in chosen)
        return len(chosen), ()
    count, used = 0, []
    for group in INT4_GROUP_SIZES:
        chosen = {id(linear) for linear in linears
                  if int4_group(linear.out_features, linear.in_features, int4_largest) == group}
        if chosen:
            quantize_(model, Int4WeightOnlyConfig(group_size=group),
                      filter_fn=lambda module, fqn, chosen=chosen: id(module) in chosen)
            count += len(chosen)
            used.append(group)
    return count, tuple(used)


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, each storage once (a head tied to the
    embeddings counts once); a tensor subclass (torchao's) by the plain tensors it holds."""
    storages: dict[int, int] = {}  # storage data pointer -> its bytes
    for tensor in chain(model.parameters(), model.buffers()):
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind ``tensor``: itself, or a traceable subclass's inner tensors."""
    if not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in plain_tensors(getattr(tensor, name))]
