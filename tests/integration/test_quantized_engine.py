"""Weight-only quantization in the engine (RESIDENT_QUANTIZATION; session/model/quantize.py) on CPU.

On the tiny demo LLaVA, int8 and int4 sessions answer token for token what the model's own quantized
forward gives: transformers' greedy ``generate`` over the same checkpoint quantized the same way
(``quantize_language_model``). On int8, an adapter session equals that forward with the adapter's
deltas added by hand, and prompt-lookup speculation equals plain int8 decoding. On SmolLM2 (a real
checkpoint), the same exactness; and how often int8 and int4 agree with float32, printed (only a loose
floor asserted: ``python -m benchmarks.quantization`` measures it properly)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from session.config import EngineConfig
from session.engine import CloseRequest, Engine, GenerationRequest
from session.engine.events import EventStream
from session.families.vision import NO_IMAGES
from session.model.lora import load_adapter, target_shapes
from session.model.quantize import QuantizedLinear, quantize_language_model
from session.types import SamplingParams
from tests.conftest import REPO, make_image
from tests.integration.test_engine import QUESTIONS, finished, run, turn, user
from tests.integration.test_smollm2 import template_ids
from tests.integration.test_text_families import generate

CPU = torch.device("cpu")
ECHO = ["Repeat: one two three four five six seven eight, one two three four five six seven eight.",
        "Once more: one two three four five six seven eight.", "And again, one two three four."]


def quantized_llava(path, method: str):
    """Transformers' tiny LLaVA, its decoder layers quantized as the engine's runner quantizes them."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    quantize_language_model(model, list(model.model.language_model.layers), method, CPU)
    return model


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(tiny_model_path, adapters_dir, request):
    """(method, engine, reference): the engine and transformers' model, both quantized by ``method``."""
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), quantization=request.param, speculative="off",
                                 adapters_dir=str(adapters_dir))).start()
    yield request.param, engine, quantized_llava(tiny_model_path, request.param)
    engine.stop()


def test_the_runner_serves_quantized_linears(quantized):
    method, engine, _ = quantized
    runner = engine.parts.runner
    assert runner.quantization.method == method and runner.quantization.num_linears == 14
    q_proj = runner.layers[0].self_attn.q_proj
    assert isinstance(getattr(q_proj, "base", q_proj), QuantizedLinear)  # under LoRA's wrapper
    # float32 activations run our int8 and int4 kernels, so the C++ decode layer and step take them
    assert getattr(q_proj, "base", q_proj).ours
    assert runner.path.fused is not None and runner.path.stack is not None


def test_three_turn_session_equals_the_quantized_models_generate(quantized, tiny_model_path):
    from transformers import AutoProcessor

    method, engine, reference = quantized
    image = make_image(7, (90, 40))
    pixel_values = AutoProcessor.from_pretrained(tiny_model_path).image_processor(
        images=[image], return_tensors="pt")["pixel_values"]
    sid = f"quantized-{method}"
    for index, question in enumerate(QUESTIONS[:3]):
        events = turn(engine, sid, question, open_session=index == 0, max_tokens=16,
                      images=engine.preprocess_images([image]) if index == 0 else NO_IMAGES)
        started, done = events[0], finished(events)
        assert (started.cached_tokens > 0) == (index > 0)
        prompt = engine.parts.store.get(sid).token_ids[: started.prompt_tokens]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(input_ids=ids, pixel_values=pixel_values, do_sample=False,
                                          attention_mask=torch.ones_like(ids), max_new_tokens=16)
        assert list(done.token_ids) == expected[0, len(prompt):].tolist()[: len(done.token_ids)]
        assert len(done.token_ids) == 16 or done.finish_reason == "stop"
    run(engine, CloseRequest(sid, EventStream()))


def test_quantized_weights_change_the_logits(quantized, tiny_model_path):
    """The reference really is quantized (else the test above would compare float with float)."""
    from transformers import LlavaForConditionalGeneration

    _, _, reference = quantized
    dense = LlavaForConditionalGeneration.from_pretrained(tiny_model_path).eval()
    ids = torch.tensor([[1, 57, 55, 859, 30, 225, 59, 76]])
    with torch.no_grad():
        assert not torch.equal(reference(input_ids=ids).logits, dense(input_ids=ids).logits)


class WithDelta(nn.Module):
    """A base linear plus one LoRA adapter's delta, written out: base(x) + (x A^T) B^T (B scaled)."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.base, self.a, self.b = base, a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def with_adapter(model, path) -> None:
    layers = list(model.model.language_model.layers)
    adapter = load_adapter("domain", path, target_shapes(layers), max_rank=64)
    for (index, target), (a, b) in adapter.weights.items():
        parent = layers[index].mlp if target in ("gate_proj", "up_proj", "down_proj") else layers[index].self_attn
        setattr(parent, target, WithDelta(getattr(parent, target), a, b))


def test_adapter_session_on_int8(quantized, tiny_model_path, adapters_dir):
    method, engine, reference = quantized
    if method != "int8":
        pytest.skip("the adapter path is checked on int8")
    plain = quantized_llava(tiny_model_path, "int8")
    with_adapter(reference := quantized_llava(tiny_model_path, "int8"), adapters_dir / "domain")
    sid = "quantized-adapter"
    for index, question in enumerate(QUESTIONS[:2]):
        request = GenerationRequest(messages=user(question), sampling=SamplingParams(max_tokens=12),
                                    stream=EventStream(), session_id=sid, open_session=index == 0,
                                    adapter="domain" if index == 0 else None)
        events = run(engine, request)
        prompt = engine.parts.store.get(sid).token_ids[: events[0].prompt_tokens]
        assert list(finished(events).token_ids) == generate(reference, prompt, 12)
        if index == 0:  # the adapter changes the answer
            assert list(finished(events).token_ids) != generate(plain, prompt, 12)
    run(engine, CloseRequest(sid, EventStream()))


def converse(engine: Engine, sid: str, questions: list[str], max_tokens: int = 24) -> list[tuple[int, ...]]:
    answers = []
    for index, question in enumerate(questions):
        request = GenerationRequest(messages=user(question), sampling=SamplingParams(max_tokens=max_tokens),
                                    stream=EventStream(), session_id=sid, open_session=index == 0)
        answers.append(tuple(finished(run(engine, request)).token_ids))
    run(engine, CloseRequest(sid, EventStream()))
    return answers


def test_prompt_lookup_speculation_equals_plain_int8(quantized, tiny_model_path):
    method, engine, _ = quantized
    if method != "int8":
        pytest.skip("speculation is checked on int8")
    speculative = Engine(EngineConfig(model_path=str(tiny_model_path), quantization="int8", speculative="ngram",
                                      max_device_adapters=0)).start()
    try:
        got = converse(speculative, "spec-int8", ECHO)
        stats = speculative.stats().speculation
    finally:
        speculative.stop()
    assert got == converse(engine, "plain-int8", ECHO)
    assert stats["target_passes"] > 0 and 0 < stats["accepted"] <= stats["proposed"]


def test_a_draft_model_is_quantized_as_the_target_and_speculation_equals_plain(quantized):
    """The committed target/draft pair (model_store/pair): the draft gets the target's RESIDENT_QUANTIZATION."""
    from tests.integration.test_engine_speculative import PAIR

    method, _, _ = quantized
    if method != "int8":
        pytest.skip("speculation is checked on int8")
    settings = dict(model_path=str(PAIR / "target"), quantization="int8", max_device_adapters=0)
    plain = Engine(EngineConfig(**settings, speculative="off")).start()
    drafted = Engine(EngineConfig(**settings, speculative="draft", draft_model_path=str(PAIR / "draft"))).start()
    try:
        draft = drafted.parts.speculator.draft
        assert draft.quantization is not None and draft.quantization.method == "int8"
        assert draft.quantization.num_linears == len(draft.layers) * 7
        assert converse(drafted, "draft-int8", ECHO) == converse(plain, "plain-int8", ECHO)
        stats = drafted.stats().speculation
        assert stats["target_passes"] > 0 and 0 < stats["accepted"] <= stats["proposed"]
    finally:
        drafted.stop()
        plain.stop()


# ------------------------------------------------------------------ SmolLM2-135M-Instruct


SMOLLM2_QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
                     "Write one sentence about the sea.", "What is 12 times 12?"]


@pytest.fixture(scope="module")
def smollm2():
    from model_store.build_smollm2 import build

    return build(REPO / "models")


def smollm2_answers(checkpoint, quantization: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model_path=str(checkpoint), quantization=quantization, speculative="off",
                                 max_device_adapters=0)).start()
    try:
        return [list(finished(run(engine, GenerationRequest(
            messages=(), sampling=SamplingParams(max_tokens=max_new), stream=EventStream(), token_ids=ids))).token_ids)
            for ids in prompts]
    finally:
        engine.stop()


def agreement(answers: list[list[int]], float_answers: list[list[int]]) -> float:
    """The share of tokens before each answer's first difference from float32's."""
    before = sum(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                 for ours, theirs in zip(answers, float_answers))
    return before / sum(len(theirs) for theirs in float_answers)


def test_smollm2_quantized_equals_its_quantized_generate_and_mostly_agrees_with_float32(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [template_ids(tokenizer, [question], []) for question in SMOLLM2_QUESTIONS]
    float_answers = smollm2_answers(smollm2, "none", prompts, 32)
    # floors well under what ran here (int8 78%, int4 17%): a broken kernel diverges at the first tokens
    for method, floor in (("int8", 0.3), ("int4", 0.05)):
        answers = smollm2_answers(smollm2, method, prompts, 32)
        reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
        report = quantize_language_model(reference, list(reference.model.layers), method, CPU)
        assert report.num_linears == 210 and report.num_float == 0
        assert answers[0] == generate(reference, prompts[0], 32)  # exact: the same quantized weights
        share = agreement(answers, float_answers)
        print(f"SmolLM2 {method}: {100 * share:.0f}% of tokens before the first difference from float32 "
              f"({len(prompts)} prompts x 32)")
        assert share >= floor


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_activations_equal_the_same_kernels_generate(tiny_model_path, method):
    """RESIDENT_ACTIVATIONS=int8: the linears multiply rows quantized to int8 (session/model/cpu/csrc/
    linear_q8.h), in the C++ decode step, token for token what transformers' forward gives over them."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    prompt = AutoTokenizer.from_pretrained(tiny_model_path)(ECHO[0])["input_ids"]
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), quantization=method, activations="int8",
                                 speculative="off", max_device_adapters=0)).start()
    try:
        runner = engine.parts.runner
        assert "resident::linear_q8" in runner.quantization.kernel and runner.quantization.head
        assert all(layer.self_attn.q_proj.int8_rows for layer in runner.layers) and runner.lm_head.int8_rows
        assert runner.path.stack is not None and runner.path.stack.head
        got = list(finished(run(engine, GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=16),
                                                          stream=EventStream(), token_ids=prompt))).token_ids)
    finally:
        engine.stop()
    reference = LlavaForConditionalGeneration.from_pretrained(tiny_model_path).eval()
    report = quantize_language_model(reference, list(reference.model.language_model.layers), method, CPU,
                                     int8_rows=True)
    assert report.num_linears == 14 and report.head and reference.lm_head.int8_rows
    assert len(got) == 16 and got == generate(reference, prompt, 16)
