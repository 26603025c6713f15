"""A packed step through a paged FlashAttention kernel (``RaggedAttention``, session/model/attention.py):
the CUDA plan of session/model/packed_step.py, one kernel call per layer for the step's ragged parts.

The kernels run on CUDA only; here they are float64 references of their documented contracts
(tests/unit/model/test_paged_flash.py: torch's ``varlen_attn`` with a block table, and flash-attn's
``flash_attn_varlen_func`` with one) over a token-major pool on CPU. A step that packs decode rows, a
speculative verify's rows, a follow-up's chunk and a new prompt's chunk must give, to rounding, the
logits of the same parts run apart (the SDPA paths), leave every cache where its parts would, and
call the kernel once a layer with every part as its own sequence."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import session.model.attention as attention
import session.model.packed_step as packed_step_module
from session.model.backend import Chunk, DecodeRows
from session.model.runner import ModelRunner
from tests.unit.model.test_paged_flash import BLOCK, CALLS, built, reference_varlen_attn, token_major

FLASH_CALLS: list[dict] = []


def reference_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                                     softmax_scale, causal, window_size, block_table):
    """flash_attn_varlen_func's paged contract: k, v the pool's [pages, page_size, KVH, hd], each sequence's
    keys the difference of ``cu_seqlens_k``, read through its row of ``block_table``; causal from the
    bottom right."""
    assert causal and window_size[1] == 0
    FLASH_CALLS.append({"rows": cu_seqlens_q.numel() - 1})
    return reference_varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 scale=softmax_scale, window_size=window_size,
                                 enable_gqa=q.shape[1] != k.shape[2], seqused_k=cu_seqlens_k.diff(),
                                 block_table=block_table)


@pytest.fixture(params=["varlen", "flash_attn"])
def kernel(monkeypatch, request):
    """Token-major pools are read by the parametrized paged kernel (its reference); the rest as shipped."""
    chosen = attention.choose_backend

    def choose(pool):
        return request.param if not pool.head_major else chosen(pool)

    monkeypatch.setattr(attention, "torch_paged_varlen", lambda: reference_varlen_attn)
    monkeypatch.setitem(sys.modules, "flash_attn",
                        SimpleNamespace(flash_attn_varlen_func=reference_flash_attn_varlen_func))
    monkeypatch.setattr(packed_step_module, "choose_backend", choose)
    CALLS.clear()
    FLASH_CALLS.clear()
    attention.flash_paged_varlen.cache_clear()  # asked once a process: ask the reference, and again after
    yield request.param
    attention.flash_paged_varlen.cache_clear()


def sessions(runner: ModelRunner) -> list:
    """Two decoding sessions (their blocks interleaved), a follow-up 7 tokens into its turn, a new one."""
    kvs = [runner.new_kv_cache(block_tokens=BLOCK, max_tokens=256) for _ in range(4)]
    for i, kv in enumerate(kvs[:3]):
        runner.prefill(kv, runner.embed([(5 * i + 7 * j) % 200 + 3 for j in range(6 + 5 * i)], []))
    runner.prefill(kvs[2], runner.embed(list(range(40, 47)), []))
    return kvs


FOLLOW_UP, PROMPT = list(range(47, 60)), list(range(90, 111))  # 13 and 21 tokens: both cross blocks
VERIFY = [[4, 5, 6], [7]]  # a verify of two sequences: 3 and 1 tokens


def packed(runner: ModelRunner) -> tuple[list[torch.Tensor], list]:
    """A step of decode rows and two chunks, then a step of a verify and a chunk: two packed passes."""
    a, b, c, d = kvs = sessions(runner)
    before = runner.num_passes
    first = runner.step([Chunk(c, runner.embed(FOLLOW_UP, [])), Chunk(d, runner.embed(PROMPT[:12], []))],
                        DecodeRows([a, b], [9, 30]))
    rows = DecodeRows.verify([a, b], VERIFY)
    second = rows.widen(runner.step([Chunk(d, runner.embed(PROMPT[12:], []))], rows)[:len(rows)])
    assert runner.num_passes - before == 2
    return [first, second], kvs


def apart(runner: ModelRunner) -> tuple[list[torch.Tensor], list]:
    """The same parts as separate passes: a decode step, each prefill, then an extend and a prefill."""
    a, b, c, d = kvs = sessions(runner)
    first = torch.cat([runner.decode([a, b], [9, 30]), runner.prefill(c, runner.embed(FOLLOW_UP, []))[None],
                       runner.prefill(d, runner.embed(PROMPT[:12], []))[None]])
    wide = runner.extend([a, b], VERIFY)  # [2, 3, V]: the 1-token row's padding positions are not its
    second = torch.zeros_like(wide)
    for b, tokens in enumerate(VERIFY):
        second[b, :len(tokens)] = wide[b, :len(tokens)]
    runner.prefill(d, runner.embed(PROMPT[12:], []))
    return [first, second], kvs


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: every layer in a 16-token sliding window
def test_a_packed_step_through_the_paged_kernel_gives_its_parts_logits(family, kernel):
    model_path = built(family)
    reference = ModelRunner(model_path, device="cpu", cpu_kernels=False)
    reference.packed_steps = "off"
    want, want_kvs = apart(reference)
    runner = ModelRunner(model_path, device="cpu", cpu_kernels=False)
    token_major(runner)
    runner.packed_steps = "on"
    assert runner.packs_steps and packed_step_module.packing_backend("on", runner.kv_pool(BLOCK)) == kernel
    got, got_kvs = packed(runner)
    for ours, theirs in zip(got, want):
        assert ours.shape == theirs.shape
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert [kv.length for kv in got_kvs] == [kv.length for kv in want_kvs] == [10, 13, 36, 21]
    for ours, theirs in zip(got_kvs, want_kvs):  # the keys every part wrote, at its own positions
        assert torch.allclose(ours.keys(0, ours.length), theirs.keys(0, theirs.length), atol=1e-5)
    layers = runner.info.num_layers
    calls = CALLS if kernel == "varlen" else FLASH_CALLS
    # one call a layer a step: 2 rows + 2 chunks, then 4 verify rows + 1 chunk, each part its own sequence
    assert [c["rows"] for c in calls] == [4] * layers + [5] * layers
    if kernel == "varlen":
        assert [c["max_q"] for c in calls[::layers]] == [13, 9]
        window = (16 - 1, 0) if family == "mistral" else (-1, 0)
        assert {c["window"] for c in calls} == {window}


def test_an_older_flash_attn_without_block_tables_packs_through_torchs_kernel(monkeypatch):
    pool = SimpleNamespace(device=torch.device("cuda", 0), head_major=False)
    monkeypatch.setattr(packed_step_module, "choose_backend", lambda pool: "flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(flash_attn_varlen_func=lambda q, k, v: q))
    attention.flash_paged_varlen.cache_clear()
    try:
        assert not attention.flash_paged_varlen()
        assert packed_step_module.packing_backend("on", pool) == "varlen"
        monkeypatch.setattr(packed_step_module, "torch_paged_varlen", lambda: None)
        assert packed_step_module.packing_backend("on", pool) is None  # neither kernel pages: apart
    finally:
        attention.flash_paged_varlen.cache_clear()


def test_a_gpu_packs_only_when_asked_and_only_where_a_paged_kernel_reads_the_pool(monkeypatch):
    pool = SimpleNamespace(device=torch.device("cuda", 0), head_major=False)
    backends = iter(["varlen", "varlen", "sdpa", "flash_attn"])
    monkeypatch.setattr(packed_step_module, "choose_backend", lambda pool: next(backends))
    monkeypatch.setattr(packed_step_module, "flash_paged_varlen", lambda: True)
    assert packed_step_module.packing_backend("auto", pool) is None  # not yet checked on a GPU: asked for
    assert packed_step_module.packing_backend("on", pool) == "varlen"
    assert packed_step_module.packing_backend("on", pool) is None  # SDPA over gathered blocks: apart
    assert packed_step_module.packing_backend("off", pool) is None  # off asks nothing
    assert packed_step_module.packing_backend("on", pool) == "flash_attn"
    cpu = SimpleNamespace(device=torch.device("cpu"), head_major=True)
    monkeypatch.setattr(packed_step_module, "choose_backend", lambda pool: "sdpa")
    assert [packed_step_module.packing_backend(mode, cpu) for mode in ("auto", "on", "off")] == ["cpu", "cpu", None]
