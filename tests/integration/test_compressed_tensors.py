"""A compressed-tensors checkpoint served as it is (session/model/compressed.py): SmolLM2-135M-Instruct
in W4A16 (4-bit, symmetric, groups of 64), the format llm-compressor writes, made offline from the
float32 checkpoint by model_store/build_compressed.py with the compressed-tensors library.

With RESIDENT_QUANTIZATION=auto its 210 linears run on our int4 kernel from the checkpoint's own
integers. A 3-turn session and a stateless request answer token for token what transformers'
``generate`` gives over the same model: transformers' compressed-tensors load with ``keep_packed``
applied. With RESIDENT_QUANTIZATION=none every linear stays as the library dequantized it, and the
engine answers as transformers does when the library decompresses them on its first forward."""

from __future__ import annotations

import pytest
import torch

from model_store.build_compressed import build
from model_store.build_smollm2 import build as build_smollm2
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream
from session.model import compressed
from session.model.quantize import QuantizedLinear
from session.types import SamplingParams
from tests.conftest import REPO
from tests.integration.test_engine import run
from tests.integration.test_smollm2 import MAX_NEW, QUESTIONS, session_turns, template_ids
from tests.integration.test_text_families import answer, generate


@pytest.fixture(scope="module")
def checkpoint():
    return build(build_smollm2(REPO / "models"), "w4a16")


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = Engine(EngineConfig(model_path=str(checkpoint), speculative="off", max_device_adapters=0)).start()
    yield engine
    engine.stop()


def transformers_model(checkpoint, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def reference(checkpoint, engine):
    """transformers' model of the checkpoint, its linears replaced as the engine's runner replaces them
    (after the engine: its start-up loaded our kernels)."""
    model = transformers_model(checkpoint, **compressed.load_kwargs("compressed-tensors"))
    report = compressed.keep_packed(model, list(model.model.layers), str(checkpoint), "compressed-tensors", "")
    assert report.num_kept == 210
    return model


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def ask(engine, prompts: list[list[int]]) -> list[list[int]]:
    return [list(answer(run(engine, GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=MAX_NEW),
                                                      stream=EventStream(), token_ids=ids)))[1].token_ids)
            for ids in prompts]


def test_the_checkpoints_integers_run_on_our_kernels(engine):
    runner = engine.parts.runner
    report = runner.compressed
    assert (report.kept, report.dequantized) == ({"int4 (groups of 64)": 210}, {})
    assert runner.quantization is None and runner.gguf is None  # auto: nothing left float
    for linear in (runner.layers[0].self_attn.q_proj, runner.layers[29].mlp.down_proj):
        assert isinstance(linear, QuantizedLinear) and linear.ours and linear.group_size == 64
    assert runner.path.fused is not None and runner.path.stack is not None  # the C++ decode layer and step
    assert "compressed-tensors checkpoint, kept packed on our kernels (float32 inputs): 210 int4 (groups of 64)" \
        in report.describe()


def test_three_turn_session_equals_generate_over_the_same_integers(engine, tokenizer, reference):
    turns = session_turns(engine, "compressed-session", QUESTIONS)
    for step, (prompt, finished) in enumerate(turns):
        answers = [done.text for _, done in turns[:step]]
        assert prompt == template_ids(tokenizer, QUESTIONS[: step + 1], answers)
        assert list(finished.token_ids) == generate(reference, prompt, MAX_NEW)


def test_stateless_equals_generate(engine, tokenizer, reference):
    ids = template_ids(tokenizer, QUESTIONS[2:], [])
    assert ask(engine, [ids]) == [generate(reference, ids, MAX_NEW)]


def test_none_serves_what_the_library_decompresses(checkpoint, tokenizer):
    prompts = [template_ids(tokenizer, [question], []) for question in QUESTIONS[:2]]
    served = Engine(EngineConfig(model_path=str(checkpoint), quantization="none", speculative="off",
                                 max_device_adapters=0)).start()
    try:
        runner = served.parts.runner
        assert runner.compressed.dequantized == {"RESIDENT_QUANTIZATION=none": 210}
        assert not isinstance(runner.layers[0].self_attn.q_proj, QuantizedLinear)
        ours = ask(served, prompts)
    finally:
        served.stop()
    model = transformers_model(checkpoint)  # decompressed by the library's hook on its first forward
    assert ours == [generate(model, ids, MAX_NEW) for ids in prompts]
