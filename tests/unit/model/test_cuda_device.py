"""A process serving cuda:1 touches only cuda:1: the runner makes it the current device before any
other CUDA call, the device budget asks cuda:1's free memory, and CUDA graphs are captured on a
stream of cuda:1. Runs on CPU: ``torch.cuda`` is replaced by a fake that records every call."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from session.config import EngineConfig
from session.engine.assembly import DEFAULT_CUDA_BUDGET_FRACTION, device_budget
from session.model import runner as model_runner
from session.model.cuda_graphs import DecodeGraphs
from session.model.kv_cache import KVPool

FREE_BYTES = 10 << 30
VOCAB = 7


def index_of(device) -> int | None:
    """The GPU a device argument names; None for "the current device"."""
    if device is None or isinstance(device, int):
        return device
    return torch.device(device).index


class FakeStream:
    def __init__(self, cuda: FakeCuda, device: int, name: str):
        self.cuda, self.device, self.name = cuda, device, name  # name: "current" or "side"

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.calls.append(("wait_stream", (self.name, self.device), (other.name, other.device)))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.calls.append(("wait_event", (self.name, self.device), event.stream.name))


class FakeEvent:
    """A CUDA event: recorded on a stream; complete when the test says (``cuda.copies_done``)."""

    def __init__(self, cuda: FakeCuda):
        self.cuda, self.stream = cuda, None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.cuda.calls.append(("record", stream.name, stream.device))

    def query(self) -> bool:
        return self.cuda.copies_done

    def synchronize(self) -> None:
        self.cuda.calls.append(("synchronize_event", self.stream.name))
        self.cuda.copies_done = True


class FakeGraph:
    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def replay(self) -> None:
        # the real replay launches on the current stream of the device it was captured on
        self.cuda.calls.append(("replay", "current" if self.cuda.active is None else self.cuda.active.name))


class FakeCuda:
    """Stands in for ``torch.cuda``. ``calls``: (name, GPU index the call was about, ...) in order.
    It keeps a thread's current device as CUDA does (0 until set) and the stream work goes to; an
    attribute it does not define fails the test (a CUDA call nobody checked)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.current = 0
        self.defaults = {}  # GPU index -> its current (default) stream
        self.active: FakeStream | None = None  # the stream set by ``stream``
        self.capturing: FakeStream | None = None
        self.copies_done = False  # what FakeEvent.query answers

    def is_available(self) -> bool:
        self.calls.append(("is_available",))
        return True

    def set_device(self, device) -> None:
        self.calls.append(("set_device", index_of(device)))
        self.current = index_of(device)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", index_of(device)))
        return FREE_BYTES, 80 << 30

    def graph_pool_handle(self) -> tuple[int, int]:
        self.calls.append(("graph_pool_handle",))
        return (0, 1)

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 (torch's name)
        self.calls.append(("Stream", index_of(device)))
        return FakeStream(self, self.current if device is None else index_of(device), "side")

    def current_stream(self, device=None) -> FakeStream:
        self.calls.append(("current_stream", index_of(device)))
        index = self.current if device is None else index_of(device)
        return self.defaults.setdefault(index, FakeStream(self, index, "current"))

    @contextlib.contextmanager
    def device(self, device):
        self.calls.append(("device", index_of(device)))
        before, self.current = self.current, index_of(device)
        yield
        self.current = before

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        self.calls.append(("stream", stream.device))
        before, self.active = self.active, stream
        yield
        self.active = before

    def Event(self) -> FakeEvent:  # noqa: N802 (torch's name)
        return FakeEvent(self)

    def CUDAGraph(self) -> FakeGraph:  # noqa: N802 (torch's name)
        self.calls.append(("CUDAGraph",))
        return FakeGraph(self)

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        # the real one synchronizes and empties the cache of the current device, then captures on
        # ``stream`` or, without one, on a stream it makes on the current device
        self.calls.append(("graph", self.current, stream))
        self.capturing = self.active = stream
        yield
        self.capturing = self.active = None


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    return fake


def named_gpus(calls: list[tuple]) -> list[int | None]:
    """The GPU each device-taking call named, in order (None: it left it to the current device)."""
    gpus = []
    for name, *args in calls:
        if name == "wait_stream":
            gpus += [stream_device for _, stream_device in args]
        elif name in ("set_device", "mem_get_info", "Stream", "current_stream", "device", "stream", "graph"):
            gpus.append(args[0])  # graph: the current device during the capture
    return gpus


class Stop(Exception):
    pass


def build_runner(monkeypatch, cuda: FakeCuda, tmp_path, device: str) -> None:
    """Build a ModelRunner up to its checkpoint's config, which is the first thing it reads."""
    import transformers

    def load_config(path):
        cuda.calls.append(("load_config",))
        raise Stop

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", load_config)
    with pytest.raises(Stop):
        model_runner.ModelRunner(str(tmp_path), device=device)


def test_a_runner_on_cuda_1_sets_its_device_before_anything_else(monkeypatch, cuda, tmp_path):
    build_runner(monkeypatch, cuda, tmp_path, "cuda:1")
    assert cuda.calls == [("set_device", 1), ("load_config",)]


def test_auto_and_bare_cuda_name_gpu_0(monkeypatch, cuda, tmp_path):
    build_runner(monkeypatch, cuda, tmp_path, "auto")
    assert cuda.calls == [("is_available",), ("set_device", 0), ("load_config",)]  # probing opens no context
    assert model_runner.resolve_device("cuda") == torch.device("cuda", 0)
    assert model_runner.resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_runner_on_cpu_makes_no_cuda_call(monkeypatch, cuda, tmp_path):
    build_runner(monkeypatch, cuda, tmp_path, "cpu")
    assert cuda.calls == [("load_config",)]
    assert model_runner.resolve_device("cpu") == torch.device("cpu")


def test_the_budget_is_cuda_1s_free_memory(cuda):
    device = model_runner.resolve_device("cuda:1")
    model_runner.select_device(device)
    runner = type("Runner", (), {"device": device})()
    assert device_budget(EngineConfig(), runner) == int(FREE_BYTES * DEFAULT_CUDA_BUDGET_FRACTION)
    assert cuda.calls == [("set_device", 1), ("mem_get_info", 1)]
    assert named_gpus(cuda.calls) == [1, 1]


class FakeRunner:
    """What DecodeGraphs needs of a runner: its device and ``forward_paged``, here noting the stream
    each forward ran on and whether it was being captured. Tensors stay on the CPU."""

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda
        self.device = torch.device("cuda", 1)
        self.forwards: list[tuple[FakeStream | None, bool]] = []  # (stream, captured)

    def forward_paged(self, pool, ids, batch, position_offsets=None):
        self.forwards.append((self.cuda.active, self.cuda.capturing is not None))
        return torch.arange(ids.numel() * VOCAB, dtype=torch.float32).view(*ids.shape, VOCAB)  # [B, T, V]


@pytest.fixture
def cpu_tensors(monkeypatch, cuda) -> list:
    """torch.tensor(..., device=cuda:1) made on the CPU; the devices asked for, in order. Pinning a
    host tensor is noted in the fake's calls ("pin_memory") and leaves it as it is."""
    devices = []
    make = torch.tensor

    def tensor(data, *, device=None, **kwargs):
        devices.append(index_of(device) if device is not None else "host")
        return make(data, **kwargs)

    def pin_memory(self, *args, **kwargs):
        cuda.calls.append(("pin_memory",))
        return self

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return devices


def test_graphs_are_captured_on_a_stream_of_cuda_1(cuda, cpu_tensors):
    runner = FakeRunner(cuda)
    graphs = DecodeGraphs(runner, batch_buckets=(1, 2))
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=8)
    kvs = [pool.new_cache(16), pool.new_cache(16)]
    for kv in kvs:
        kv.ensure_capacity(1)

    logits = graphs.run(kvs[:1], [5])  # captures (1 row, 1 block), replays
    graphs.run(kvs[:1], [6])  # replays it
    graphs.run(kvs, [5, 6])  # captures (2 rows, 1 block), replays

    assert cuda.calls[:2] == [("graph_pool_handle",), ("Stream", 1)]
    stream = graphs.stream
    assert stream.device == 1
    # every capture on that one stream, with cuda:1 the current device there (the thread's was 0)
    assert [call for call in cuda.calls if call[0] == "graph"] == [("graph", 1, stream), ("graph", 1, stream)]
    # the warm-up and the captured forward on that stream, each capture after its warm-up
    assert runner.forwards == [(stream, False), (stream, True)] * 2
    assert [call for call in cuda.calls if call[0] == "replay"] == [("replay", "current")] * 3
    assert set(named_gpus(cuda.calls)) == {1}, cuda.calls
    assert [d for d in cpu_tensors if d != "host"] == [1, 1]  # the two graphs' plans, on cuda:1
    assert cuda.calls.count(("pin_memory",)) == 3  # each step's plan copied in from pinned memory
    assert logits.shape == (1, VOCAB)


def test_the_warm_up_waits_for_the_plan_and_the_device_waits_for_the_warm_up(cuda, cpu_tensors):
    runner = FakeRunner(cuda)
    graphs = DecodeGraphs(runner, batch_buckets=(1,))
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=4)
    kv = pool.new_cache(8)
    kv.ensure_capacity(1)
    graphs.run([kv], [3])
    waits = [call for call in cuda.calls if call[0] == "wait_stream"]
    assert waits == [("wait_stream", ("side", 1), ("current", 1)),  # the plan was written on the current stream
                     ("wait_stream", ("current", 1), ("side", 1))]  # what the warm-up wrote (the padding block)
    stream_order = [call[0] for call in cuda.calls if call[0] in ("wait_stream", "stream", "graph")]
    assert stream_order == ["wait_stream", "stream", "wait_stream", "graph"]


def test_every_graph_is_captured_at_start_up_largest_first_and_none_mid_serving(cuda, cpu_tensors):
    runner = FakeRunner(cuda)
    graphs = DecodeGraphs(runner, batch_buckets=(1, 2, 4))
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=16)
    assert graphs.capture_all(pool, max_tokens=16) == 9  # 3 batch buckets x block tables of 1, 2, 4 blocks
    assert list(graphs.graphs) == [(4, 4), (4, 2), (4, 1), (2, 4), (2, 2), (2, 1), (1, 4), (1, 2), (1, 1)]
    captures = len([call for call in cuda.calls if call[0] == "graph"])
    kvs = [pool.new_cache(16) for _ in range(3)]
    for kv in kvs:
        kv.ensure_capacity(6)  # two blocks each
    graphs.run(kvs, [5, 6, 7])  # 3 rows -> the 4-row graph: replayed, not captured
    graphs.run(kvs[:1], [5])
    assert len([call for call in cuda.calls if call[0] == "graph"]) == captures == 9
    assert [call for call in cuda.calls if call[0] == "replay"] == [("replay", "current")] * 2


def test_no_graph_gathers_more_blocks_than_the_pool_holds_and_such_a_step_runs_eagerly(cuda, cpu_tensors):
    runner = FakeRunner(cuda)
    graphs = DecodeGraphs(runner, batch_buckets=(1, 2, 4))
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=8)
    assert graphs.capture_all(pool, max_tokens=16) == 8  # all but 4 rows x 4 blocks (16 > 8 blocks)
    assert (4, 4) not in graphs.graphs and (4, 2) in graphs.graphs and (2, 4) in graphs.graphs
    kvs = [pool.new_cache(16) for _ in range(3)]
    kvs[0].ensure_capacity(13)
    kvs[0].length = 12  # its next token needs a 4th block: 3 rows padded to 4 x 4 blocks
    for kv in kvs[1:]:
        kv.ensure_capacity(1)
    assert not graphs.fits(kvs) and graphs.fits(kvs[:2])  # the eager path takes it (ModelRunner.decode)


def test_an_m_rope_models_graph_plan_carries_each_rows_rope_delta():
    """The graph step over its plan (run eagerly here, on the CPU) gives what the eager decode step
    gives Qwen2-VL sessions with different rope deltas; padding rows add nothing."""
    from model_store.build_qwen_vl import ensure
    from session.model.cuda_graphs import graph_rows, graph_step
    from session.model.runner import ModelRunner

    runner = ModelRunner(str(ensure(["qwen2_vl"])["qwen2_vl"]), device="cpu", cpu_kernels=False)
    runner.configure_decode("batched")
    assert runner.mrope
    kvs = [runner.new_kv_cache(block_tokens=8, max_tokens=64) for _ in range(2)]
    kvs[0].pool.reserve(32)
    for kv, ids in zip(kvs, ([3, 4, 5, 6, 7], [8, 9, 10])):
        runner.prefill(kv, runner.embed(ids, []))
    for kv in kvs:
        kv.ensure_capacity(kv.length + 1)
    rows = graph_rows(kvs, [[11], [12]], [-40, 7], 4, 2, True)
    assert [row[-1] for row in rows] == [-40, 7, 0, 0] and len(rows[0]) == 1 + 1 + 1 + 2 + 1
    lengths = [kv.length for kv in kvs]
    graphed = graph_step(runner, kvs[0].pool, torch.tensor(rows), True)[:2]
    for kv, length in zip(kvs, lengths):
        kv.length = length  # the graph step wrote the same keys where the eager step writes them
    eager = runner.decode(kvs, [11, 12], position_offsets=[-40, 7])
    assert torch.allclose(graphed, eager, atol=1e-5, rtol=1e-5)
    plain = graph_step(runner, kvs[0].pool, torch.tensor(graph_rows(kvs, [[11], [12]], None, 2, 2, False)), False)
    assert not torch.allclose(plain, eager, atol=1e-3)  # without the deltas: other positions, other logits


def test_verify_graphs_are_captured_at_start_up_and_replayed_for_a_speculative_step(cuda, cpu_tensors):
    runner = FakeRunner(cuda)
    graphs = DecodeGraphs(runner, batch_buckets=(1, 2, 4), verify_tokens=3, verify_buckets=(1, 2))
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=16)
    # 3 decode buckets and 2 verify buckets, each with block tables of 1, 2, 4 blocks; larger steps first
    assert graphs.capture_all(pool, max_tokens=16) == 9 + 6
    assert list(graphs.verify_graphs) == [(2, 4), (2, 2), (2, 1), (1, 4), (1, 2), (1, 1)]
    # every graph of a width writes into one logits buffer sized for its largest batch
    assert graphs.outputs[1].shape == (4, VOCAB) and graphs.outputs[3].shape == (2, 3, VOCAB)
    assert {g.logits.data_ptr() for g in graphs.graphs.values()} == {graphs.outputs[1].data_ptr()}
    assert {g.logits.data_ptr() for g in graphs.verify_graphs.values()} == {graphs.outputs[3].data_ptr()}
    captures = len([call for call in cuda.calls if call[0] == "graph"])
    kvs = [pool.new_cache(16) for _ in range(2)]
    for kv, length in zip(kvs, (5, 2)):
        kv.ensure_capacity(length + 3)
        kv.length = length
    assert graphs.fits_verify(kvs, 3) and not graphs.fits_verify(kvs, 4)  # wider than the graphs: eager
    logits = graphs.run_verify(kvs, [[7, 8, 9], [4, 5]])
    assert logits.shape == (2, 3, VOCAB)
    assert graphs.run_verify(kvs, [[7], [4]]).shape == (2, 1, VOCAB)  # one token a row: the decode graph
    assert len([call for call in cuda.calls if call[0] == "graph"]) == captures  # none captured mid-serving
    assert [call for call in cuda.calls if call[0] == "replay"] == [("replay", "current")] * 2
    kvs[0].length = 14  # 14 + 3 passes its 16-token window: this step has no graph
    assert not graphs.fits_verify(kvs, 2) and graphs.fits_verify(kvs, 1)


def test_a_verify_graphs_plan_gives_the_eager_extends_logits():
    """The verify graph's step over its plan (run eagerly here, on the CPU): rows of 3, 1 and 2 tokens
    padded to 3 with their last token, plus a padding row, give each row's logits of the eager extend."""
    from model_store.build_text_models import ensure
    from session.model.cuda_graphs import graph_rows, graph_step
    from session.model.runner import ModelRunner

    runner = ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)
    runner.configure_decode("batched")
    kvs = [runner.new_kv_cache(block_tokens=8, max_tokens=64) for _ in range(3)]
    kvs[0].pool.reserve(32)
    for kv, ids in zip(kvs, ([3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21])):
        runner.prefill(kv, runner.embed(ids, []))
    token_rows = [[30, 31, 32], [33], [34, 35]]
    lengths = [kv.length for kv in kvs]
    for kv in kvs:
        kv.ensure_capacity(kv.length + 3)
    padded = [row + row[-1:] * (3 - len(row)) for row in token_rows]
    rows = graph_rows(kvs, padded, None, 4, 2, False, num_new=3)
    assert rows[1][:3] == [33, 33, 33] and rows[3][:3] == [0, 0, 0] and len(rows[0]) == 3 + 1 + 3 + 2
    graphed = graph_step(runner, kvs[0].pool, torch.tensor(rows), False, num_new=3)[:3]
    for kv, length in zip(kvs, lengths):
        kv.length = length  # the eager extend writes the same keys again
    eager = runner.extend(kvs, token_rows)
    for b, row in enumerate(token_rows):
        assert torch.allclose(graphed[b, : len(row)], eager[b, : len(row)], atol=1e-5, rtol=1e-5)


def test_the_batched_path_verifies_through_the_graphs_unless_a_row_has_an_adapter():
    """BatchedPath.extend hands a verify the graphs can take to them, its caches sized for the graph's
    width; rows with an adapter, or wider than the graphs, run the eager pass."""
    from model_store.build_text_models import ensure
    from session.model.decode_paths import BatchedPath
    from session.model.runner import ModelRunner

    class Recorder:
        verify_tokens = 4

        def __init__(self):
            self.calls = []

        def fits_verify(self, kvs, width):
            return width <= self.verify_tokens

        def run_verify(self, kvs, token_rows):
            self.calls.append(([kv.block_ids[:] for kv in kvs], token_rows))
            return torch.zeros(len(kvs), max(map(len, token_rows)), 7)

    runner = ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)
    recorder = Recorder()
    runner.path = BatchedPath(runner, recorder)
    kvs = [runner.new_kv_cache(block_tokens=4, max_tokens=64) for _ in range(2)]
    for kv in kvs:
        runner.prefill(kv, runner.embed([3, 4, 5, 6, 7, 8], []))
    assert runner.extend(kvs, [[9, 10], [11]]).shape == (2, 2, 7)
    assert [kv.length for kv in kvs] == [8, 7]
    (tables, rows), = recorder.calls
    assert rows == [[9, 10], [11]] and [len(t) for t in tables] == [3, 3]  # room for 6 + 4 padded tokens each
    assert runner.extend(kvs, [[12], [13]], adapter_slots=[0, 1]).shape[2] == runner.info.vocab_size  # eager
    assert runner.extend(kvs, [[1, 2, 3, 4, 5], [6]]).shape[2] == runner.info.vocab_size  # 5 > 4: eager
    assert len(recorder.calls) == 1


def test_a_restore_from_pinned_host_memory_does_not_block_the_host(monkeypatch):
    """PagedKVCache.load -> KVPool.store: each pinned host copy goes to the device with
    non_blocking=True (a pageable one would block), and lands in the session's slots."""
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=8, head_major=False)
    saved = torch.arange(2 * 2 * 6 * 4, dtype=torch.float32).view(2, 2, 6, 4)
    pool.device = torch.device("cuda", 1)  # its tensors stay on the CPU; the copies are recorded
    copies = []
    move = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and args[0] == pool.device:
            copies.append(kwargs.get("non_blocking", False))
            return move(self, "cpu")
        return move(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    kv = pool.new_cache(16)
    monkeypatch.setattr("session.model.kv_cache.to_device", lambda values, device: torch.tensor(values))
    kv.load(saved, saved + 1)
    assert copies == [True, True]  # K and V, each without blocking the host
    staged = []
    empty = torch.empty

    def pinned_empty(*args, pin_memory=False, **kwargs):
        staged.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned_empty)
    other = pool.new_cache(16)
    other.ensure_capacity(6)
    slots = torch.tensor(other.slots(2, 6))
    pool.store(slots, saved[:, :, 2:], (saved + 1)[:, :, 2:])  # past a 2-token prefix: not contiguous
    assert staged == [True, True] and copies == [True] * 4  # staged in pinned memory, then not blocking
    pool.device = torch.device("cpu")
    assert torch.equal(kv.keys(1, 6), saved[1]) and torch.equal(kv.values(0, 6), saved[0] + 1)
    assert torch.equal(other.keys(1, 6)[:, 2:], saved[1, :, 2:])


def test_a_lora_graphs_plan_gives_the_eager_mixed_adapter_step():
    """The step a graph with adapter rows captures (run eagerly here, on the CPU): each row's slot a
    plan column, its factors gathered from the bank (LoraBank.slot_rows), gives the eager step's
    logits for a mix of two adapters of different ranks and a base row, a padding row included."""
    from model_store.build_text_models import ensure
    from session.model.cuda_graphs import graph_rows, graph_step
    from session.model.lora import TARGETS
    from session.model.runner import ModelRunner
    from tests.conftest import random_adapter

    runner = ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)
    runner.configure_decode("batched")
    bank, shapes = runner.enable_lora(num_slots=2, max_rank=8)
    bank.load(1, random_adapter(shapes, 1, 8, TARGETS))
    bank.load(2, random_adapter(shapes, 2, 4, ("q_proj", "v_proj", "down_proj")))
    kvs = [runner.new_kv_cache(block_tokens=8, max_tokens=64) for _ in range(3)]
    kvs[0].pool.reserve(32)
    for kv, start in zip(kvs, (3, 9, 20)):
        runner.prefill(kv, runner.embed(list(range(start, start + 10)), []))
    for kv in kvs:
        kv.ensure_capacity(kv.length + 1)
    for slots in ([1, 0, 2], [2, 2, 2]):
        rows = graph_rows(kvs, [[5], [6], [7]], None, 4, 2, False, adapter_slots=slots, with_adapters=True)
        assert [row[-1] for row in rows] == [*slots, 0]
        lengths = [kv.length for kv in kvs]
        graphed = graph_step(runner, kvs[0].pool, torch.tensor(rows), False, with_adapters=True)[:3]
        assert bank.rows is None  # the slots hold for the step only
        for kv, length in zip(kvs, lengths):
            kv.length = length
        eager = runner.decode(kvs, [5, 6, 7], adapter_slots=slots)
        for kv, length in zip(kvs, lengths):
            kv.length = length
        assert torch.allclose(graphed, eager, atol=1e-5, rtol=1e-5)
        base = runner.decode(kvs, [5, 6, 7])
        for kv, length in zip(kvs, lengths):
            kv.length = length
        assert not torch.allclose(graphed[0], base[0], atol=1e-3)  # the adapter changed row 0
    # one row (fewer than half the slots): its slot's factors gathered, not every slot's read
    rows = graph_rows(kvs[:1], [[5]], None, 1, 2, False, adapter_slots=[2], with_adapters=True)
    length = kvs[0].length
    graphed = graph_step(runner, kvs[0].pool, torch.tensor(rows), False, with_adapters=True)
    kvs[0].length = length
    assert torch.allclose(graphed, runner.decode(kvs[:1], [5], adapter_slots=[2]), atol=1e-5, rtol=1e-5)


def test_adapter_rows_replay_their_own_graphs_once_the_bank_is_allocated(cuda, cpu_tensors):
    runner = FakeRunner(cuda)
    runner.lora = SimpleNamespace(at={}, slot_rows=lambda slots: contextlib.nullcontext())
    graphs = DecodeGraphs(runner, batch_buckets=(1, 2))
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=8)
    assert graphs.capture_all(pool, max_tokens=8) == 4  # no bank yet: base graphs only
    kvs = [pool.new_cache(8), pool.new_cache(8)]
    for kv in kvs:
        kv.ensure_capacity(1)
    assert not graphs.fits(kvs, [1, 0]) and graphs.fits(kvs, [0, 0]) and graphs.fits(kvs)
    runner.lora.at = {"allocated": True}
    assert graphs.capture_all(pool, max_tokens=8) == 8  # the same buckets again, with adapter rows
    assert list(graphs.lora_graphs) == [(2, 2), (2, 1), (1, 2), (1, 1)]
    assert graphs.fits(kvs, [1, 0])
    captures = len([call for call in cuda.calls if call[0] == "graph"])
    graphs.run(kvs, [5, 6], adapter_slots=[1, 0])
    graphs.run(kvs, [5, 6], adapter_slots=[0, 0])  # no adapter row: the base graph
    assert len([call for call in cuda.calls if call[0] == "graph"]) == captures
    plans = [g.plan for g in (graphs.lora_graphs[(2, 1)], graphs.graphs[(2, 1)])]
    assert plans[0][:, -1].tolist() == [1, 0] and plans[0].shape[1] == plans[1].shape[1] + 1


def test_a_batched_sdpa_step_that_would_gather_past_a_fixed_pool_attends_per_row(monkeypatch):
    """Rows x the widest block table past the pool's blocks: the step runs per row (each row's own
    blocks copied), with the same logits; within the pool, or on a pool without a budget, batched."""
    from model_store.build_text_models import ensure
    from session.model.runner import ModelRunner

    runner = ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)
    runner.configure_decode("batched")
    kvs = [runner.new_kv_cache(block_tokens=4, max_tokens=64) for _ in range(3)]
    pool = kvs[0].pool
    pool.reserve(12)
    for kv, count in zip(kvs, (17, 2, 2)):  # with the step's token: 5 blocks, 1 and 1; padded to 5 each
        runner.prefill(kv, runner.embed(list(range(3, 3 + count)), []))
    batched = []
    forward = runner.forward_paged
    monkeypatch.setattr(runner, "forward_paged", lambda *args: batched.append(1) or forward(*args))
    lengths = [kv.length for kv in kvs]

    def step():
        logits = runner.decode(kvs, [7, 8, 9])
        for kv, length in zip(kvs, lengths):
            kv.length = length
        return logits

    free = step()
    assert len(batched) == 1  # a pool without a budget: batched
    pool.blocks.fixed = True
    per_row = step()
    assert len(batched) == 1 and pool.num_blocks == 12  # 3 rows x 5 blocks > 12: per row
    assert torch.allclose(per_row, free, atol=1e-5, rtol=1e-5)
    pool.reserve(16)
    step()
    assert len(batched) == 2  # 15 blocks fit 16


def test_a_demotion_copies_on_the_side_stream_and_its_blocks_settle_until_the_copy_is_done(cuda, monkeypatch):
    """host_copy: on the pool's side stream, after the current stream's work, an event recorded after it.
    The demoted session's blocks are not handed out while the copy may read them (a new owner's keys
    would reach the host): settling until the event is seen done, or waited for when they are needed.
    A restore's copy back waits for the event on the device."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4, num_blocks=8, head_major=False)
    pool.blocks.fixed = True
    kv = pool.new_cache(16)
    kv.ensure_capacity(12)  # 3 of the 7 blocks
    kv.length = 12
    pool.k.narrow(pool.block_dim, 0, pool.num_blocks).normal_()  # the blocks in use, not all it reserved
    want = kv.to_host()[0].clone()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: torch.zeros(*args, **kwargs))
    pool.device = torch.device("cuda", 1)
    assert torch.equal(kv.to_host()[0], want)
    side = pool.copy_stream
    assert side.name == "side" and side.device == 1
    assert [c for c in cuda.calls if c[0] in ("wait_stream", "stream", "record")] == [
        ("wait_stream", ("side", 1), ("current", 1)), ("stream", 1), ("record", "side", 1)]
    kv.release()
    assert len(pool.blocks.settling) == 3 and len(pool.blocks.free_ids) == 4 and pool.blocks.available == 7  # counted, not handed out
    taken = pool.allocate(4)  # the never-copied blocks, no waiting
    assert len(pool.blocks.settling) == 3 and ("synchronize_event", "side") not in cuda.calls
    cuda.copies_done = True  # the copy finished: the next look frees them without waiting
    taken += pool.allocate(1)
    assert pool.blocks.settling == [] and len(pool.blocks.free_ids) == 2 and ("synchronize_event", "side") not in cuda.calls
    cuda.copies_done = False
    pool.host_copy(taken[:1], 1)  # another copy in flight, of a block then given back
    pool.blocks.free(taken[:1])
    assert pool.blocks.settling == taken[:1]
    taken = taken[1:] + pool.allocate(3)  # more than the 2 free: the host waits for the copy
    assert ("synchronize_event", "side") in cuda.calls and pool.blocks.settling == [] and not pool.blocks.free_ids
    pool.blocks.free(taken[:1])
    assert pool.blocks.free_ids == taken[:1]  # no copy in flight: free at once
    holder = pool.new_cache(16)
    holder.ensure_capacity(4)
    cuda.copies_done = False
    pool.host_copy(taken[1:2], 4)  # a restore while a copy is in flight
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: self)
    before = len(cuda.calls)
    pool.store(torch.tensor(holder.slots(0, 4)), want[:, :, :4].contiguous(), want[:, :, :4].contiguous())
    # the current stream (of cuda:1) waits for the copy on the device before reading; the host does not
    assert cuda.calls[before:before + 2] == [("current_stream", 1), ("wait_event", ("current", 1), "side")]
    assert ("synchronize_event", "side") not in cuda.calls[before:]
    strided = want[:, :, 1:4].transpose(2, 3).contiguous().transpose(2, 3)  # as a slice past a prefix is
    assert not strided.is_contiguous()
    pool.store(torch.tensor(holder.slots(1, 4)), strided, strided)  # staged on the host:
    assert ("synchronize_event", "side") in cuda.calls[before:]  # the host first waits for the copy
