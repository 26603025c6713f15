"""Device memory defaults: on CUDA the session budget is never unlimited; an unused adapter bank
holds no device memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from session.config import EngineConfig
from session.engine.assembly import DEFAULT_CUDA_BUDGET_FRACTION, device_budget
from session.errors import ConfigError
from session.model.lora import AdapterWeights, LoraBank


def runner_on(kind: str):
    return SimpleNamespace(device=torch.device(kind))


@pytest.fixture
def free_gib(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 80 << 30))


def test_cuda_budget_defaults_to_a_fraction_of_free_memory(free_gib):
    config = EngineConfig()
    assert device_budget(config, runner_on("cuda")) == int((10 << 30) * DEFAULT_CUDA_BUDGET_FRACTION)


def test_cuda_budget_follows_the_settings(free_gib):
    assert device_budget(EngineConfig(device_budget_fraction=0.5), runner_on("cuda")) == 5 << 30
    assert device_budget(EngineConfig(device_budget_bytes=123), runner_on("cuda")) == 123


def test_cpu_budget_is_the_bytes_setting():
    assert device_budget(EngineConfig(), runner_on("cpu")) == 0  # unlimited on CPU unless set
    assert device_budget(EngineConfig(device_budget_bytes=4096), runner_on("cpu")) == 4096
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        device_budget(EngineConfig(device_budget_fraction=0.5), runner_on("cpu"))


def test_an_adapter_bank_nobody_uses_holds_no_memory():
    shapes = {(0, "q_proj"): (64, 64), (0, "v_proj"): (64, 32)}
    bank = LoraBank(shapes, num_slots=8, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    assert bank.nbytes == 0
    bank.set_rows([0, 0, 0])  # base-model batches never touch it
    assert bank.single is None and bank.mixed is None
    weights = {(0, "q_proj"): (torch.ones(4, 64), torch.ones(64, 4))}
    bank.load(1, AdapterWeights(name="a", rank=4, weights=weights))
    assert bank.nbytes == 9 * 16 * (64 + 64 + 64 + 32) * 4  # allocated on the first load, all slots


def test_bfloat16_on_cpu_only_where_the_cpu_has_it(monkeypatch):
    import session.model.runner as model_runner

    cpu = torch.device("cpu")
    assert model_runner.resolve_dtype("auto", cpu) is torch.float32  # what the equivalence tests pin
    assert model_runner.resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    monkeypatch.setattr(model_runner, "cpu_has_bf16", lambda: True)
    assert model_runner.resolve_dtype("bfloat16", cpu) is torch.bfloat16
    monkeypatch.setattr(model_runner, "cpu_has_bf16", lambda: False)
    assert model_runner.resolve_dtype("bfloat16", cpu) is torch.float32  # no native bf16: float32 is faster


def test_allocate_takes_the_banks_bytes_once_before_any_adapter():
    shapes = {(0, "q_proj"): (64, 64)}
    bank = LoraBank(shapes, num_slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    bank.allocate()
    first = bank.at[(0, "q_proj")]
    assert bank.nbytes == 3 * 8 * (64 + 64) * 4
    bank.allocate()  # once: what a load wrote stays
    assert bank.at[(0, "q_proj")] is first


def test_the_budget_is_measured_after_the_adapters_and_the_draft_load(tiny_model_path, monkeypatch):
    import session.engine.assembly as assembly

    events = []
    monkeypatch.setattr(assembly, "_speculator", lambda config, runner, tokenizer: events.append("draft"))
    monkeypatch.setattr(assembly, "device_budget", lambda config, runner: events.append(
        f"budget (lora installed: {runner.lora is not None})") or 0)
    assembly.assemble(EngineConfig(model_path=str(tiny_model_path), max_device_adapters=2))
    assert events == ["draft", "budget (lora installed: True)"]


def test_neuron_budget_is_a_fraction_of_what_torch_accelerator_reports(monkeypatch):
    neuron = SimpleNamespace(device=SimpleNamespace(type="neuron"))
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device=None: (8 << 30, 96 << 30))
    assert device_budget(EngineConfig(), neuron) == int((8 << 30) * DEFAULT_CUDA_BUDGET_FRACTION)
    assert device_budget(EngineConfig(device_budget_fraction=0.5), neuron) == 4 << 30

    def unsupported(device=None):
        raise RuntimeError("not implemented for neuron")

    monkeypatch.setattr(torch.accelerator, "get_memory_info", unsupported)
    with pytest.raises(ConfigError, match="set RESIDENT_DEVICE_BUDGET_BYTES"):
        device_budget(EngineConfig(), neuron)
    assert device_budget(EngineConfig(device_budget_bytes=1 << 30), neuron) == 1 << 30


def test_neuron_without_torchneuron_is_refused_naming_it():
    from session.model.runner import resolve_device, resolve_dtype
    from session.model.static_shapes import check_backend

    assert getattr(torch, "neuron", None) is None  # no TorchNeuron on this machine
    with pytest.raises(ConfigError, match=r"RESIDENT_DEVICE=neuron needs TorchNeuron: torch-neuronx matching "
                                          r"this torch .*Neuron SDK 2.33 or later, on a Trn2 or Trn3 .*no torch-neuronx"):
        resolve_device("neuron")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="RESIDENT_COMPILE_BACKEND=neuron needs TorchNeuron"):
        check_backend("neuron")
    with pytest.raises(ConfigError, match="RESIDENT_COMPILE_BACKEND=inductr: torch.compile has no such backend"):
        check_backend("inductr")
    check_backend("aot_eager")  # a backend this torch has
    assert resolve_dtype("auto", SimpleNamespace(type="neuron")) == torch.bfloat16


def test_auto_picks_a_neuroncore_where_torchneuron_has_one(monkeypatch):
    from session.model import runner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "neuron", SimpleNamespace(is_available=lambda: True), raising=False)
    monkeypatch.setattr(runner.torch, "device", lambda name: SimpleNamespace(type=name, index=None))
    assert runner.resolve_device("auto").type == "neuron"


MIB = 1 << 20


class ProfiledRunner:
    """What plan_memory needs of a runner on a mocked GPU: steps that 'allocate' by raising the fake
    device's peak, pools made on demand (real ones, on the CPU), and its decode path."""

    def __init__(self, memory, prefill_bytes: int, decode_bytes: int):
        self.memory, self.prefill_bytes, self.decode_bytes = memory, prefill_bytes, decode_bytes
        self.device = torch.device("cuda", 0)
        self.dtype = torch.float32
        self.info = SimpleNamespace(hidden_size=8, num_layers=4)
        self.kv_pools = {}
        self.path, self.steps = "graphs path object", []

    @property
    def decode_attention(self) -> str:
        return self.path

    def configure_decode(self, attention: str) -> None:
        self.path = attention

    def kv_pool(self, block_tokens: int):
        from session.model.kv_cache import KVPool

        if block_tokens not in self.kv_pools:
            self.kv_pools[block_tokens] = KVPool(num_layers=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                                                 device=torch.device("cpu"), block_tokens=block_tokens)
        return self.kv_pools[block_tokens]

    def new_kv_cache(self, *, block_tokens: int, max_tokens: int):
        return self.kv_pool(block_tokens).new_cache(max_tokens)

    def embed(self, token_ids, images):
        return torch.zeros(len(token_ids), self.info.hidden_size)

    def prefill(self, kv, embeds):
        self.steps.append(("prefill", kv.length, embeds.shape[0], self.path))
        kv.length += embeds.shape[0]
        self.memory.peak = max(self.memory.peak, self.memory.allocated + self.prefill_bytes)

    def decode(self, kvs, token_ids):
        self.steps.append(("decode", len(kvs), self.path))
        self.memory.peak = max(self.memory.peak, self.memory.allocated + self.decode_bytes)


@pytest.fixture
def gpu_memory(monkeypatch):
    memory = SimpleNamespace(allocated=3 << 30, peak=0, calls=[])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: memory.calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: setattr(memory, "peak", memory.allocated))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: memory.calls.append("empty_cache"))
    return memory


def test_the_kv_budget_leaves_room_for_the_measured_steps_eager_and_in_graphs(gpu_memory):
    from session.engine.assembly import plan_memory

    config = EngineConfig(step_token_budget=64, max_batch_size=8, kv_block_tokens=16)
    target, draft = ProfiledRunner(gpu_memory, 300 * MIB, 500 * MIB), ProfiledRunner(gpu_memory, 40 * MIB, 20 * MIB)
    own_pool = target.kv_pool(16)
    budget = plan_memory(config, [target, draft], 10 << 30, max_context=256)
    # the larger step of each (500 and 40 MiB), set aside twice (the eager step's and the graphs' pool); the
    # pools are read by SDPA over gathered blocks (not on a GPU here), which copies up to 1/4 of a pool a step
    assert budget == int(((10 << 30) - 2 * (500 + 40) * MIB) / (1 + 1 / 4))
    # SDPA's prefill is measured at the window's end (255 - 64 = 191 tokens fed first, unmeasured)
    assert target.steps == [("prefill", 0, 64, "batched"), ("prefill", 64, 64, "batched"),
                            ("prefill", 128, 63, "batched"), ("prefill", 191, 64, "batched"), ("decode", 8, "batched")]
    assert target.path == "graphs path object" and target.kv_pools == {16: own_pool}  # put back as they were
    assert own_pool.num_blocks == 1  # the scratch blocks were in a throwaway pool, gone
    assert [pool.num_blocks for pool in draft.kv_pools.values()] == [1]  # its own, empty, as the plan asked it
    assert gpu_memory.calls.count("empty_cache") == 2


def test_a_budget_in_bytes_or_off_cuda_is_left_as_it_is(gpu_memory):
    from session.engine.assembly import plan_memory

    runner = ProfiledRunner(gpu_memory, 300 * MIB, 500 * MIB)
    assert plan_memory(EngineConfig(device_budget_bytes=5 << 30), [runner], 5 << 30, 256) == 5 << 30
    runner.device = torch.device("cpu")
    assert plan_memory(EngineConfig(), [runner], 5 << 30, 256) == 5 << 30
    assert runner.steps == []
