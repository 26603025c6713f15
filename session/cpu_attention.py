"""bfloat16 decode attention on CPU: one call per layer for the whole batch, built at start-up.

torch's CPU flash-attention kernel runs a bfloat16 query's two products through MKL's bfloat16 GEMM,
which on this project's AMD CPU (AVX512-BF16, no AMX) took 261 us per 600-key row and layer against
41 us in float32 (8 heads of 64): bfloat16 decoding was slower than float32 although its weights
read half the bytes. ``csrc/decode_attention.cpp`` computes the same thing, step for step (its
header lists them), reading keys and values as bfloat16 from the pool through each row's block
table, parallel over rows and heads: one call per layer instead of one per row and layer
(``python -m benchmarks.cpu_attention``: 30 us for that row against torch's 296, 795 us for 16 rows
against 5,034).

Its results are torch's bits (tests/unit/test_cpu_attention.py), so greedy output keeps agreeing with
transformers' own bfloat16 ``generate`` (benchmarks/bf16_agreement.py). The order of additions was
probed on this AMD CPU (AVX512-BF16, no AMX); MKL picks its GEMM kernels per CPU, so on another one
(an Intel CPU with AMX) torch's bits may differ from ours by rounding, which that test would show.

The library is compiled once per source, torch version and flags with the system C++ compiler into
``RESIDENT_KERNEL_CACHE`` (default ``~/.cache/resident/kernels``) and loaded as ``torch.ops.resident``.
Where that cannot happen (no compiler, no AVX-512, a build error) ``load`` logs why and returns False,
and the model runner keeps torch's kernel: slower, same tokens. Who calls this: ``ModelRunner`` at
start-up (on the engine's compute thread), never per step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma",
         "-ffp-contract=off", "-fopenmp"]  # contract off: no fused multiply-add where torch's kernel rounds twice
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "fma")

_loaded: bool | None = None  # None: not tried yet in this process


def cache_dir() -> Path:
    return Path(os.environ.get("RESIDENT_KERNEL_CACHE") or Path.home() / ".cache" / "resident" / "kernels")


def cpu_supports() -> bool:
    """The CPU reports the instructions the library is built for (Linux /proc/cpuinfo)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return False
    return all(flag in flags for flag in CPU_FLAGS)


def library_path() -> Path:
    """Where the library for this source, torch and flags lives (built or not)."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(FLAGS).encode()).hexdigest()
    return cache_dir() / f"resident_decode_attention_{key[:16]}.so"


def build(target: Path) -> None:
    """Compile SOURCE into ``target``: into a temporary file first, then renamed, so that workers
    starting together never load a half-written library."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCE), "-o", str(partial),
                   *libraries, "-lc10", "-ltorch_cpu", "-ltorch"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{result.stderr[-4000:]}")
        os.replace(partial, target)


def load() -> bool:
    """Make ``torch.ops.resident.decode_attention_bf16`` available (building it if needed); False,
    with the reason logged, where it cannot be. Idempotent within a process."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if not cpu_supports():
        logger.info("bfloat16 decode attention: CPU lacks %s; using torch's kernel", "/".join(CPU_FLAGS))
        return False
    try:
        target = library_path()
        if not target.exists():
            logger.info("bfloat16 decode attention: building %s", target)
            build(target)
        torch.ops.load_library(str(target))
        _loaded = True
    except Exception as error:  # any failure leaves torch's kernel in place: slower, same tokens
        logger.warning("bfloat16 decode attention unavailable, using torch's kernel: %s", error)
    return _loaded


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                     starts: torch.Tensor, ends: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, hd] bfloat16; k, v: one layer of a head-major pool [KVH, NB, bt, hd]; block_table [B, W]
    int32; row b attends to its positions starts[b] .. ends[b]-1 (int32 [B]) -> [B, H, hd]."""
    return torch.ops.resident.decode_attention_bf16(q, k, v, block_table, starts, ends, scale)
