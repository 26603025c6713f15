"""Our C++ CPU kernels: compiled at start-up with the system C++ compiler, cached, loaded into torch.

Each kernel is one source in ``session/model/cpu/csrc`` registering operators under ``torch.ops.resident``. It is
compiled once per source (with the headers beside it), torch version and flags into ``RESIDENT_KERNEL_CACHE`` (default
``~/.cache/resident/kernels``), into a temporary file first and then renamed, so that workers starting
together never load a half-written library. It links the libgomp torch ships (``-fopenmp``), so that
ATen's ``parallel_for`` inside it runs on torch's one OpenMP team. A kernel lists the instruction sets
it can be built for, widest first (``Isa``: AVX512-BF16, AVX-512, AVX2 with FMA; csrc/simd.h gives
the float32 kernels the same bits on AVX-512 and AVX2), and the first the CPU reports is built;
``RESIDENT_KERNEL_ISA=avx2`` caps every kernel at AVX2 (to run the AVX2 build on an AVX-512 CPU). Where
a kernel cannot be had (the CPU lacks every set it lists, no compiler, a build error) ``load`` logs
why and returns False, and the caller keeps torch's path: slower, same results. Who calls this: session/model/cpu/attention.py and
session/model/cpu/linear.py, at start-up, never per step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# contract off: no fused multiply-add where torch's kernels round twice
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp")


@dataclass(frozen=True)
class Isa:
    """An instruction set a kernel can be compiled for: its compiler flags and the /proc/cpuinfo flags
    the CPU must report for them."""

    name: str
    flags: tuple[str, ...]
    cpu_requires: tuple[str, ...]


AVX512_BF16 = Isa("avx512-bf16", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
                  ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"))
AVX512_VNNI = Isa("avx512-vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"),
                  ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"))
AVX512 = Isa("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"), ("avx512f", "avx512bw", "avx512vl", "fma"))
AVX2 = Isa("avx2", ("-mavx2", "-mfma"), ("avx2", "fma"))
AVX2_F16C = Isa("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))  # float16 loads (every AVX2 CPU)
ISA_CAPS = {"avx512-bf16": (AVX512_BF16, AVX512_VNNI, AVX512, AVX2, AVX2_F16C),
            "avx512": (AVX512_VNNI, AVX512, AVX2, AVX2_F16C), "avx2": (AVX2, AVX2_F16C)}


def allowed_isas() -> tuple[Isa, ...]:
    """The sets ``RESIDENT_KERNEL_ISA`` allows (all when unset)."""
    cap = os.environ.get("RESIDENT_KERNEL_ISA", "").strip().lower()
    if cap and cap not in ISA_CAPS:
        raise ValueError(f"RESIDENT_KERNEL_ISA={cap!r}: one of {', '.join(ISA_CAPS)}")
    return ISA_CAPS[cap or "avx512-bf16"]


def cache_dir() -> Path:
    return Path(os.environ.get("RESIDENT_KERNEL_CACHE") or Path.home() / ".cache" / "resident" / "kernels")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags Linux reports for this CPU (/proc/cpuinfo), read once; empty where
    unreadable."""
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(info.read().split())
    except OSError:
        return frozenset()


def bf16_products_use_amx() -> bool:
    """torch's bfloat16 products take AMX tiles on this CPU (it reports amx_bf16 and amx_tile): oneDNN's
    matmul (``brg_matmul:..._amx``) and MKL's bfloat16 GEMM (SDPA's products) then add in another order
    than on the AVX512-BF16 and AVX2 CPUs our kernels reproduce, so their bits differ from ours by
    rounding (session/model/cpu/linear.py, session/model/cpu/attention.py)."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags()


class CppKernel:
    """One source file's operators: ``load()`` builds (if needed) and loads them, once per process."""

    def __init__(self, name: str, source: str, isas: tuple[Isa, ...]):
        self.name = name  # for logs: "bfloat16 decode attention"
        self.source = CSRC / source
        self.isas = isas  # widest first
        self.loaded: bool | None = None  # None: not tried yet in this process
        self.isa: Isa | None = None  # the set the loaded library was built for

    def choose(self) -> Isa | None:
        """The widest of this kernel's sets that the CPU reports and RESIDENT_KERNEL_ISA allows."""
        have, allowed = cpu_flags(), allowed_isas()
        return next((isa for isa in self.isas if isa in allowed and set(isa.cpu_requires) <= have), None)

    def supported(self) -> bool:
        return self.choose() is not None

    @property
    def isa_name(self) -> str:
        """The instruction set the loaded library was built for, for labels ("none" until ``load`` succeeds)."""
        return self.isa.name if self.isa is not None else "none"

    @property
    def flags(self) -> list[str]:
        isa = self.choose()
        return [*BASE_FLAGS, *(isa.flags if isa else ())]

    def library_path(self) -> Path:
        """Where the library for this source, torch and flags lives (built or not)."""
        headers = b"".join(path.read_bytes() for path in sorted(CSRC.glob("*.h")))  # what the sources include
        key = hashlib.sha256(self.source.read_bytes() + headers + torch.__version__.encode()
                             + " ".join(self.flags).encode()).hexdigest()
        return cache_dir() / f"resident_{self.source.stem}_{key[:16]}.so"

    def build(self, target: Path) -> None:
        """Compile the source into ``target`` (a temporary file, then renamed)."""
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
            command = [compiler, *self.flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(self.source),
                       "-o", str(partial), *libraries, "-lc10", "-ltorch_cpu", "-ltorch"]
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {self.source.name} failed:\n{result.stderr[-4000:]}")
            os.replace(partial, target)

    def load(self) -> bool:
        """Make the operators available (building them if needed); False, with the reason logged,
        where they cannot be. Decided once per process."""
        if self.loaded is not None:
            return self.loaded
        self.loaded = False
        isa = self.choose()
        if isa is None:
            logger.info("%s: CPU lacks %s; using torch's path", self.name,
                        " or ".join("/".join(isa.cpu_requires) for isa in self.isas))
            return False
        try:
            target = self.library_path()
            if not target.exists():
                logger.info("%s: building %s for %s", self.name, target, isa.name)
                self.build(target)
            torch.ops.load_library(str(target))
            self.loaded, self.isa = True, isa
        except Exception as error:  # any failure leaves torch's path in place: slower, same results
            logger.warning("%s unavailable, using torch's path: %s", self.name, error)
        return self.loaded
