"""Our bfloat16 linear kernel (session/model/cpu/linear.py): torch's bits for one row and for several, a decode
batch's rows each as if alone, the probe that decides, and what is left on oneDNN where it says no.

Bit-identity is checked on ``cancelling`` inputs: large products that cancel, so that the order of
additions decides most outputs (another order changes nearly all of them: asserted below).

On a CPU with AMX (``AMX``) torch's bfloat16 ``F.linear`` runs oneDNN's AMX kernel, whose order no block
size reproduces, so ours takes oneDNN's AVX512-BF16 sizes there (``amx_blockings``). There these tests
check ours against torch's to rounding (``assert_close_to_torch``: on random rows, every output within one
bfloat16 ulp, at most 1 in 100 differing), ours against itself bit for bit where they compare rows, threads
or calls, and the AVX512-BF16 sizes against that oneDNN's own bits in a child with the AMX kernels capped
(``test_on_amx_ours_takes_onednns_avx512_bf16_block_sizes``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from session.model.cpu import linear as cpu_linear
from session.model.cpu.kernels import bf16_products_use_amx
from session.model.cpu.linear import KernelLinear, cancelling, linear, pack
from session.model.cpu.packed_linear import PackedLinear
from session.model.runner import ModelRunner, cpu_has_bf16

pytestmark = pytest.mark.skipif(not (cpu_has_bf16() and cpu_linear.load()),
                                reason="needs AVX512-BF16 and the kernel built (a C++ compiler)")

# (out, in): text-bench's shapes (512 wide, MLP 1376, head 8192), and odd ones (a last block of 4 or 2
# outputs, a last pair of one input)
SHAPES = [(512, 512), (1376, 512), (512, 1376), (8192, 512), (100, 77), (66, 1030), (64, 4097)]
AMX = bf16_products_use_amx()  # torch's bfloat16 F.linear takes AMX tiles here: its bits are out of reach
REPO = Path(__file__).resolve().parents[4]


def blocks_for(n: int, k: int) -> cpu_linear.Blocking:
    """The probe's sizes (torch's order); with AMX, those pack_linears takes (the probe matches none)."""
    blocking = cpu_linear.blockings({(n, k)}) if AMX else cpu_linear.probe({(n, k)})
    assert (n, k) in blocking, f"the probe matched no block size for {(n, k)}"
    return blocking[(n, k)]


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |t| (float32; normal numbers)."""
    return torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(2.0 ** -126))) - 7)


def assert_close_to_torch(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """AMX: ours against torch's F.linear, which adds in another order. Each output within one bfloat16
    ulp of the larger of the two, past what float32 rounding in any order of K additions can move a sum
    (2 K 2^-24 sum|x w|: a few outputs near zero), and at most 1 in 100 outputs differing (measured: at most
    1 ulp, in up to 1 output in 800)."""
    theirs = F.linear(x, w, bias)
    slack = 2 * x.shape[-1] * 2.0 ** -24 * (x.float().abs() @ w.float().abs().T + (0 if bias is None else bias.float().abs()))
    bound = torch.maximum(ulp(ours), ulp(theirs)) + slack
    diff = (ours.float() - theirs.float()).abs()
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} outputs past one ulp; worst {float((diff / bound).max()):.2f}x"
    assert (ours != theirs).float().mean() <= 0.01, f"{int((ours != theirs).sum())} of {ours.numel()} outputs differ"


@pytest.mark.parametrize("n,k", SHAPES)
def test_bits_equal_torchs_linear_for_one_row_and_for_many(n, k):
    x, w = cancelling(40, n, k, torch.Generator().manual_seed(n + k))
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1000).to(torch.bfloat16)
    blocking = blocks_for(n, k)
    if AMX:  # random rows and weights (cancelling ones would show only that the orders differ)
        generator = torch.Generator().manual_seed(n + k)
        x = torch.randn(40, k, generator=generator).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=generator) / k ** 0.5).to(torch.bfloat16)
    packed = pack(w)
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 16, 40):
            block = blocking.one_row if rows == 1 else blocking.rows
            for b in (None, bias):
                ours = linear(x[:rows], packed, b, n, block)
                if AMX:
                    assert_close_to_torch(ours, x[:rows], w, b)
                else:
                    assert torch.equal(ours, F.linear(x[:rows], w, b)), (rows, b is None)


def test_another_order_changes_most_outputs():
    """The inputs discriminate: the several-row block size (1024) on one row changes many outputs."""
    n, k = 512, 1376
    x, w = cancelling(1, n, k, torch.Generator().manual_seed(3))
    blocking = blocks_for(n, k)
    assert (blocking.one_row, blocking.rows) == (512, 1024)  # oneDNN's sizes on this project's CPU
    with torch.inference_mode():
        wrong = linear(x, pack(w), None, n, blocking.rows)
        right = linear(x, pack(w), None, n, blocking.one_row) if AMX else F.linear(x, w)  # AMX: ours, torch's order
        assert (wrong != right).float().mean() > 0.1


@pytest.mark.skipif(not AMX, reason="an AMX CPU's fallback (elsewhere the probe's sizes are tested above)")
def test_on_amx_ours_takes_onednns_avx512_bf16_block_sizes():
    """The sizes ours takes where the probe matches none (AMX) are those oneDNN's AVX512-BF16 kernel
    sums in: the probe, run in a child whose oneDNN is capped at AVX512-BF16 (ONEDNN_MAX_CPU_ISA), finds
    them for these shapes, bit for bit on cancelling inputs, so ours computes that kernel's bits here."""
    shapes = sorted({*SHAPES, (256, 768), (256, 1024), (256, 1025), (1024, 2048)})
    program = ("import json, sys, torch\nfrom session.model.cpu import linear as L\nassert L.load()\n"
               "found = L.probe({tuple(s) for s in json.loads(sys.stdin.read())})\n"
               "print(json.dumps(sorted([n, k, b.one_row, b.rows] for (n, k), b in found.items())))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", program], input=json.dumps(shapes), env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {(n, k): cpu_linear.Blocking(one, rows) for n, k, one, rows in json.loads(result.stdout.splitlines()[-1])}
    assert found == {(n, k): cpu_linear.avx512_bf16_blocking(k) for n, k in shapes}
    assert cpu_linear.blockings(set(shapes)) == found  # and pack_linears takes them here


def test_packed_layout():
    w = torch.arange(40 * 6, dtype=torch.float32).view(40, 6).to(torch.bfloat16)  # 40 outputs, 3 input pairs
    packed = pack(w)
    assert packed.shape == (3, 3, 32)  # ceil(40 / 16) blocks, 3 pairs, 16 outputs x 2 inputs
    assert packed[1, 2, :4].tolist() == [w[16, 4], w[16, 5], w[17, 4], w[17, 5]]
    assert packed[2, 0, 16:].eq(0).all()  # outputs 40..47 do not exist: zeros


def kernel_linear(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """``cancelling`` rows x and weight w, and a bfloat16 linear of w packed for our kernel."""
    x, w = cancelling(rows, n, k, torch.Generator().manual_seed(seed))
    module = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    assert cpu_linear.pack_linears([module]) == (1, "")
    return x, w, module


def test_a_decode_batch_computes_each_row_as_alone():
    """x [B, 1, K] (one new token per sequence) sums in the one-row blocks for every row: each row's
    bits are F.linear's on that row alone, which oneDNN's own batched product does not keep."""
    n, k = 512, 1376
    x, w, module = kernel_linear(12, n, k, seed=5)
    assert type(module) is KernelLinear and "weight" not in dict(module.named_parameters())  # no dense copy
    with torch.inference_mode():
        # AMX: each row as ours computes it alone (torch's bits are out of reach: test_bits_equal...)
        alone = torch.stack([module(x[i : i + 1]) if AMX else F.linear(x[i : i + 1], w) for i in range(12)])  # [12, 1, n]
        batched = module(x[:, None])  # [12, 1, n]
        assert torch.equal(batched, alone)
        prefill = module(x[None])  # 12 tokens of one sequence: a prefill's
        if AMX:  # the several-row sizes: other bits than each row's alone
            assert torch.equal(prefill[0], linear(x, module.packed, None, n, module.rows_block))
            assert not torch.equal(prefill[0, :, None], alone)
        else:
            assert not torch.equal(F.linear(x, w)[:, None], alone)  # oneDNN's 12-row product: other bits
            assert torch.equal(prefill, F.linear(x, w)[None])


def test_a_packed_step_sums_decode_rows_as_alone_and_prefill_tokens_as_a_prefill():
    """In a step that packs 5 decode rows before a 9-token prefill chunk ([14, 1, K] within
    ``several_rows_from(5)``), the decode rows get the bits of their own decode step ([5, 1, K]) and the
    chunk's tokens those of their own prefill ([1, 9, K]): one call, two block sizes."""
    x, _, module = kernel_linear(14, 512, 1376, seed=6)
    assert module.one_row_block != module.rows_block  # K past 1024: the sizes differ
    with torch.inference_mode():
        with cpu_linear.several_rows_from(5):
            packed = module(x[:, None])  # [14, 1, n]
        decode, prefill = module(x[:5, None]), module(x[None, 5:])
        assert torch.equal(packed[:5], decode)
        assert torch.equal(packed[5:, 0], prefill[0])
        assert not torch.equal(module(x[:, None])[5:, 0], prefill[0])  # without it: the one-row sums
        with cpu_linear.several_rows_from(0):  # no decode rows: every token a prefill's
            assert torch.equal(module(x[:, None])[:, 0], module(x[None])[0])


def test_small_products_stay_on_onednn():
    """Under about 16^3 multiply-adds torch's one-row product takes another kernel: the probe finds no
    block size there, so such a linear is left for oneDNN, with the reason (with AMX, where no size
    reproduces torch at any size, ours takes it); under MIN_OUTPUTS outputs a linear is not ours at all."""
    small, narrow = nn.Linear(64, 64, bias=False), nn.Linear(512, 32, bias=False)
    large = nn.Linear(64, 512, bias=False)
    model = nn.Sequential(small, narrow, large).to(torch.bfloat16)
    count, why = cpu_linear.pack_linears([model])
    if AMX:  # no size reproduces torch's product at any size here: ours takes both (amx_blockings)
        assert count == 2 and type(large) is KernelLinear and type(small) is KernelLinear and type(narrow) is nn.Linear
        assert why == "" and (small.one_row_block, small.rows_block) == (512, 512)
        return
    assert count == 1 and type(large) is KernelLinear and type(small) is nn.Linear and type(narrow) is nn.Linear
    assert why == "no input block size reproduces torch's product for [out, in] = [(64, 64)]"


def test_a_failed_build_leaves_onednn(monkeypatch, tmp_path, caplog, llama_path):
    """No usable compiler: nothing is packed for our kernel, and the runner packs every linear for oneDNN."""
    monkeypatch.setattr(cpu_linear.KERNEL, "loaded", None)
    monkeypatch.setenv("RESIDENT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level("WARNING", logger="session.model.cpu.kernels"):
        runner = ModelRunner(llama_path, device="cpu", dtype="bfloat16")
    assert "compiling linear_bf16.cpp failed" in caplog.text
    assert list(tmp_path.iterdir()) == []
    assert runner.linear_kernels == {"resident": 0, "onednn": 7 * runner.info.num_layers + 1}
    assert type(runner.lm_head) is PackedLinear


def test_runner_takes_our_kernel_and_keeps_torchs_bits(llama_path):
    """A bfloat16 runner packs its linears for our kernel (oneDNN where the probe said no) and prefills
    and decodes to the bits of the same model run dense (torch's ``F.linear``; with AMX, to rounding)."""
    ours = ModelRunner(llama_path, device="cpu", dtype="bfloat16")
    dense = ModelRunner(llama_path, device="cpu", dtype="bfloat16", pack_weights=False)
    assert ours.linear_kernels["resident"] > 0
    assert sum(ours.linear_kernels.values()) == ours.packed_linears == 7 * ours.info.num_layers + 1
    assert not ModelRunner(llama_path, device="cpu", dtype="bfloat16", cpu_kernels=False).linear_kernels["resident"]
    kvs = [r.new_kv_cache(block_tokens=16, max_tokens=128) for r in (ours, dense)]
    ids = list(range(3, 40))
    logits = [[r.prefill(kv, r.embed(ids, [])) for r, kv in zip((ours, dense), kvs)]]
    for token in (7, 9, 11):
        logits.append([r.decode([kv], [token])[0] for r, kv in zip((ours, dense), kvs)])
    assert_same_logits(*(torch.stack(column) for column in zip(*logits)))  # [4, V]: the prefill's, 3 steps'


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Logits [S, V] bit for bit. With AMX (torch's linears in another order), to rounding: every logit
    within 2^-6 of its row's largest, and in at least half of the rows at most 1 logit in 100 differing
    (as tests/integration/test_bf16_decode.py's: a wrong position or a missed key moves most of every row's)."""
    if not AMX:
        assert torch.equal(ours, theirs)
        return
    diff = (ours - theirs).abs() / theirs.abs().amax(-1, keepdim=True)
    assert diff.max() <= 2 ** -6, f"a logit {float(diff.max()):.4f} of its row's largest away"
    differing = (ours != theirs).float().mean(-1)
    assert (differing <= 0.01).float().mean() >= 0.5, f"rows' fractions of logits differing: {differing.tolist()}"


def test_blocks_and_bits_do_not_depend_on_threads():
    """oneDNN parallelizes these products over outputs: one thread and two find the same block sizes,
    and ours on two threads equals torch's on one."""
    shapes = {(512, 1376), (8192, 512)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.blockings(shapes) if AMX else cpu_linear.probe(shapes)
        x, w = cancelling(16, 512, 1376, torch.Generator().manual_seed(9))
        packed, blocking = pack(w), one[(512, 1376)]
        if AMX:  # torch's bits are out of reach: ours on one thread
            reference = [linear(x[:1], packed, None, 512, blocking.one_row), linear(x, packed, None, 512, blocking.rows)]
        else:
            reference = [F.linear(x[:1], w), F.linear(x, w)]
        torch.set_num_threads(2)
        assert (cpu_linear.blockings(shapes) if AMX else cpu_linear.probe(shapes)) == one and len(one) == 2
        assert torch.equal(linear(x[:1], packed, None, 512, blocking.one_row), reference[0])
        assert torch.equal(linear(x, packed, None, 512, blocking.rows), reference[1])
    finally:
        torch.set_num_threads(before)

