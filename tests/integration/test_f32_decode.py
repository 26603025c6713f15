"""float32 decoding on CPU through our kernels: the float32 linear kernel (oneDNN's bits), our float32
decode attention, and the decode layer and whole step in C++ (session/model/cpu/fused_layer.py, csrc/decode_layer.h),
on every text family wide enough that each linear is one oneDNN would take (float32 weights of 256 KiB
and up; smaller ones keep MKL's product, transformers' own bits).

The C++ step computes the Python layer's bits (same kernels, ATen's arithmetic written out); against
transformers' float32 forward it differs by rounding only (the linears are oneDNN's, not MKL's; our
attention adds in its own order), so greedy tokens are compared exactly and logits to rounding."""

from __future__ import annotations

import pytest
import torch

from session.model.cpu import attention as cpu_attention, fused_layer, linear as cpu_linear
from session.model.runner import ModelRunner
from tests.integration.test_bf16_decode import (
    STEPS,
    CountedStep,
    batch_sizes_share_the_workspace,
    churn_answers_as_alone,
    lora_rows_in_the_cpp_step,
    ours,
    transformers_steps,
)

pytestmark = pytest.mark.skipif(not (fused_layer.load(torch.float32) and cpu_attention.load()),
                                reason="needs AVX-512 and the kernels built (a C++ compiler)")

# Random models of each family, 512 wide (8 query heads of 64, 2 kv heads: k and v are 128 x 512, 256
# KiB in float32), 2 layers: Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's 16-key window crossed.
WIDE_FAMILIES = {"llama": {}, "mistral": {"sliding_window": 16}, "qwen2": {}, "qwen3": {}}
VOCAB = 512


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory) -> dict[str, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = {}
    for family, extra in WIDE_FAMILIES.items():
        config = AutoConfig.for_model(family, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
                                      max_position_embeddings=512, tie_word_embeddings=False, **extra)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"{family}-f32")
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[family] = str(path)
    return paths


@pytest.mark.parametrize("family", list(WIDE_FAMILIES))
def test_the_cpp_step_computes_the_python_layers_bits_and_transformers_tokens(family, wide_models, monkeypatch):
    """Three sessions, 24 steps: the whole step in one C++ call, the layers one C++ call each, and the
    Python layer give the same logits bit for bit; transformers' float32 forward gives them to rounding,
    with the same greedy token at every step."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(wide_models[family], device="cpu", dtype="float32")
    assert runner.linear_kernels == {"resident": 7 * 2 + 1, "onednn": 0} and runner.pooled_decode
    stack = runner.path.stack
    assert stack is not None and stack.head and type(stack.step).__name__ != "Stack"
    stack.step = CountedStep(stack.step)
    prompts = [list(range(3, 40 + 7 * i)) for i in range(3)]
    tokens = torch.randint(5, VOCAB, (STEPS, 3), generator=torch.Generator().manual_seed(1)).tolist()
    whole = ours(runner, prompts, tokens)
    assert stack.step.batches == [3] * STEPS  # one call a step
    assert whole.dtype == torch.float32

    layered_runner = ModelRunner(wide_models[family], device="cpu", dtype="float32")
    layered_runner.path.stack = None
    calls = []
    run = fused_layer.run
    monkeypatch.setattr(fused_layer, "run", lambda h, *rest: calls.append((h.shape, h.dtype)) or run(h, *rest))
    layered = ours(layered_runner, prompts, tokens)
    assert calls == [((3, 512), torch.float32)] * (STEPS * 2)  # one call per layer and step
    python_runner = ModelRunner(wide_models[family], device="cpu", dtype="float32")
    python_runner.path.fused = None  # the Python layer (our linears and attention from Python)
    python = ours(python_runner, prompts, tokens)
    assert torch.equal(whole, layered) and torch.equal(whole, python)

    reference = AutoModelForCausalLM.from_pretrained(wide_models[family], dtype=torch.float32).eval()
    for row, prompt in enumerate(prompts):
        theirs = transformers_steps(reference, prompt, [step[row] for step in tokens])
        torch.testing.assert_close(whole[:, row], theirs, atol=1e-4, rtol=1e-4)
        assert whole[:, row].argmax(-1).tolist() == theirs.argmax(-1).tolist()


def test_extend_is_its_decode_steps_bit_for_bit(wide_models):
    """A multi-token extend (a speculative verify) in float32 runs as its decode steps: every position's
    logits and keys are what decoding the tokens one by one gives, bit for bit, so float32 speculation
    accepts exactly what plain decoding emits."""
    prompts = [list(range(3, 30)), list(range(7, 61))]
    new = [[11, 12, 13, 14], [21, 22]]
    stepped, extended = [], []
    for kind, out in (("steps", stepped), ("extend", extended)):
        # a fresh pool each: the prompts' blocks lie alike (a prefill's bits follow where its blocks lie)
        runner = ModelRunner(wide_models["llama"], device="cpu", dtype="float32")
        kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=256) for _ in prompts]
        for kv, prompt in zip(kvs, prompts):
            runner.prefill(kv, runner.embed(prompt, []))
        if kind == "steps":
            for kv, row in zip(kvs, new):
                out.append(torch.stack([runner.decode([kv], [token])[0] for token in row]))
        else:
            logits = runner.extend(kvs, new)
            out.extend(logits[b, :len(row)] for b, row in enumerate(new))
        out.append([kv.keys(1, kv.length).clone() for kv in kvs])
    for b in range(len(new)):
        assert torch.equal(stepped[b], extended[b])
    assert all(torch.equal(a, b) for a, b in zip(stepped[-1], extended[-1]))


def test_the_stack_under_engine_churn_answers_as_alone(wide_models, tmp_path):
    """14 requests arriving at random into a float32 batch of 4 (three cancelled): each row of the C++
    step computes as if alone, so every finished answer is its prompt's answer decoded alone."""
    churn_answers_as_alone(wide_models["llama"], tmp_path, "float32")


def test_adapter_rows_run_in_the_cpp_step_with_the_python_layers_bits(wide_models):
    lora_rows_in_the_cpp_step(wide_models["llama"], "float32")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_stacks_workspace_follows_the_batch_size(family, wide_models):
    batch_sizes_share_the_workspace(wide_models[family], "float32")


def test_small_float32_weights_keep_mkls_product():
    """float32 weights under 256 KiB run MKL's product (transformers' own bits; oneDNN would not take
    them either): not ours, and a model with any such linear runs the Python layer."""
    from torch import nn

    small, large = nn.Linear(128, 128, bias=False), nn.Linear(512, 512, bias=False)
    assert cpu_linear.pack_linears([nn.Sequential(small, large)], torch.float32) == (1, "")
    assert type(small) is nn.Linear and type(large) is cpu_linear.KernelLinear


def test_our_float32_norm_and_rotary_are_transformers_bits():
    """The written-out RMSNorm (ATen's float sum order) and rotary embedding equal transformers'
    LlamaRMSNorm and apply_rotary_pos_emb in float32, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    op = fused_layer.op
    generator = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        lanes = fused_layer.sum_lanes({64, 512}, torch.float32)
        assert lanes in fused_layer.SUM_LANES
        for width, rows in ((64, 512), (100, 256), (1000, 64), (5120, 32)):
            norm = LlamaRMSNorm(width, eps=1e-5)
            norm.weight.copy_(torch.randn(width, generator=generator))
            x = torch.randn(rows, width, generator=generator) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=generator).float())
            assert torch.equal(op("rms_norm", torch.float32)(x, norm.weight, 1e-5, lanes), norm(x)), width
        for batch, heads, dim in ((1, 8, 64), (5, 3, 128)):
            x = torch.randn(batch, heads, dim, generator=generator) * 8
            cos, sin = (torch.randn(batch, dim, generator=generator) for _ in range(2))
            theirs, _ = apply_rotary_pos_emb(x[:, :, None], x[:, :, None], cos[:, None], sin[:, None])
            assert torch.equal(op("rotary", torch.float32)(x, cos, sin), theirs[:, :, 0])
