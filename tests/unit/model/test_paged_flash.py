"""Paged FlashAttention-2 as the runner calls it: torch's (``varlen_attn`` with a block table) and
the flash-attn package's ``flash_attn_with_kvcache``, which also writes the new keys and values.

The kernels run on CUDA only. Here they are replaced by float64 references of their documented contracts
(torch/nn/attention/varlen.py: packed queries by ``cu_seq_q``, each row's ``seqused_k`` keys read
through its ``block_table`` from a ``[pages, page_size, KVH, hd]`` pool, causal from the bottom
right, windows ``(left, 0)``, grouped-query heads): a prefill and a batched decode and verify over a
token-major pool that call it must give the logits of the SDPA path on the same model. Backend
choice is tested with a mocked device capability."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import session.model.attention as attention
import session.model.runner as runner_module
from session.model.kv_cache import KVPool
from session.model.runner import ModelRunner

BLOCK = 8
CALLS: list[dict] = []


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None):
    """varlen_attn's paged contract, computed row by row in float64 (and its argument checks)."""
    assert block_table is not None and seqused_k is not None
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert cu_seq_q.dtype == cu_seq_k.dtype == seqused_k.dtype == torch.int32
    assert query.dim() == 3 and key.dim() == 4 and key.shape == value.shape  # [pages, page_size, KVH, hd]
    assert enable_gqa == (query.shape[1] != key.shape[2])
    rows = cu_seq_q.numel() - 1
    assert block_table.shape[0] == rows and max_k >= int(seqused_k.max()) and max_k <= block_table.shape[1] * key.shape[1]
    assert torch.equal(cu_seq_k[1:] - cu_seq_k[:-1], seqused_k)
    CALLS.append({"rows": rows, "max_q": max_q, "window": tuple(window_size)})
    page = key.shape[1]
    group = query.shape[1] // key.shape[2]
    out = torch.empty_like(query)
    for b in range(rows):
        q_lo, q_hi = int(cu_seq_q[b]), int(cu_seq_q[b + 1])
        assert q_hi - q_lo <= max_q
        length = int(seqused_k[b])
        positions = torch.arange(length)
        pages = block_table[b].long()[positions // page]
        k = key[pages, positions % page].double().repeat_interleave(group, dim=1)  # [L, H, hd]
        v = value[pages, positions % page].double().repeat_interleave(group, dim=1)
        q = query[q_lo:q_hi].double()  # [T, H, hd]
        mine = length - (q_hi - q_lo) + torch.arange(q_hi - q_lo)  # bottom-right: the new tokens are last
        allowed = positions[None, :] <= mine[:, None]
        if window_size[0] >= 0:
            allowed &= positions[None, :] >= mine[:, None] - window_size[0]
        scores = torch.einsum("thd,lhd->htl", q, k) * scale
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[q_lo:q_hi] = torch.einsum("htl,lhd->thd", weights, v).to(query.dtype)
    return out


def built(family: str) -> str:
    from model_store.build_text_models import ensure

    return str(ensure([family])[family])


@pytest.fixture(scope="module")
def model_path():
    return built("llama")


def reference_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table,
                                      softmax_scale, causal, window_size):
    """flash_attn_with_kvcache's paged contract in float64: k, v [B, T, KVH, hd] appended at each row's
    cache_seqlens through its block table, then q [B, T, H, hd] attends over cache_seqlens + T keys,
    causal from the bottom right, windows (left, right) with -1 for none."""
    assert k is not None and v is not None and causal and cache_seqlens.dtype == torch.int32
    assert block_table.dtype == torch.int32 and k_cache.dim() == 4
    rows, num_new = q.shape[:2]
    page = k_cache.shape[1]
    for b in range(rows):
        for t in range(num_new):
            position = int(cache_seqlens[b]) + t
            block = int(block_table[b, position // page])
            k_cache[block, position % page] = k[b, t]
            v_cache[block, position % page] = v[b, t]
    lengths = cache_seqlens + num_new
    cu_q = torch.arange(0, (rows + 1) * num_new, num_new, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0, dtype=torch.int32)])
    left = window_size[0]
    out = reference_varlen_attn(q.reshape(rows * num_new, *q.shape[2:]), k_cache, v_cache, cu_q, cu_k, num_new,
                                block_table.shape[1] * page, scale=softmax_scale, window_size=(left, 0),
                                enable_gqa=q.shape[2] != k_cache.shape[2], seqused_k=lengths.to(torch.int32),
                                block_table=block_table)
    return out.view(q.shape)


@pytest.fixture(params=["varlen", "flash_attn"])
def varlen(monkeypatch, request):
    """Token-major pools take a FlashAttention kernel (its reference: torch's varlen_attn, or the
    flash-attn package's flash_attn_with_kvcache, which writes the new keys itself); the rest keep
    choosing as shipped."""
    chosen = attention.choose_backend
    backend = request.param

    def choose(pool):
        return backend if not pool.head_major else chosen(pool)

    monkeypatch.setattr(attention, "torch_paged_varlen", lambda: reference_varlen_attn)
    monkeypatch.setitem(sys.modules, "flash_attn",
                        SimpleNamespace(flash_attn_with_kvcache=reference_flash_attn_with_kvcache))
    monkeypatch.setattr(attention, "choose_backend", choose)
    monkeypatch.setattr(runner_module, "choose_backend", choose)
    if backend == "flash_attn":  # a token-major pool is written by the kernel alone
        write_rows = KVPool.write_rows

        def only_head_major(pool, *args):
            assert pool.head_major, "a separate key/value write"
            return write_rows(pool, *args)

        monkeypatch.setattr(KVPool, "write_rows", only_head_major)
    CALLS.clear()
    return CALLS


def token_major(runner: ModelRunner) -> None:
    info = runner.info
    runner.kv_pools[BLOCK] = KVPool(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                                    head_dim=info.head_dim, dtype=runner.kv_dtype, device=runner.device,
                                       block_tokens=BLOCK, head_major=False)


def conversation(runner: ModelRunner, attention_path: str) -> list[torch.Tensor]:
    """Three sessions grown side by side (their blocks interleave): prefills, a follow-up prefill,
    batched decode steps across block boundaries, and a batched 3-token verify."""
    runner.decode_attention = attention_path
    kvs = [runner.new_kv_cache(block_tokens=BLOCK, max_tokens=256) for _ in range(3)]
    out = []
    for i, kv in enumerate(kvs):
        out.append(runner.prefill(kv, runner.embed([(5 * i + 7 * j) % 200 + 3 for j in range(6 + 5 * i)], [])))
    out.append(runner.prefill(kvs[0], runner.embed(list(range(40, 51)), []), all_logits=True))  # 11 after 6
    for step in range(6):
        out.append(runner.decode(kvs, [9 + step, 30 + step, 60 + step]))
    out.append(runner.extend(kvs, [[4, 5, 6], [7], [8, 9]]))
    return out


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: every layer in a 16-token sliding window
def test_prefill_decode_and_verify_through_varlen_give_the_sdpa_logits(family, varlen):
    from model_store.build_text_models import MISTRAL_WINDOW

    model_path = built(family)
    reference = ModelRunner(model_path, device="cpu", cpu_kernels=False)
    assert reference.info.num_heads != reference.info.num_kv_heads  # grouped-query heads
    want = conversation(reference, "batched")
    runner = ModelRunner(model_path, device="cpu", cpu_kernels=False)
    token_major(runner)
    got = conversation(runner, "batched")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    layers = runner.info.num_layers
    # 4 prefills (one row each), 6 decode steps (3 rows, 1 query), one verify (3 rows of 3): a call a layer
    assert len(varlen) == layers * (4 + 6 + 1)
    assert [c["rows"] for c in varlen[: 4 * layers: layers]] == [1, 1, 1, 1]
    assert [c["max_q"] for c in varlen[: 4 * layers: layers]] == [6, 11, 16, 11]
    assert {(c["rows"], c["max_q"]) for c in varlen[4 * layers:]} == {(3, 1), (3, 3)}
    if family == "mistral":
        assert {c["window"] for c in varlen} == {(MISTRAL_WINDOW - 1, 0)}
    else:  # causal; a single query a row may go without (it sees every key it is given)
        assert all(c["window"] == (-1, 0) or (c["window"] == (-1, -1) and c["max_q"] == 1) for c in varlen)


def fake_pool(**overrides) -> SimpleNamespace:
    fields = dict(device=torch.device("cuda", 1), head_major=False, dtype=torch.bfloat16, block_tokens=256,
                  head_dim=128)
    return SimpleNamespace(**{**fields, **overrides})


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    attention.flash_attn_installed.cache_clear()  # asked once per process: ask again here, and after
    yield
    attention.flash_attn_installed.cache_clear()


def test_backend_choice_on_a_mocked_gpu(monkeypatch, no_flash_attn):
    capabilities = []

    def capability(device):
        capabilities.append(device)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert attention.torch_paged_varlen() is not None  # this torch ships the paged varlen_attn
    assert attention.choose_backend(fake_pool()) == "varlen"
    assert capabilities == [torch.device("cuda", 1)]  # asked of the pool's own device
    assert attention.describe_backend(fake_pool(), "batched") == attention.KERNELS["varlen"]
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace())
    assert attention.choose_backend(fake_pool()) == "varlen"  # the probe is asked once a process
    attention.flash_attn_installed.cache_clear()
    assert attention.choose_backend(fake_pool()) == "flash_attn"  # the package, where installed


@pytest.mark.parametrize("overrides, why", [
    ({"block_tokens": 16}, "KV blocks of 16 tokens (paged FlashAttention-2 needs a multiple of 256)"),
    ({"dtype": torch.float32}, "the KV dtype is torch.float32 (FlashAttention takes float16 and bfloat16)"),
    ({"head_major": True}, "the pool is head-major"),
    ({"head_dim": 80 + 4}, "head size 84 (FlashAttention takes multiples of 8 up to 256)"),
    ({"capability": (7, 5)}, "compute capability 7.5 (FlashAttention-2 needs 8.0)"),
])
def test_sdpa_where_flash_attention_cannot_read_the_pool(monkeypatch, no_flash_attn, overrides, why):
    capability = overrides.pop("capability", (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    pool = fake_pool(**overrides)
    assert attention.paged_flash_refusal(pool) == why
    assert attention.choose_backend(pool) == "sdpa"
    assert attention.describe_backend(pool, "batched") == f"SDPA over gathered blocks ({why})"


def test_cpu_pools_are_read_in_place_by_the_per_row_path(model_path):
    runner = ModelRunner(model_path, device="cpu", cpu_kernels=False)
    pool = runner.kv_pool(BLOCK)
    assert attention.choose_backend(pool) == "sdpa" and runner.paged_prefill(
        runner.new_kv_cache(block_tokens=BLOCK, max_tokens=64), 4) is None
    assert attention.describe_backend(pool, "per_row").startswith("each row's runs of blocks in place")
    assert attention.describe_backend(pool, "batched") == "SDPA over gathered blocks (the pool is on cpu)"


def test_a_pool_is_asked_for_its_kernel_once(monkeypatch, no_flash_attn):
    asked = []

    def refusal(pool):
        asked.append(pool)
        return None

    monkeypatch.setattr(attention, "paged_flash_refusal", refusal)
    pool, other = fake_pool(), fake_pool()
    assert [attention.choose_backend(pool) for _ in range(3)] == ["varlen"] * 3
    assert pool.attention_backend == "varlen" and asked == [pool]  # kept on the pool after the first pass
    assert attention.choose_backend(other) == "varlen" and asked == [pool, other]  # each pool its own
