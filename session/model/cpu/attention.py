"""Decode attention on CPU: one call per layer for the whole batch, built at start-up. bfloat16 is
torch's bits (below); float32 (``decode_attention_f32``) runs the same steps on float32 keys and values
with an exact exponential, equal to torch's to rounding (docs/ENGINE.md, "float32 on the same kernels").

torch's CPU flash-attention kernel runs a bfloat16 query's two products through MKL's bfloat16 GEMM,
which for one decode row was several times slower than float32 although the keys read half the bytes.
``csrc/decode_attention.cpp`` computes the same thing, step for step (its header lists them), reading
keys and values as bfloat16 from the pool through each row's block table, parallel over rows and
heads: one call per layer instead of one per row and layer (``python -m benchmarks.cpu_attention``;
docs/MEASUREMENTS.md, "Decode attention on CPU").

Its results are torch's bits (tests/unit/model/cpu/test_cpu_attention.py), so greedy output keeps agreeing with
transformers' own bfloat16 ``generate`` (benchmarks/bf16_agreement.py). The order of additions was
probed on this AMD CPU (AVX512-BF16, no AMX); MKL picks its GEMM kernels per CPU, and on an Intel one
with AMX (``kernels.bf16_products_use_amx``) torch's bits differ from ours by rounding: 1 output in
about 2,400 on random rows, by a bfloat16 ulp (that test checks it to rounding there). Ours is taken
there too: each query's bits still do not depend on the batch.

The library is built at start-up and cached (session/model/cpu/kernels.py). Where that cannot happen (no
compiler, no AVX-512, a build error) ``load`` logs why and returns False, and the model runner keeps
torch's kernel: slower, same tokens. Who calls this: ``ModelRunner`` at start-up (on the engine's
compute thread), never per step.
"""

from __future__ import annotations

import torch

from session.model.cpu.kernels import AVX2, AVX512, CppKernel

KERNEL = CppKernel("decode attention", "decode_attention.cpp", (AVX512, AVX2))


def load() -> bool:
    """Make ``torch.ops.resident.decode_attention_bf16`` available (building it if needed); False,
    with the reason logged, where it cannot be (session/model/cpu/kernels.py). Idempotent within a process."""
    return KERNEL.load()


DTYPES = (torch.bfloat16, torch.float32)  # the pools the kernel reads


def supports(dtype: torch.dtype) -> bool:
    """Whether our kernel attends over a pool of ``dtype`` here (loading it if needed): float32 on any
    build, bfloat16 on the AVX-512 one only (its order of additions was probed on such a CPU)."""
    return dtype in DTYPES and load() and (dtype == torch.float32 or KERNEL.isa == AVX512)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                     starts: torch.Tensor, ends: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, hd] bfloat16 or float32; k, v: one layer of a head-major pool [KVH, NB, bt, hd] of q's
    dtype; block_table [B, W] int32; row b attends to its positions starts[b] .. ends[b]-1 (int32 [B])
    -> [B, H, hd]."""
    op = torch.ops.resident.decode_attention_bf16 if q.dtype == torch.bfloat16 else torch.ops.resident.decode_attention_f32
    return op(q, k, v, block_table, starts, ends, scale)
