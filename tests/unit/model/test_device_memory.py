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
