"""GGUF checkpoints kept packed: a llama.cpp file's quantized linears served from its own blocks.

transformers reads a GGUF file (session/checkpoints.py) and dequantizes every tensor to float; it
keeps nothing packed. On CPU with float32 activations and our kernels, ``keep_packed`` then replaces
each decoder-layer linear, and the head, whose tensor the file stores in one of these formats by a
``QuantizedLinear`` made from the file's own blocks, exactly:

- ``Q8_0``: blocks of 32 int8 with a float16 scale d: w = d q -> our int8 in groups of 32 inputs;
- ``Q4_0``: blocks of 32 nibbles with a float16 scale: w = d q - 8 d -> our int4, groups of 32;
- ``Q4_1``: blocks of 32 nibbles with a float16 scale and min: w = d q + m -> our int4, groups of 32;
- ``Q4_K``: super-blocks of 256 with float16 d and dmin and eight 6-bit scales and mins: per 32
  inputs w = (d sc) q - dmin m -> our int4, groups of 32 (the most downloaded file type, Q4_K_M, holds
  mostly Q4_K and some Q6_K).

Each replacement is checked against the float32 weight transformers dequantized, element for element
(our q scale + offset in float64 rounds once to float32, as gguf's float32 arithmetic does, which is
exact before its last addition); a tensor that differs (a layout transformers permutes in a way this
module does not follow) stays float, counted. A head tied to the embeddings (SmolLM2's ``token_embd``)
becomes an int8 copy from the embedding's blocks; the lookup reads the float embeddings.

With RESIDENT_ACTIVATIONS=int8 the same blocks go to the int8-activation kernel instead (``int8_rows``:
csrc/linear_q8.h, rows rounded to int8 per 32 inputs, as llama.cpp computes these files), scales and
offsets kept in float16 where they are float16 (Q8_0, Q4_0, Q4_1: a quarter fewer bytes for int4).

Everything else stays as transformers dequantized it, in the model's dtype, and the start-up line
counts it by GGUF type: norms (F32), other formats (F16, BF16, Q5_*, Q6_K, IQ*), and every linear
where our kernels cannot run (CUDA, bfloat16 activations, RESIDENT_CPU_KERNELS=0). RESIDENT_QUANTIZATION
int8 or int4 then quantizes those float linears (session/model/quantize.py).

Where the file's layout is transformers': ``get_gguf_hf_weights_map`` names each GGUF tensor's module,
its ``TENSOR_PROCESSORS`` undo the permutations llama.cpp's converter made (Llama's q and k rows);
the permutation is applied to the packed rows (each row one output's blocks) as to the float ones.

Who calls this: ``ModelRunner`` once at load, before RESIDENT_QUANTIZATION, packing and LoRA.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from session.model.cpu import linear as cpu_linear
from session.model.quantize import QuantizedLinear, dequantize_int8, model_bytes, target_linears

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GROUP = 32  # inputs per scale in every kept format (Q4_K's sub-blocks)
SUPER_BLOCK = 256  # Q4_K's inputs per super-block
BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16, "Q4_1": 4 + 16, "Q4_K": 4 + 12 + 128}
INT8_FORMATS = ("Q8_0",)
INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")


@dataclass(frozen=True)
class GgufReport:
    """What ``keep_packed`` did; ``describe`` is the start-up log line."""

    file: str
    kept: dict[str, int]  # GGUF type -> linears kept packed (the head included)
    head: str | None  # the GGUF type the head was kept from, or None (float)
    dequantized: dict[str, int]  # GGUF type -> linears left float, as transformers dequantized them
    mismatched: int  # kept-type tensors whose blocks did not give transformers' weights (left float)
    why_float: str  # why kept types were left float ("" when our kernels ran)
    model_bytes_before: int
    model_bytes_after: int
    other: dict[str, int] = field(default_factory=dict)  # GGUF type -> other tensors (norms, embeddings)
    int8_rows: bool = False  # the kept linears multiply int8-quantized activations (RESIDENT_ACTIVATIONS)

    @property
    def num_kept(self) -> int:
        return sum(self.kept.values())

    def describe(self) -> str:
        kept = ", ".join(f"{count} {kind} -> {'int8' if kind in INT8_FORMATS else 'int4'} (groups of {GROUP})"
                         for kind, count in sorted(self.kept.items())) or "none"
        head = f" (the head from {self.head})" if self.head else ""
        inputs = "inputs quantized to int8 per 32, as llama.cpp" if self.int8_rows else "float32 inputs"
        line = f"weights: GGUF {self.file}, kept packed on our kernels ({inputs}): {kept}{head}"
        if self.dequantized:
            floats = ", ".join(f"{count} {kind}" for kind, count in sorted(self.dequantized.items()))
            line += f"; linears dequantized to float by transformers: {floats}"
            if self.why_float:
                line += f" ({self.why_float})"
        if self.mismatched:
            line += f"; {self.mismatched} left float: their blocks did not give transformers' weights"
        return line + f"; {self.model_bytes_before / 1e6:.0f} MB -> {self.model_bytes_after / 1e6:.0f} MB"


# ------------------------------------------------------------------ blocks -> our formats (pure functions)


def split_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """A tensor's raw rows [out, blocks * bytes] (uint8, one output's blocks per row) -> [out, blocks, bytes]."""
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(rows, -1, BLOCK_BYTES[kind])


def halves(data: np.ndarray) -> np.ndarray:
    """float16 values stored in the last axis's pairs of bytes -> float32 [..., pairs]."""
    return np.ascontiguousarray(data).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's nibble order for 32 inputs in 16 bytes: byte j holds input j low and input j + 16 high
    -> uint8 [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> q int8 [out, in], scales float32 [out, in / 32] (w = q scale)."""
    blocks = split_blocks(data, "Q8_0")
    scales = halves(blocks[..., :2])[..., 0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
    return torch.from_numpy(q.copy()), torch.from_numpy(scales)


def unpack_q4(data: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0, Q4_1 or Q4_K rows -> q int32 [out, in] in 0..15, scales and offsets float32 [out, in / 32]
    (w = q scale + offset, each exact in float32)."""
    blocks = split_blocks(data, kind)
    rows, count = blocks.shape[:2]
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        d, dmin = halves(blocks[..., 0:2]), halves(blocks[..., 2:4])  # [out, count, 1]
        sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [out * count, 8] each
        scales = d * sc.reshape(rows, count, 8).astype(np.float32)
        offsets = -(dmin * mins.reshape(rows, count, 8).astype(np.float32))
        qs = blocks[..., 16:].reshape(rows, count, 4, 1, 32)  # 4 chunks of 64 inputs: 32 low, then 32 high
        q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
        q = q.reshape(rows, count * SUPER_BLOCK)
        return (torch.from_numpy(q.astype(np.int32)), torch.from_numpy(scales.reshape(rows, -1)),
                torch.from_numpy(offsets.reshape(rows, -1)))
    scales = halves(blocks[..., :2])[..., 0]
    if kind == "Q4_0":
        offsets, qs = -8 * scales, blocks[..., 2:]
    else:
        offsets, qs = halves(blocks[..., 2:4])[..., 0], blocks[..., 4:]
    q = nibbles(qs).reshape(rows, count * GROUP)
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(scales), torch.from_numpy(offsets)


def dequantize_q4(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The weights ``unpack_q4``'s parts stand for, in float64 (exact): q scale + offset per group."""
    rows = q.shape[0]
    grouped = q.double().view(rows, scales.shape[1], -1)
    return (grouped * scales.double()[..., None] + offsets.double()[..., None]).view(q.shape)


def packed_linear(data: np.ndarray, kind: str, bias: torch.Tensor | None,
                  int8_rows: bool = False) -> tuple[QuantizedLinear, torch.Tensor]:
    """A GGUF tensor's rows as our QuantizedLinear (``int8_rows``: on the int8-activation kernel, as
    llama.cpp multiplies them), and the float64 weights it multiplies by."""
    if kind in INT8_FORMATS:
        q, scales = unpack_q8_0(data)
        return QuantizedLinear.from_int8(q, scales, bias, ours=True, int8_rows=int8_rows), dequantize_int8(q, scales)
    q, scales, offsets = unpack_q4(data, kind)
    return (QuantizedLinear.from_int4(q, scales, None, bias, ours=True, offsets=offsets, int8_rows=int8_rows),
            dequantize_q4(q, scales, offsets))


# ------------------------------------------------------------------ the model


def can_keep(device: torch.device, dtype: torch.dtype, cpu_kernels: bool, int8_rows: bool = False) -> str:
    """"" where our kernels can take a GGUF's packed formats, else why not (the log line says it)."""
    if device.type != "cpu":
        return f"kept packed only on CPU; this model runs on {device.type}"
    if dtype != torch.float32:
        return f"our int8/int4 kernels take float32 activations, not {dtype}"
    if not cpu_kernels:
        return "RESIDENT_CPU_KERNELS=0"
    kernels = (cpu_linear.Q8_KERNEL,) if int8_rows else (cpu_linear.INT8_KERNEL, cpu_linear.INT4_KERNEL)
    if not all(kernel.load() for kernel in kernels):
        return "our int8/int4 kernels do not build on this machine"
    return ""


def tensor_names(model: PreTrainedModel, reader) -> dict[str, tuple[str, np.ndarray, str]]:
    """Module parameter name -> (GGUF type, the tensor's raw rows as transformers' processor arranges
    them, GGUF name), for every tensor of the file that names one of ``model``'s parameters."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    names = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        rows = np.asarray(tensor.data)
        if kind in BLOCK_BYTES:  # rows permuted as transformers permutes the float ones (Llama's q, k)
            try:
                result = processor.process(weights=rows, name=tensor.name, tensor_key_mapping=mapping,
                                           parsed_parameters={"config": model.config.to_dict(), "tensors": {}})
                rows, name = result.weights, result.name
            except Exception:  # a processor that needs float data: the check below leaves it float
                name = tensor.name
        else:
            name = tensor.name
        if name in mapping:
            names[mapping[name]] = (kind, rows, tensor.name)
    return names


def linear_targets(model: nn.Module, layers: list[nn.Module]) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(parameter name of the weight, parent, attribute, linear) for every ``nn.Linear`` of ``layers``
    and the head, named as in ``model.state_dict()``."""
    names = {id(module): name for name, module in model.named_modules()}
    targets = [(f"{names[id(linear)]}.weight", parent, attribute, linear)
               for parent, attribute, linear in target_linears(layers)]
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear:
        targets.append(("lm_head.weight", model, "lm_head", head))
    return targets


def keep_packed(model: PreTrainedModel, layers: list[nn.Module], path: Path, why_float: str,
                int8_rows: bool = False) -> GgufReport:
    """Replace, in place, each linear of ``layers`` and the head whose GGUF tensor is in a kept format by
    its QuantizedLinear from the file's blocks (module docstring); ``why_float`` (``can_keep``) not ""
    keeps every linear float and says why. Returns what it did."""
    from gguf import GGUFReader

    before = model_bytes(model)
    names = tensor_names(model, GGUFReader(str(path)))
    embeddings = model.get_input_embeddings()
    kept: Counter[str] = Counter()  # GGUF type -> linears kept packed
    dequantized: Counter[str] = Counter()  # GGUF type -> linears left float
    mismatched = 0
    head_from: str | None = None  # the GGUF type the head was kept in
    used = set()
    for name, parent, attribute, linear in linear_targets(model, layers):
        entry = names.get(name)
        if entry is None and attribute == "lm_head" and linear.weight is getattr(embeddings, "weight", None):
            entry = names.get(f"{name_of(model, embeddings)}.weight")  # tied: the embedding's blocks
        if entry is None:
            continue
        kind, rows, gguf_name = entry
        used.add(gguf_name)
        if kind not in BLOCK_BYTES or why_float:
            dequantized[kind] += 1
            continue
        quantized, weights = packed_linear(rows, kind, linear.bias, int8_rows)
        if weights.shape != linear.weight.shape or not torch.equal(weights.float(), linear.weight.float()):
            mismatched += 1
            continue
        setattr(parent, attribute, quantized)
        kept[kind] += 1
        if attribute == "lm_head":
            head_from = kind
    other = Counter(kind for kind, _, gguf_name in names.values() if gguf_name not in used)
    return GgufReport(path.name, dict(kept), head_from, dict(dequantized), mismatched, why_float, before,
                      model_bytes(model), dict(other), int8_rows)


def name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)
