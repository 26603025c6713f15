"""The batched decode step dispatches the same operators whatever the batch size.

On a GPU a decode step's time at small batches is its kernel launches; a per-row attention loop
launches more of them with every session. Counted here with torch.profiler on CPU tensors (the
operators dispatched are the same on CUDA, where flash_attn, when installed, replaces the SDPA
gather with one kernel per layer). The per-row path is counted too: its count grows with the
batch, which shows that the count can tell the two apart.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from session.model.runner import ModelRunner

BATCHES = (1, 4, 16)
BLOCK = 8


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    """torch's operators throughout (RESIDENT_CPU_KERNELS=0): the paths a GPU runs."""
    from model_store.build_text_models import ensure

    return ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)


def operators_of_one_step(runner: ModelRunner, attention: str, batch: int) -> Counter:
    """aten operators (nested ones included) one decode step of ``batch`` sessions dispatches; the
    sessions hold different lengths (5, 8, 11, ... tokens), so block tables differ in width."""
    runner.decode_attention = attention
    kvs = [runner.new_kv_cache(block_tokens=BLOCK, max_tokens=256) for _ in range(batch)]
    kvs[0].pool.reserve(1 + batch * 16)  # no pool growth inside the measured step
    for i, kv in enumerate(kvs):
        runner.prefill(kv, runner.embed(list(range(3, 8 + 3 * i)), []))
    runner.decode(kvs, [5] * batch)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.decode(kvs, [5] * batch)
    for kv in kvs:
        kv.release()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def test_batched_step_dispatches_as_many_operators_at_any_batch_size(runner):
    counts = {b: operators_of_one_step(runner, "batched", b) for b in BATCHES}
    totals = {b: sum(c.values()) for b, c in counts.items()}
    print(f"operators per batched decode step at batch {BATCHES}: {[totals[b] for b in BATCHES]}")
    for b in BATCHES[1:]:
        assert counts[b] == counts[1], (b, counts[b] - counts[1], counts[1] - counts[b])
    attention_calls = counts[16]["aten::scaled_dot_product_attention"]
    assert attention_calls == len(runner.layers)  # one attention call per layer, whatever the batch


def test_per_row_step_grows_with_the_batch(runner):
    totals = {b: sum(operators_of_one_step(runner, "per_row", b).values()) for b in BATCHES}
    print(f"operators per per-row decode step at batch {BATCHES}: {[totals[b] for b in BATCHES]}")
    assert totals[1] < totals[4] < totals[16]
    # at least one attention kernel per row and layer (a session whose blocks are not all consecutive
    # has one per run of consecutive blocks, merged by log-sum-exp: session/model_runner.attend_runs)
    kernels_16 = operators_of_one_step(runner, "per_row", 16)["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert kernels_16 >= 16 * len(runner.layers)


def twelve_steps(runner: ModelRunner, attention: str) -> torch.Tensor:
    """Three sessions of different lengths, 12 decode steps together (crossing block boundaries) ->
    logits [12, 3, V]."""
    runner.decode_attention = attention
    kvs = [runner.new_kv_cache(block_tokens=BLOCK, max_tokens=256) for _ in range(3)]
    for i, kv in enumerate(kvs):
        runner.prefill(kv, runner.embed(list(range(3, 8 + 7 * i)), []))
    steps = [runner.decode(kvs, [5, 6, 7]) for _ in range(12)]
    for kv in kvs:
        kv.release()
    return torch.stack(steps)


def test_decode_paths_give_the_same_logits(runner):
    """Both paths over the same contexts (float32 on CPU): the same next-token logits, to rounding."""
    torch.testing.assert_close(twelve_steps(runner, "batched"), twelve_steps(runner, "per_row"), rtol=1e-5, atol=1e-5)


def test_the_cpu_default_step_dispatches_as_many_operators_at_any_batch_size(runner):
    """On CPU with our kernels (the default) the per-row step attends with one call per layer for the
    whole batch (session/model/cpu/attention.py): its operator count does not grow with the batch either, and
    its logits are the torch path's to float32 rounding."""
    from model_store.build_text_models import ensure

    ours = ModelRunner(str(ensure(["llama"])["llama"]), device="cpu")
    if not ours.pooled_decode:
        pytest.skip("our CPU kernels cannot be built on this CPU (session/model/cpu/kernels.py)")
    counts = {b: operators_of_one_step(ours, "per_row", b) for b in BATCHES}
    print(f"operators per CPU-default decode step at batch {BATCHES}: {[sum(counts[b].values()) for b in BATCHES]}")
    for b in BATCHES[1:]:
        assert counts[b] == counts[1], (b, counts[b] - counts[1], counts[1] - counts[b])
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in counts[16]
    # our attention adds in another order than torch's kernel: equal to rounding, the same tokens
    theirs, mine = twelve_steps(runner, "batched"), twelve_steps(ours, "per_row")
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
