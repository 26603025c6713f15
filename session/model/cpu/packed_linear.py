"""CPU weight prepacking: the model's linears run on oneDNN with weights reordered once, at load.

``F.linear`` on CPU reorders a bfloat16 weight into oneDNN's blocked layout on every call, and runs
float32 through MKL, slowly for a one-row product. Reordering each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's weight freezing uses) and calling
oneDNN directly is faster for decode rows in both dtypes (benchmarks/cpu_linear.py;
docs/MEASUREMENTS.md, "Prepacked linears").

bfloat16 results are bit-identical to ``F.linear`` (which already runs oneDNN); float32 results differ
by rounding only (another summation order), like any other BLAS.

A oneDNN call costs more to set up than an MKL one, which a small float32 weight does not win back;
the sizes met at about 256 KiB (docs/MEASUREMENTS.md, "Prepacked linears"). So float32 weights under
``MIN_FLOAT32_BYTES`` stay dense; bfloat16 weights were faster packed at every size measured.

The packed weight replaces the module's ``weight`` (no second copy; a head tied to the embeddings keeps
the embedding's). ``PackedLinear`` stays an ``nn.Linear`` with its in/out features, so LoRA wrapping
(session/model/lora_bank.py) works unchanged. Who calls this: ``ModelRunner`` once after loading, on CPU.
"""

from __future__ import annotations

import logging
from typing import TypeGuard, TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)

L = TypeVar("L", bound=nn.Linear)  # what ``swap_weight`` makes a linear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MIN_FLOAT32_BYTES = 256 << 10  # smaller float32 weights run faster dense (module docstring)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking applies: CPU, float32 or bfloat16, a torch built with oneDNN; bfloat16 only where
    oneDNN has a bfloat16 path on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: its reorder raises
    elsewhere)."""
    if not (device.type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight lives in oneDNN's blocked layout (``packed``: an opaque mkldnn
    tensor, [out, in] logically). Only forward works; the weight cannot be read back as a dense tensor."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; oneDNN takes any leading shape and any number of rows
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed=onednn"


def pack_linear(module: nn.Linear) -> PackedLinear:
    """Turn ``module`` into a PackedLinear in place (its dense weight is dropped) and return it."""
    weight = module.weight.detach()
    return swap_weight(module, PackedLinear, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))


def swap_weight(module: nn.Linear, cls: type[L], packed: torch.Tensor) -> L:
    """Make ``module`` a ``cls`` (an nn.Linear that runs from ``packed``), its dense weight dropped
    (no second copy; a head tied to the embeddings keeps the embedding's); returns it, now a ``cls``.
    Also session/model/cpu/linear.py."""
    del module.weight
    module.__class__ = cls
    module.register_buffer("packed", packed, persistent=False)
    assert isinstance(module, cls)
    return module


def worth_packing(module: nn.Module) -> TypeGuard[nn.Linear]:
    """A plain ``nn.Linear`` that runs faster packed: bfloat16, or float32 of at least MIN_FLOAT32_BYTES."""
    if type(module) is not nn.Linear or not can_pack(module.weight.device, module.weight.dtype):
        return False
    weight = module.weight
    return weight.dtype == torch.bfloat16 or weight.numel() * weight.element_size() >= MIN_FLOAT32_BYTES


def pack_linears(modules: list[nn.Module]) -> int:
    """Pack every linear inside ``modules`` that is worth it; returns how many were packed."""
    count = 0
    for root in modules:
        for module in list(root.modules()):
            if worth_packing(module):
                pack_linear(module)
                count += 1
    return count
