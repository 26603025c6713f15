"""Decode paths agree (plain, batched with sessions joining mid-flight, static shapes, compiled),
and continuous batching lets a new request start while others are decoding."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream, Failed, Finished, Started, TextDelta
from session.families.vision import NO_IMAGES
from session.types import SamplingParams
from tests.conftest import make_image
from tests.integration.test_engine import QUESTIONS, finished, turn

NUM_SESSIONS = 5


def converse(engine: Engine, index: int, images, delay_s: float, out: dict) -> None:
    time.sleep(delay_s)  # staggered: later sessions join while earlier ones decode
    sid = f"path-{index}"
    tokens = []
    # A compiled engine compiles each new bucket inside the loop (minutes on a busy 2-core machine):
    # what is under test is the tokens, not the compile time.
    timeout_s = 900.0 if engine.config.compile else 60.0
    for step, question in enumerate(QUESTIONS[:3]):
        events = turn(engine, sid, question, open_session=step == 0, timeout_s=timeout_s,
                      images=images if step == 0 else NO_IMAGES, max_tokens=10 + 3 * index)
        tokens.append(finished(events).token_ids)
    out[index] = tokens


def all_conversations(engine: Engine, concurrent: bool) -> dict:
    images = [engine.preprocess_images([make_image(100 + i)]) for i in range(NUM_SESSIONS)]
    out: dict = {}
    if not concurrent:
        for i in range(NUM_SESSIONS):
            converse(engine, i, images[i], 0.0, out)
        return out
    threads = [threading.Thread(target=converse, args=(engine, i, images[i], 0.01 * i, out))
               for i in range(NUM_SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1200)
    return out


def make_engine(model_path, **overrides) -> Engine:
    config = EngineConfig(model_path=str(model_path), max_context_tokens=512, max_batch_size=4, **overrides)
    return Engine(config).start()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    engine = make_engine(tiny_model_path)
    try:
        yield all_conversations(engine, concurrent=False)
    finally:
        engine.stop()


@pytest.mark.timeout(1500)  # the compiled variant compiles its buckets under the test's own load
@pytest.mark.parametrize("overrides", [{}, {"attention": "batched"}, {"static_kv": True},
                                       {"static_kv": True, "compile": True}],
                         ids=["batched", "batched-attention", "static", "static-compiled"])
def test_paths_give_the_plain_greedy_tokens(tiny_model_path, reference, overrides):
    engine = make_engine(tiny_model_path, **overrides)
    try:
        engine.max_batch_seen = 0
        got = all_conversations(engine, concurrent=True)
        assert engine.max_batch_seen >= 2  # sessions really shared decode steps
        if overrides.get("static_kv"):
            stepper = engine.parts.stepper
            assert stepper.graph_shapes <= set(stepper.all_shapes())  # every step in its buckets
            assert {bucket for kind, bucket, _ in stepper.graph_shapes if kind == "decode"} <= {1, 2, 4}
    finally:
        engine.stop()
    assert sorted(got) == list(range(NUM_SESSIONS))
    assert got == reference


def test_new_request_starts_while_eight_are_decoding(tiny_model_path):
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_batch_size=16)).start()
    try:
        long_requests = [GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=400), stream=EventStream(),
                                           token_ids=[1, 57 + i, 55, 859]) for i in range(8)]
        for request in long_requests:
            engine.submit(request)
        for request in long_requests:  # all eight are decoding
            assert isinstance(request.stream.get(timeout=60), Started)
            assert isinstance(request.stream.get(timeout=60), TextDelta)
        newcomer = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=5), stream=EventStream(),
                                     token_ids=[1, 60, 61])
        engine.submit(newcomer)
        events = [newcomer.stream.get(timeout=60)]
        while not isinstance(events[-1], (Finished, Failed)):
            events.append(newcomer.stream.get(timeout=60))
        assert isinstance(events[-1], Finished) and len(events[-1].token_ids) == 5
        # None of the eight has finished: the newcomer did not wait for them.
        for request in long_requests:
            drained = []
            while True:
                try:
                    drained.append(request.stream.get_nowait())
                except queue.Empty:
                    break
            assert not any(isinstance(e, Finished) for e in drained)
        assert engine.max_batch_seen == 9
    finally:
        engine.stop()


def test_compiled_static_path_has_one_graph_per_bucket_and_never_recompiles(tiny_model_path):
    """The NeuronCore shape: torch.compile over static shapes with a configurable backend (aot_eager
    here; `neuron` with the Neuron SDK), fullgraph, one graph per bucket, zero recompiles once warm."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from session.config import EngineConfig
    from session.engine.events import EventStream, Finished
    from session.types import SamplingParams

    config = EngineConfig(model_path=str(tiny_model_path), static_kv=True, compile=True, compile_backend="aot_eager",
                          max_batch_size=4, speculative="off", max_context_tokens=256)
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(config).start()
    assert counters["stats"]["unique_graphs"] == 8  # at start-up

    def workload(offset: int) -> None:
        streams = []
        for i in range(4):  # prompts of 4..7 tokens: one prefill bucket; 1..4 rows: decode buckets 1, 2, 4
            stream = EventStream()
            engine.submit(GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=3 + i), stream=stream,
                                            token_ids=[1] + [offset + i] * (3 + i)))
            streams.append(stream)
        for stream in streams:
            while not isinstance(event := stream.get(timeout=600), Finished):
                assert not hasattr(event, "error"), event

    try:
        stepper = engine.parts.stepper
        # compiled at start-up, every bucket: prefill 16..256 tokens and decode 1, 2, 4 rows, each over
        # the one KV-length bucket a 256-token window has (256 + 16 padding positions)
        assert stepper.kv_buckets == (272,) and stepper.prompt_buckets == (16, 32, 64, 128, 256)
        assert stepper.graph_shapes == set(stepper.all_shapes()) and len(stepper.graph_shapes) == 8
        counters.clear()
        workload(5)
        workload(40)  # other tokens, same buckets
        workload(90)
        assert counters["stats"]["unique_graphs"] == 0  # serving compiled nothing
        assert sum(counters["recompiles"].values()) == 0
        assert stepper.graph_shapes == set(stepper.all_shapes())
    finally:
        engine.stop()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fragmented_cache_prefill_and_verify_match_a_consecutive_one(family):
    """A session whose blocks interleave with another's (as when sessions grow side by side) is
    attended run by run in place: a follow-up prefill and a multi-token verify (extend) give the logits
    they give over consecutive blocks (grouped-query heads, causal masks over several runs)."""
    from model_store.build_text_models import ensure
    from session.model.runner import ModelRunner

    runner = ModelRunner(str(ensure([family])[family]), device="cpu", dtype="float32")
    assert runner.info.num_heads != runner.info.num_kv_heads
    generator = torch.Generator().manual_seed(3)
    history = torch.randint(5, 200, (40,), generator=generator).tolist()
    followup = torch.randint(5, 200, (7,), generator=generator).tolist()
    results = {}
    for layout in ("consecutive", "fragmented"):
        pool = runner.kv_pool(8)
        kv, other = pool.new_cache(256), pool.new_cache(256)
        for start in range(0, len(history), 8):  # fragmented: the other session takes a block in between
            runner.prefill(kv, runner.embed(history[start:start + 8], []))
            if layout == "fragmented":
                other.ensure_capacity(other.capacity + 8)
        assert (len(kv.runs(0, 0, kv.length)) > 1) == (layout == "fragmented")

        def gathered(*args):
            raise AssertionError("read the whole cache as one tensor (a gather) instead of its runs")

        kv.keys = kv.values = gathered  # neither path may copy the cache, fragmented or not
        prefill = runner.prefill(kv, runner.embed(followup, []), all_logits=True)
        runner.decode_attention = "per_row"
        verify = runner.extend([kv], [[7, 8, 9]])
        results[layout] = (prefill, verify)
        kv.release()
        other.release()
    for got, want in zip(results["fragmented"], results["consecutive"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
