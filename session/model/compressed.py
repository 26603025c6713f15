"""Integer-quantized Hugging Face checkpoints kept packed: compressed-tensors (llm-compressor's W4A16 and
W8A16) and AutoAWQ, served from their own integers.

A checkpoint whose ``config.json`` says ``"quant_method": "compressed-tensors"`` (what llm-compressor
writes: most int4/int8 checkpoints on the hub made for vLLM) is loaded by transformers with the
``compressed-tensors`` library, dequantized (``CompressedTensorsConfig(dequantize=True)``: dense float
weights, whatever the scheme; its compressed modules would decompress only on the model's first
``forward``, which the engine never calls). An AutoAWQ checkpoint (``"quant_method": "awq"``, GEMM
layout; AutoAWQ is deprecated, its checkpoints remain) is first converted to compressed-tensors by
that library's own ``AutoAWQConverter`` into a cache folder (``convert_awq``), then loaded the same way.

Then, on CPU with float32 activations and our kernels (``gguf.can_keep``), ``keep_packed`` replaces each
decoder-layer linear the checkpoint stores as integers by our int4 or int8 linear made from the file's
own tensors (read with safetensors, unpacked with the library's ``unpack_from_int32``):
- 4-bit ``weight_packed`` (signed q in -8..7, w = (q - zero point) scale; the zero point only where
  asymmetric) -> our int4 with q + 8 and offset -(8 + zero point) scale, exactly;
- 8-bit ``weight`` in int8, symmetric (w = q scale) -> our int8;
per output channel, or per group of 32, 64, 128 inputs, or any multiple of 32 (its scales repeated
per 32 inputs: the same weights), exactly (q - zero point) scale in float32. Each replacement is
checked against the dense weight the library dequantized, element for element (``same_weights``:
within its rounding, which is float16's for AutoAWQ's float16 scales);
one that differs stays as dequantized, counted. Everything else stays as dequantized, counted in the
start-up line with the reason: other devices and dtypes, asymmetric 8-bit (our int8 kernel has no
zero points), activation ordering with a shuffled ``weight_g_idx``, other formats (fp8, nvfp4), and
modules outside the decoder layers (a quantized head or vision tower). RESIDENT_QUANTIZATION int8 or
int4 then quantizes what is left float (session/model/quantize.py); ``none`` keeps it all dequantized.

With RESIDENT_ACTIVATIONS=int8 the kept linears go to the int8-activation kernel (csrc/linear_q8.h).
GPTQ checkpoints (``"quant_method": "gptq"``) need GPT-QModel, which transformers requires to load
them: refused at start-up with that message (``check_loadable``).

Who calls this: ``ModelRunner`` at load: ``load_kwargs`` before ``from_pretrained``, ``keep_packed``
after it, before RESIDENT_QUANTIZATION, packing and LoRA.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from session.errors import ConfigError
from session.model.quantize import QuantizedLinear, dequantize_int8, model_bytes

KERNEL_GROUPS = (32, 64, 128)  # int4 groups our kernel takes as they are; others a multiple of 32 are regrouped
CACHE_ENV = "RESIDENT_CONVERTED_DIR"  # where converted AutoAWQ checkpoints are kept


@dataclass(frozen=True)
class CompressedReport:
    """What ``keep_packed`` did; ``describe`` is the start-up log line."""

    method: str  # the checkpoint's quant_method: "compressed-tensors" or "awq"
    kept: dict[str, int]  # "int4 (groups of 128)" / "int8 (per channel)" -> linears kept packed
    dequantized: dict[str, int]  # why -> linears left as the library dequantized them
    model_bytes_before: int
    model_bytes_after: int
    int8_rows: bool = False

    @property
    def num_kept(self) -> int:
        return sum(self.kept.values())

    def describe(self) -> str:
        kept = ", ".join(f"{count} {kind}" for kind, count in sorted(self.kept.items())) or "none"
        inputs = "inputs quantized to int8 per 32" if self.int8_rows else "float32 inputs"
        line = f"weights: {self.method} checkpoint, kept packed on our kernels ({inputs}): {kept}"
        if self.dequantized:
            floats = "; ".join(f"{count} {why}" for why, count in sorted(self.dequantized.items()))
            line += f"; left as compressed-tensors dequantized them: {floats}"
        return line + f"; {self.model_bytes_before / 1e6:.0f} MB -> {self.model_bytes_after / 1e6:.0f} MB"


# ------------------------------------------------------------------ the checkpoint


def quant_method(hf_config) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` ("compressed-tensors", "awq", "gptq", ...)."""
    config = getattr(hf_config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def check_loadable(hf_config) -> None:
    """Refuse, naming what is missing, an integer checkpoint this module does not serve."""
    method = quant_method(hf_config)
    if method == "gptq":
        raise ConfigError("GPTQ checkpoints (quant_method \"gptq\") load through GPT-QModel, which is not "
                          "installed with Resident (it needs torch >= 2.14.1 and CUDA kernels); convert it to "
                          "compressed-tensors with llm-compressor, or serve a float or GGUF checkpoint")


def load_kwargs(method: str | None) -> dict:
    """What ``from_pretrained`` takes besides the folder for a checkpoint of ``method`` (an AutoAWQ one
    once converted is compressed-tensors): dense weights, dequantized by the library."""
    if method not in ("compressed-tensors", "awq"):
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def convert_awq(folder: str, hf_config) -> str:
    """An AutoAWQ checkpoint converted to compressed-tensors by the library's AutoAWQConverter, in a
    cache folder keyed by the source's files (converted once; workers converting at once each write
    their own staging folder and the first rename wins); its path."""
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    source = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(source.iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    root = Path(os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                / "resident" / "converted")
    target = root / f"{source.name}-{digest.hexdigest()[:16]}"
    if (target / "config.json").exists() and quant_method_of(target) == "compressed-tensors":
        return str(target)
    from loguru import logger as library_log

    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))  # this process's own
    converter = AutoAWQConverter.from_autoawq_config(hf_config.quantization_config)
    library_log.disable("compressed_tensors")  # a line per file copied, at DEBUG, to stderr
    try:
        convert_checkpoint(str(source), str(staging), converter, max_workers=1, device="cpu")
        try:
            staging.rename(target)  # atomic; another worker may have finished first: then its copy serves
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        library_log.enable("compressed_tensors")
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def quant_method_of(folder: Path) -> str | None:
    config = json.loads((folder / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def file_tensors(folder: str) -> dict[str, tuple[Path, str]]:
    """Tensor name -> (its safetensors file, the name) for every tensor of the checkpoint."""
    from safetensors import safe_open

    where = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                where[name] = (path, name)
    return where


def read(where: dict[str, tuple[Path, str]], name: str) -> torch.Tensor | None:
    from safetensors import safe_open

    if name not in where:
        return None
    path, key = where[name]
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(key)


# ------------------------------------------------------------------ one linear -> our formats


@dataclass
class Integers:
    """One linear's integers as the file stores them, unpacked: signed q [out, in], scales [out, groups],
    zero points [out, groups] or None (symmetric), bits, and activation ordering's g_idx or None."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    g_idx: torch.Tensor | None
    scale_dtype: torch.dtype = torch.float32  # as stored: the library dequantizes in it

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]


def integers(where: dict[str, tuple[Path, str]], prefix: str) -> Integers | None:
    """The integers of the linear ``prefix`` (e.g. "model.layers.0.mlp.up_proj"), or None where the
    file stores it otherwise (float, or a format with no integers and scales)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scales = read(where, f"{prefix}.weight_scale")
    if scales is None or scales.dim() != 2:
        return None
    packed, zeros = read(where, f"{prefix}.weight_packed"), read(where, f"{prefix}.weight_zero_point")
    g_idx, stored_shape = read(where, f"{prefix}.weight_g_idx"), read(where, f"{prefix}.weight_shape")
    if packed is not None:
        if stored_shape is None:
            return None  # packed integers without their shape: not a layout this reads
        shape = torch.Size(int(d) for d in stored_shape)
        bits = 32 * packed.shape[1] // shape[1]
        if packed.dtype != torch.int32 or not 1 <= bits <= 8:  # fp4 (nvfp4, mxfp4) packs otherwise
            return None
        q = unpack_from_int32(packed, bits, shape)
        if zeros is not None and zeros.dtype == torch.int32 and zeros.shape[0] != shape[0]:  # packed along outputs
            zeros = unpack_from_int32(zeros, bits, torch.Size((shape[0], scales.shape[1])), packed_dim=0)
        return Integers(q, scales.float(), None if zeros is None else zeros.float(), bits, g_idx, scales.dtype)
    weight = read(where, f"{prefix}.weight")
    if weight is None or weight.dtype != torch.int8:
        return None
    return Integers(weight, scales.float(), None if zeros is None else zeros.float(), 8, g_idx, scales.dtype)


def why_not_ours(ints: Integers) -> str:
    """"" where ``kept_linear`` takes these integers, else why not (counted in the start-up line)."""
    if ints.bits not in (4, 8):
        return f"{ints.bits}-bit integers (our kernels take int4 and int8)"
    if ints.q.shape[1] % ints.scales.shape[1]:
        return "a partial group of inputs"
    if ints.g_idx is not None and not torch.equal(ints.g_idx.long(), torch.arange(ints.q.shape[1]) // ints.group):
        return "activation ordering (inputs grouped out of order)"
    if ints.bits == 8 and ints.zeros is not None and bool(ints.zeros.any()):
        return "asymmetric int8 (our int8 kernel has no zero points)"
    if ints.scales.shape[1] > 1 and ints.group not in KERNEL_GROUPS and ints.group % 32:
        return f"int{ints.bits} in groups of {ints.group} inputs (our kernels take multiples of 32)"
    return ""


def kept_linear(ints: Integers, bias: torch.Tensor | None,
                int8_rows: bool = False) -> tuple[QuantizedLinear, torch.Tensor, str]:
    """Our QuantizedLinear for these integers, the float64 weights it multiplies by, and its kind."""
    out_features, in_features = ints.q.shape
    scales, zeros, group = ints.scales, ints.zeros, ints.group
    where = "per channel" if scales.shape[1] == 1 else f"groups of {group}"
    if ints.bits == 8:
        quantized = QuantizedLinear.from_int8(ints.q.to(torch.int8), scales if scales.shape[1] > 1 else scales[:, 0],
                                              bias, ours=True, int8_rows=int8_rows)
        return quantized, dequantize_int8(ints.q, scales), f"int8 ({where})"
    if group not in KERNEL_GROUPS:  # the same scales repeated per 32 inputs
        scales = scales.repeat_interleave(group // 32, dim=1)
        zeros = None if zeros is None else zeros.repeat_interleave(group // 32, dim=1)
    zeros = torch.zeros_like(scales) if zeros is None else zeros
    offsets = -(8 + zeros) * scales  # exact: a small integer times a float32 scale, in float32's range
    unsigned = ints.q.int() + 8
    quantized = QuantizedLinear.from_int4(unsigned, scales, None, bias, ours=True, offsets=offsets, int8_rows=int8_rows)
    rows = unsigned.double().view(out_features, scales.shape[1], -1)
    weights = (rows * scales.double()[..., None] + offsets.double()[..., None]).view(out_features, in_features)
    return quantized, weights, f"int4 ({where})"


def same_weights(ours: torch.Tensor, library: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> bool:
    """Our exact weights (float64) against the library's dense ones, which it computes as (q - zero
    point) * scale in the scales' dtype (float16 for AutoAWQ's: rounded to 11 bits): equal within two
    of that dtype's epsilons of each row's largest weight. A misread layout is off by whole scale
    steps (a fifteenth of a 4-bit row's range at the least), far past that."""
    tolerance = ours.abs().amax(dim=1, keepdim=True) * 2 * torch.finfo(scale_dtype).eps
    return ours.shape == library.shape and bool(((ours - library.double()).abs() <= tolerance).all())


# ------------------------------------------------------------------ the model


def keep_packed(model: nn.Module, layers: list[nn.Module], folder: str, method: str, why_float: str,
                int8_rows: bool = False) -> CompressedReport:
    """Replace, in place, each linear of ``layers`` that the checkpoint in ``folder`` stores as integers
    our kernels take by its QuantizedLinear (module docstring); ``why_float`` (``gguf.can_keep``) not ""
    leaves every one as dequantized, for that reason. Returns what it did."""
    from session.model.gguf import linear_targets

    before = model_bytes(model)
    where = file_tensors(folder)
    kept: Counter[str] = Counter()  # kind -> linears kept packed
    dequantized: Counter[str] = Counter()  # why not -> linears left dequantized
    stored = {name.removesuffix(".weight_scale") for name in where if name.endswith(".weight_scale")}
    for name, parent, attribute, linear in linear_targets(model, layers):
        prefix = name.removesuffix(".weight")
        if attribute == "lm_head" or prefix not in stored:
            continue  # the head as the model has it; a linear the file stores in float
        stored.discard(prefix)
        ints = integers(where, prefix)
        if ints is None:
            dequantized["a format without int4/int8 integers (fp8, fp4, per-tensor scales)"] += 1
            continue
        why = why_float or why_not_ours(ints)
        if not why:
            quantized, weights, kind = kept_linear(ints, linear.bias, int8_rows)
            if same_weights(weights, linear.weight.detach(), ints.scale_dtype):
                setattr(parent, attribute, quantized)
                kept[kind] += 1
                continue
            why = "their integers did not give the library's weights"
        dequantized[why] += 1
    if stored:  # the head, a vision tower, or names transformers maps otherwise
        dequantized["outside the decoder layers"] += len(stored)
    return CompressedReport(method, dict(kept), dict(dequantized), before, model_bytes(model), int8_rows)
