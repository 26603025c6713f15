"""Building our C++ kernels (session/model/cpu/kernels.py): which instruction set each is built for on which CPU,
RESIDENT_KERNEL_ISA's cap, the cache key, and (where the CPU has AVX-512) the AVX2 build computing the
AVX-512 build's bits: the float32 kernels' lanes are the same arithmetic on either (csrc/simd.h)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from session.model.cpu import kernels
from session.model.cpu.kernels import AVX2, AVX512, AVX512_BF16, CppKernel

ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
ZEN1 = {"avx", "avx2", "fma"}
REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("flags,isas,cap,expected", [
    (ZEN4, (AVX512, AVX2), "", AVX512),
    (ZEN1, (AVX512, AVX2), "", AVX2),
    (ZEN4, (AVX512, AVX2), "avx2", AVX2),
    (ZEN4, (AVX512_BF16,), "", AVX512_BF16),
    (ZEN4, (AVX512_BF16,), "avx512", None),  # the cap leaves it nothing
    (ZEN1, (AVX512_BF16,), "", None),
    ({"sse4_2", "avx"}, (AVX512, AVX2), "", None),
])
def test_the_widest_set_the_cpu_reports_and_the_cap_allows(monkeypatch, flags, isas, cap, expected):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setenv("RESIDENT_KERNEL_ISA", cap)
    kernel = CppKernel("test", "linear_f32.cpp", isas)
    assert kernel.choose() == expected
    assert kernel.supported() == (expected is not None)
    assert kernel.flags == [*kernels.BASE_FLAGS, *(expected.flags if expected else ())]


def test_a_cpu_without_any_set_keeps_torchs_path(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse4_2"})
    kernel = CppKernel("test", "linear_f32.cpp", (AVX512, AVX2))
    with caplog.at_level("INFO", logger="session.model.cpu.kernels"):
        assert kernel.load() is False
    assert "CPU lacks avx512f/avx512bw/avx512vl/fma or avx2/fma" in caplog.text
    assert kernel.isa is None


def test_an_unknown_cap_is_refused(monkeypatch):
    monkeypatch.setenv("RESIDENT_KERNEL_ISA", "avx1024")
    with pytest.raises(ValueError, match="RESIDENT_KERNEL_ISA='avx1024': one of avx512-bf16, avx512, avx2"):
        kernels.allowed_isas()


def test_each_set_and_each_header_change_has_its_own_library(monkeypatch, tmp_path):
    """The cached library's key covers the flags and the headers beside the source (csrc/simd.h), so
    an AVX2 build never loads as the AVX-512 one, nor a library built from an old header."""
    for name in ("linear_f32.cpp", "simd.h"):
        (tmp_path / name).write_bytes((kernels.CSRC / name).read_bytes())
    monkeypatch.setattr(kernels, "CSRC", tmp_path)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ZEN4)
    monkeypatch.delenv("RESIDENT_KERNEL_ISA", raising=False)
    kernel = CppKernel("test", "linear_f32.cpp", (AVX512, AVX2))
    wide = kernel.library_path()
    monkeypatch.setenv("RESIDENT_KERNEL_ISA", "avx2")
    narrow = kernel.library_path()
    assert narrow != wide
    (tmp_path / "simd.h").write_text((tmp_path / "simd.h").read_text() + "\n// edited\n")
    assert kernel.library_path() not in (wide, narrow)


# The float32 kernels on seeded inputs: a linear of odd width, the int8 and int4 linears (1, 5 and 13 rows: AVX2
# takes 6-row tiles from 6 rows on), decode attention over shuffled blocks with a window, a LoRA delta with a
# mask. Run here and in a child capped at AVX2.
PROGRAM = r"""
import json, sys, torch
from session.model.cpu import attention as cpu_attention
from session.model.cpu import linear as cpu_linear
from session.model.cpu import fused_layer
from session.model.quantize import quantize_int4, quantize_int8
assert cpu_linear.load(torch.float32) and cpu_attention.load() and fused_layer.load(torch.float32)
assert cpu_linear.INT8_KERNEL.load() and cpu_linear.INT4_KERNEL.load() and cpu_linear.Q8_KERNEL.load()
g = torch.Generator().manual_seed(0)
x, w, bias = torch.randn(13, 1030, generator=g), torch.randn(100, 1030, generator=g), torch.randn(100, generator=g)
linear = [cpu_linear.linear(x[:rows], cpu_linear.pack(w), bias, 100, block) for rows in (1, 5, 13) for block in (512, 1024)]
linear.append(cpu_linear.linear(x, cpu_linear.pack(w), bias, 100, 512, 3, 1024))  # 3 decode rows, 10 of a prompt
int8 = cpu_linear.pack_int8(*quantize_int8(w, torch.float32))
linear += [cpu_linear.linear(x[:rows], int8, bias, 100, 1030) for rows in (1, 5, 13)]
int4 = cpu_linear.pack_int4(*quantize_int4(w[:, :1024], 64, torch.float32))
linear += [cpu_linear.linear(x[:rows, :1024], int4, bias, 100, 64) for rows in (1, 5, 13)]
q8 = [cpu_linear.pack_q8(*quantize_int8(w[:, :1024], torch.float32), None, 8),
      cpu_linear.pack_q8(*quantize_int4(w[:, :1024], 64, torch.float32)[:2], -w[:, :1024:64] / 8, 4),
      cpu_linear.pack_q8(quantize_int8(w, torch.float32)[0][:, :1024], torch.rand(100, 32, generator=g).half(), None, 8)]
linear += [cpu_linear.linear(x[:rows, :1024], packed, bias, 100, 32) for packed in q8 for rows in (1, 5)]
q = torch.randn(3, 8, 64, generator=g)
pool = torch.randn(2, 40, 16, 64, generator=g)
table = torch.randperm(39, generator=g)[:36].view(3, 12).int() + 1
attention = cpu_attention.decode_attention(q, pool, pool.flip(0), table, torch.tensor([0, 30, 5]).int(),
                                           torch.tensor([190, 100, 7]).int(), 0.125)
y, a, b = torch.randn(4, 96, generator=g), torch.randn(1030, 9, generator=g), torch.randn(9, 96, generator=g)
fused_layer.op("lora_add", torch.float32)(y, x[:4], a, b, (torch.rand(4, 9, generator=g) > 0.5).float())
out = [t.flatten().tolist() for t in (*linear, attention, y)]
print(json.dumps({"isa": cpu_linear.KERNELS[torch.float32].isa.name, "out": out}))
"""


def run_program(tmp_path: Path, cap: str) -> dict:
    env = {**os.environ, "RESIDENT_KERNEL_ISA": cap, "RESIDENT_KERNEL_CACHE": str(tmp_path / cap),
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl", "fma", "avx2"} <= kernels.cpu_flags(),
                    reason="needs a CPU with AVX-512 and AVX2 to run both builds")
def test_the_avx2_build_computes_the_avx512_builds_bits(tmp_path):
    wide, narrow = run_program(tmp_path, "avx512"), run_program(tmp_path, "avx2")
    assert (wide["isa"], narrow["isa"]) == ("avx512", "avx2")
    assert len(wide["out"]) == len(narrow["out"]) == 21
    for ours, theirs in zip(wide["out"], narrow["out"]):
        assert torch.equal(torch.tensor(ours), torch.tensor(theirs))
