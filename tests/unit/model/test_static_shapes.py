"""Fixed-shape steps (session/model/static_shapes.py): KV-length buckets, prefills in bucket-shaped
pieces, and the same logits as the dynamic path, on the demo Llama with torch's operators."""

from __future__ import annotations

import pytest
import torch

from session.model.kv_cache import STATIC_PAD_TOKENS
from session.model.runner import ModelRunner
from session.model.static_shapes import StaticShapeRunner, kv_buckets

CAPACITY = 600


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    from model_store.build_text_models import ensure

    return ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)


@pytest.fixture
def static(runner) -> StaticShapeRunner:
    return StaticShapeRunner(runner, CAPACITY, batch_buckets=(1, 2, 4), max_prompt_tokens=64)


def test_kv_buckets_are_segments_then_the_whole_buffer():
    assert kv_buckets(600) == (512, 600 + STATIC_PAD_TOKENS)
    assert kv_buckets(4096) == (512, 1024, 2048, 4096 + STATIC_PAD_TOKENS)
    assert kv_buckets(256) == (256 + STATIC_PAD_TOKENS,)


def test_pieces_are_buckets_that_fit_the_buffer(static):
    assert static.prompt_buckets == (16, 32, 64)
    assert static._piece(0, 5) == (5, 16)  # padded to its bucket
    assert static._piece(0, 100) == (64, 64)  # longer than the largest bucket: the largest, unpadded
    assert static._piece(CAPACITY - 30, 30) == (30, 32)  # its padding lands in the buffer's spare positions
    assert static._piece(CAPACITY - 40, 40) == (32, 32)  # 64 would pass the buffer: 32 unpadded, then 8 in 16
    assert static._piece(CAPACITY - 8, 8) == (8, 16)


def dynamic_logits(runner, ids: list[int], all_logits: bool = False) -> torch.Tensor:
    kv = runner.new_kv_cache(block_tokens=16, max_tokens=CAPACITY)
    return runner.prefill(kv, runner.embed(ids, []), all_logits=all_logits)


def test_a_prompt_near_the_end_of_the_window_runs_in_pieces_with_the_dynamic_paths_logits(runner, static):
    ids = [(7 * i + 3) % 200 + 4 for i in range(CAPACITY - 2)]
    kv = runner.new_kv_cache(block_tokens=CAPACITY, max_tokens=CAPACITY, static=True)
    assert kv.capacity == CAPACITY and kv.k.shape[2] == CAPACITY + STATIC_PAD_TOKENS
    static.prefill(kv, runner.embed(ids[:-40], []))  # 558 tokens: pieces of 64, then the rest padded
    got = static.prefill(kv, runner.embed(ids[-40:], []), all_logits=True)  # at 558: 32 unpadded, then 8 in 16
    assert kv.length == len(ids)
    want = dynamic_logits(runner, ids, all_logits=True)[-40:]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
    assert ("prefill", 32, 616) in static.graph_shapes and ("prefill", 16, 616) in static.graph_shapes
    assert static.graph_shapes <= set(static.all_shapes())


def test_decode_reads_the_kv_bucket_its_longest_row_needs(runner, static):
    short, long = [5, 9, 11], [(3 * i) % 150 + 4 for i in range(520)]
    kvs = [runner.new_kv_cache(block_tokens=CAPACITY, max_tokens=CAPACITY, static=True) for _ in range(2)]
    static.prefill(kvs[0], runner.embed(short, []))
    static.prefill(kvs[1], runner.embed(long[:509], []))
    logits = static.decode(kvs, [7, long[509]])
    assert ("decode", 2, 512) in static.graph_shapes  # lengths 3 and 509: positions up to 509 fit 512
    for _ in range(3):  # the long row crosses position 511: the next bucket, 616
        logits = static.decode(kvs, [7, 8])
    assert ("decode", 2, 616) in static.graph_shapes
    reference = [runner.new_kv_cache(block_tokens=16, max_tokens=CAPACITY) for _ in range(2)]
    runner.prefill(reference[0], runner.embed(short, []))
    runner.prefill(reference[1], runner.embed(long[:509], []))
    runner.decode(reference, [7, long[509]])
    for _ in range(3):
        want = runner.decode(reference, [7, 8])
    assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(dim=-1), want.argmax(dim=-1))


def test_compile_all_runs_every_shape_once(static):
    shapes = static.all_shapes()
    assert shapes[0] == ("prefill", 64, 616) and len(shapes) == 3 * 2 + 3 * 2  # 3 prompt and 3 batch buckets x 2
    assert static.compile_all() == len(shapes) and static.graph_shapes == set(shapes)


def test_compiled_decode_of_distinct_sessions_after_compiling_on_one_scratch_cache(runner):
    """compile_all feeds every row the same scratch cache; serving feeds distinct sessions and pads
    with the first row's. The compiled step must give each session its own keys and logits (a graph
    that wrote its inputs was compiled for the first aliasing it saw, and wrote the wrong rows)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = StaticShapeRunner(runner, 256, batch_buckets=(2, 4), max_prompt_tokens=16, compile=True,
                                 compile_backend="aot_eager")
    eager = StaticShapeRunner(runner, 256, batch_buckets=(2, 4), max_prompt_tokens=16)
    assert compiled.compile_all() == 3  # prefill (16, 272); decode (2, 272) and (4, 272)
    counters.clear()
    prompts = [[5, 9, 11], [40, 41, 42, 43, 44], [7, 100, 3, 8]]
    sides = []
    for stepper in (compiled, eager):
        kvs = [runner.new_kv_cache(block_tokens=256, max_tokens=256, static=True) for _ in prompts]
        for kv, ids in zip(kvs, prompts):
            stepper.prefill(kv, runner.embed(ids, []))
        steps = [stepper.decode(kvs, [12, 13, 14]), stepper.decode(kvs[:2], [15, 16]),
                 stepper.decode(kvs, [17, 18, 19])]  # 3 rows pad to 4 (one padding row), 2 rows fill 2
        sides.append((steps, kvs))
    (got, got_kvs), (want, want_kvs) = sides
    assert counters["stats"]["unique_graphs"] == 0  # the sessions' caches met the start-up graphs' guards
    assert [kv.length for kv in got_kvs] == [6, 8, 6]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5) and torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(got_kvs, want_kvs):  # each session's own keys and values, none of another's
        assert torch.allclose(a.k, b.k, atol=1e-5) and torch.allclose(a.v, b.v, atol=1e-5)
