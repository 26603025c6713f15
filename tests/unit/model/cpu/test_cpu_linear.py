"""Our bfloat16 linear kernel (session/model/cpu/linear.py): torch's bits for one row and for several, a decode
batch's rows each as if alone, the probe that decides, and what is left on oneDNN where it says no.

Bit-identity is checked on ``cancelling`` inputs: large products that cancel, so that the order of
additions decides most outputs (another order changes nearly all of them: asserted below)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from session.model.cpu import linear as cpu_linear
from session.model.cpu.linear import KernelLinear, cancelling, linear, pack
from session.model.cpu.packed_linear import PackedLinear
from session.model.runner import ModelRunner, cpu_has_bf16

pytestmark = pytest.mark.skipif(not (cpu_has_bf16() and cpu_linear.load()),
                                reason="needs AVX512-BF16 and the kernel built (a C++ compiler)")

# (out, in): text-bench's shapes (512 wide, MLP 1376, head 8192), and odd ones (a last block of 4 or 2
# outputs, a last pair of one input)
SHAPES = [(512, 512), (1376, 512), (512, 1376), (8192, 512), (100, 77), (66, 1030), (64, 4097)]


def blocks_for(n: int, k: int) -> cpu_linear.Blocking:
    blocking = cpu_linear.probe({(n, k)})
    assert (n, k) in blocking, f"the probe matched no block size for {(n, k)}"
    return blocking[(n, k)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_bits_equal_torchs_linear_for_one_row_and_for_many(n, k):
    x, w = cancelling(40, n, k, torch.Generator().manual_seed(n + k))
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1000).to(torch.bfloat16)
    blocking, packed = blocks_for(n, k), pack(w)
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 16, 40):
            block = blocking.one_row if rows == 1 else blocking.rows
            for b in (None, bias):
                assert torch.equal(linear(x[:rows], packed, b, n, block), F.linear(x[:rows], w, b)), (rows, b is None)


def test_another_order_changes_most_outputs():
    """The inputs discriminate: the several-row block size (1024) on one row changes many outputs."""
    n, k = 512, 1376
    x, w = cancelling(1, n, k, torch.Generator().manual_seed(3))
    blocking = blocks_for(n, k)
    assert (blocking.one_row, blocking.rows) == (512, 1024)  # oneDNN's sizes on this project's CPU
    with torch.inference_mode():
        wrong = linear(x, pack(w), None, n, blocking.rows)
        assert (wrong != F.linear(x, w)).float().mean() > 0.1


def test_packed_layout():
    w = torch.arange(40 * 6, dtype=torch.float32).view(40, 6).to(torch.bfloat16)  # 40 outputs, 3 input pairs
    packed = pack(w)
    assert packed.shape == (3, 3, 32)  # ceil(40 / 16) blocks, 3 pairs, 16 outputs x 2 inputs
    assert packed[1, 2, :4].tolist() == [w[16, 4], w[16, 5], w[17, 4], w[17, 5]]
    assert packed[2, 0, 16:].eq(0).all()  # outputs 40..47 do not exist: zeros


def test_a_decode_batch_computes_each_row_as_alone():
    """x [B, 1, K] (one new token per sequence) sums in the one-row blocks for every row: each row's
    bits are F.linear's on that row alone, which oneDNN's own batched product does not keep."""
    n, k = 512, 1376
    x, w = cancelling(12, n, k, torch.Generator().manual_seed(5))
    module = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    assert cpu_linear.pack_linears([module]) == (1, "")
    assert type(module) is KernelLinear and "weight" not in dict(module.named_parameters())  # no dense copy
    with torch.inference_mode():
        alone = torch.stack([F.linear(x[i : i + 1], w) for i in range(12)])  # [12, 1, n]
        batched = module(x[:, None])  # [12, 1, n]
        assert torch.equal(batched, alone)
        assert not torch.equal(F.linear(x, w)[:, None], alone)  # oneDNN's 12-row product: other bits
        assert torch.equal(module(x[None]), F.linear(x, w)[None])  # 12 tokens of one sequence: a prefill's


def test_small_products_stay_on_onednn():
    """Under about 16^3 multiply-adds torch's one-row product takes another kernel: the probe finds no
    block size there, so such a linear is left for oneDNN, with the reason; under MIN_OUTPUTS outputs
    a linear is not ours at all."""
    small, narrow = nn.Linear(64, 64, bias=False), nn.Linear(512, 32, bias=False)
    large = nn.Linear(64, 512, bias=False)
    model = nn.Sequential(small, narrow, large).to(torch.bfloat16)
    count, why = cpu_linear.pack_linears([model])
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
    and decodes to the bits of the same model run dense (torch's ``F.linear``)."""
    ours = ModelRunner(llama_path, device="cpu", dtype="bfloat16")
    dense = ModelRunner(llama_path, device="cpu", dtype="bfloat16", pack_weights=False)
    assert ours.linear_kernels["resident"] > 0
    assert sum(ours.linear_kernels.values()) == ours.packed_linears == 7 * ours.info.num_layers + 1
    assert not ModelRunner(llama_path, device="cpu", dtype="bfloat16", cpu_kernels=False).linear_kernels["resident"]
    kvs = [r.new_kv_cache(block_tokens=16, max_tokens=128) for r in (ours, dense)]
    ids = list(range(3, 40))
    prefill = [r.prefill(kv, r.embed(ids, [])) for r, kv in zip((ours, dense), kvs)]
    assert torch.equal(prefill[0], prefill[1])
    for token in (7, 9, 11):
        steps = [r.decode([kv], [token]) for r, kv in zip((ours, dense), kvs)]
        assert torch.equal(steps[0], steps[1])


def test_blocks_and_bits_do_not_depend_on_threads():
    """oneDNN parallelizes these products over outputs: one thread and two find the same block sizes,
    and ours on two threads equals torch's on one."""
    shapes = {(512, 1376), (8192, 512)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.probe(shapes)
        x, w = cancelling(16, 512, 1376, torch.Generator().manual_seed(9))
        reference = [F.linear(x[:1], w), F.linear(x, w)]
        torch.set_num_threads(2)
        assert cpu_linear.probe(shapes) == one and len(one) == 2
        packed, blocking = pack(w), one[(512, 1376)]
        assert torch.equal(linear(x[:1], packed, None, 512, blocking.one_row), reference[0])
        assert torch.equal(linear(x, packed, None, 512, blocking.rows), reference[1])
    finally:
        torch.set_num_threads(before)

