"""Our C++ CPU kernels: compiled at start-up with the system C++ compiler, cached, loaded into torch.

Each kernel is one source in ``session/csrc`` registering operators under ``torch.ops.resident``. It is
compiled once per source (with the headers beside it), torch version and flags into ``RESIDENT_KERNEL_CACHE`` (default
``~/.cache/resident/kernels``), into a temporary file first and then renamed, so that workers starting
together never load a half-written library. It links the libgomp torch ships (``-fopenmp``), so that
ATen's ``parallel_for`` inside it runs on torch's one OpenMP team. Where a kernel cannot be had (the
CPU lacks its instructions, no compiler, a build error) ``load`` logs why and returns False, and the
caller keeps torch's path: slower, same results. Who calls this: session/cpu_attention.py and
session/cpu_linear.py, at start-up, never per step.
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

CSRC = Path(__file__).parent / "csrc"
# contract off: no fused multiply-add where torch's kernels round twice
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp")


def cache_dir() -> Path:
    return Path(os.environ.get("RESIDENT_KERNEL_CACHE") or Path.home() / ".cache" / "resident" / "kernels")


def cpu_flags() -> set[str]:
    """The instruction-set flags Linux reports for this CPU (/proc/cpuinfo); empty where unreadable."""
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()


class CppKernel:
    """One source file's operators: ``load()`` builds (if needed) and loads them, once per process."""

    def __init__(self, name: str, source: str, isa: tuple[str, ...], cpu_requires: tuple[str, ...]):
        self.name = name  # for logs: "bfloat16 decode attention"
        self.source = CSRC / source
        self.flags = [*BASE_FLAGS, *isa]
        self.cpu_requires = cpu_requires  # /proc/cpuinfo flags the instructions in ``isa`` need
        self.loaded: bool | None = None  # None: not tried yet in this process

    def supported(self) -> bool:
        return set(self.cpu_requires) <= cpu_flags()

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
        if not self.supported():
            logger.info("%s: CPU lacks %s; using torch's path", self.name, "/".join(self.cpu_requires))
            return False
        try:
            target = self.library_path()
            if not target.exists():
                logger.info("%s: building %s", self.name, target)
                self.build(target)
            torch.ops.load_library(str(target))
            self.loaded = True
        except Exception as error:  # any failure leaves torch's path in place: slower, same results
            logger.warning("%s unavailable, using torch's path: %s", self.name, error)
        return self.loaded
