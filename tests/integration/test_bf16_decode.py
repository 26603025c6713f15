"""bfloat16 decoding on CPU through our kernels (session/model/cpu/attention.py, session/model/cpu/linear.py), one
attention call per layer for the batch, against transformers' own bfloat16 forward on every text family:
grouped-query heads (Qwen2, Qwen3), Mistral's 16-key sliding window crossed, sessions whose blocks
interleave in the pool. And a multi-token extend (speculative verification) as its decode steps, bit for
bit, so bfloat16 speculation answers what plain decoding answers.

On a CPU with AMX (``AMX``) torch's bfloat16 products take AMX tiles, another order of additions than
ours reproduce: there transformers' logits are matched to rounding (``assert_same_logits``), and each
row of a batch bit for bit as our step decodes it alone; our paths against each other stay bit for bit."""

from __future__ import annotations

import pytest
import torch

from model_store import train_deep_pair
from model_store.build_text_models import FAMILIES, ensure
from model_store.train_pair import PAIR_DIR, eval_prompts
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream, Finished
from session.model.cpu import attention as cpu_attention, fused_layer
from session.model.cpu.kernels import bf16_products_use_amx
from session.model.runner import ModelRunner, cpu_has_bf16
from session.speculative.decoder import SpeculativeDecoder
from session.types import SamplingParams
from tests.integration.test_speculative_batch import batched_greedy, random_rows
from tests.integration.test_speculative_decode import new_kv, plain_answer

pytestmark = pytest.mark.skipif(not (cpu_has_bf16() and cpu_attention.load()),
                                reason="needs AVX512-BF16 and the kernel built (a C++ compiler)")

STEPS = 24  # crosses a 16-token block boundary: the three sessions' new blocks interleave in the pool
AMX = bf16_products_use_amx()  # torch's bfloat16 linears and SDPA take AMX tiles here: their bits are out of reach


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Steps' logits [S, V] against transformers': bit for bit. With AMX, to rounding: every logit within
    2^-6 of its step's largest, and in at least half of the steps at most 1 logit in 100 differing.
    Measured here: under 2^-7, and the differences in a few steps (a rounding that flipped a hidden value
    moves up to 2 in 3 of that step's logits); a missed key or a position off by one moved 70-98% of
    every step's logits (a missed key by 4-17% of the largest), a scale 1% off over 60%."""
    if not AMX:
        assert torch.equal(ours, theirs)
        return
    diff = (ours - theirs).abs() / theirs.abs().amax(-1, keepdim=True)
    assert diff.max() <= 2 ** -6, f"a logit {float(diff.max()):.4f} of its step's largest away"
    differing = (ours != theirs).float().mean(-1)  # per step
    assert (differing <= 0.01).float().mean() >= 0.5, f"steps' fractions of logits differing: {differing.tolist()}"


def ours(runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """Sessions prefilled, then STEPS decode steps together fed ``tokens`` -> logits [STEPS, B, V]."""
    kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=512) for _ in prompts]
    for kv, prompt in zip(kvs, prompts):
        runner.prefill(kv, runner.embed(prompt, []))
    steps = [runner.decode(kvs, column) for column in tokens]
    assert any(kv.block_ids[-1] != kv.block_ids[-2] + 1 for kv in kvs)  # blocks no longer consecutive
    for kv in kvs:
        kv.release()
    return torch.stack(steps)


def transformers_steps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' own bfloat16 forward, one token at a time over its cache (what generate does)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, cache = [], out.past_key_values
        for token in tokens:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
            cache = out.past_key_values
    return torch.stack(logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_pooled_decode_follows_transformers(family, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = ensure([family])[family]
    runner = ModelRunner(str(path), device="cpu", dtype="bfloat16")
    assert runner.pooled_decode
    calls = []
    kernel = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(a[0].shape) or kernel(*a))
    prompts = [list(range(3, 40 + 7 * i)) for i in range(3)]
    tokens = torch.randint(5, runner.info.vocab_size, (STEPS, 3), generator=torch.Generator().manual_seed(0)).tolist()
    logits = ours(runner, prompts, tokens)
    # one kernel call per layer and step, for all three rows
    assert calls == [(3, runner.info.num_heads, runner.info.head_dim)] * (STEPS * runner.info.num_layers)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for row, prompt in enumerate(prompts):
        theirs = transformers_steps(reference, prompt, [step[row] for step in tokens])
        assert_same_logits(logits[:, row], theirs)  # bit for bit: each row of the batch as if decoded alone
    if AMX:  # each row of the batch as our step decodes it alone, bit for bit
        for row, prompt in enumerate(prompts):
            kv = runner.new_kv_cache(block_tokens=16, max_tokens=512)
            runner.prefill(kv, runner.embed(prompt, []))
            alone = torch.stack([runner.decode([kv], [step[row]])[0] for step in tokens])
            kv.release()
            assert torch.equal(logits[:, row], alone)


def test_kernels_off_keep_torch_kernel_and_a_float32_pool_takes_ours(tiny_model_path):
    """RESIDENT_CPU_KERNELS=0 keeps torch's attention; a float32 pool (a float32 model, or bfloat16
    weights with RESIDENT_KV_DTYPE=float32) takes our float32 attention, the latter without the C++
    layer (its activations change dtype at the attention)."""
    assert not ModelRunner(str(tiny_model_path), device="cpu", dtype="bfloat16", cpu_kernels=False).pooled_decode
    assert ModelRunner(str(tiny_model_path), device="cpu", dtype="float32").pooled_decode
    mixed = ModelRunner(str(tiny_model_path), device="cpu", dtype="bfloat16", kv_dtype="float32")
    assert mixed.pooled_decode and mixed.path.fused is None


def test_engine_answers_equal_transformers_bfloat16_generate():
    """Three requests decoding together in a bfloat16 engine (our kernel, one call per layer for the
    batch) answer token for token what transformers' own bfloat16 ``generate`` answers alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure(["llama"])["llama"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in ("def fibonacci(n):", "import os\nimport sys\n",
                                                         "class Parser:\n    def __init__(self")]
    engine = Engine(EngineConfig(model_path=str(path), dtype="bfloat16", speculative="off", max_device_adapters=0,
                                 max_batch_size=4)).start()
    try:
        assert engine.parts.runner.pooled_decode
        requests = [GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=24), stream=EventStream(),
                                      token_ids=ids) for ids in prompts]
        for request in requests:  # all queued before any is read: they decode in one batch
            engine.submit(request)
        answers = []
        for request in requests:
            while not isinstance(event := request.stream.get(timeout=120), Finished):
                assert not hasattr(event, "error"), event
            answers.append(list(event.token_ids))
    finally:
        engine.stop()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for ids, answer in zip(prompts, answers):
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=len(answer), do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert len(answer) == 24 or answer[-1] in engine.parts.runner.info.eos_token_ids
        assert answer == out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def bf16_pair() -> tuple[ModelRunner, ModelRunner]:
    """The deep pair (a 24-layer target, its first 3 layers as the draft) in bfloat16."""
    target_dir, draft_dir = train_deep_pair.ensure()
    return tuple(ModelRunner(str(path), device="cpu", dtype="bfloat16") for path in (target_dir, draft_dir))


def test_extend_is_decode_steps_bit_for_bit(bf16_pair):
    """A multi-token extend (a verify: 1-5 new tokens per row, rows at different lengths, in one pass)
    gives every position the logits and keys its own decode step gives, bit for bit."""
    target = bf16_pair[0]
    assert target.linear_kernels["resident"] == target.packed_linears  # the pair is wide enough for ours
    rows = random_rows(target, 5, seed=3)
    kvs, expected = [], []
    for cached, new in rows:
        reference = new_kv(target)
        target.prefill(reference, target.embed(cached, []))
        expected.append((torch.cat([target.decode([reference], [token]) for token in new]), reference))
        kv = new_kv(target)
        target.prefill(kv, target.embed(cached, []))
        kvs.append(kv)
    logits = target.extend(kvs, [new for _, new in rows])
    assert logits.shape[:2] == (5, max(len(new) for _, new in rows))
    for b, ((cached, new), (want, reference)) in enumerate(zip(rows, expected)):
        assert torch.equal(logits[b, : len(new)], want)
        assert logits[b, len(new):].eq(0).all()  # padding positions
        end = kvs[b].length
        assert end == reference.length == len(cached) + len(new)
        for layer in range(target.info.num_layers):
            assert torch.equal(kvs[b].keys(layer, end), reference.keys(layer, end))
            assert torch.equal(kvs[b].values(layer, end), reference.values(layer, end))


@pytest.mark.parametrize("batch", [1, 4])
def test_bfloat16_speculation_answers_what_plain_decoding_answers(bf16_pair, batch):
    """Speculative steps (rows with different k, a plain row riding along, different prompt lengths and
    budgets) emit token for token what plain bfloat16 decoding emits, with proposals accepted (so the
    verify's logits decided tokens)."""
    from transformers import AutoTokenizer

    target, draft = bf16_pair
    tokenizer = AutoTokenizer.from_pretrained(PAIR_DIR / "target")
    prompts = [[tokenizer.bos_token_id] + ids for ids in eval_prompts(tokenizer, batch, 40)]
    chosen = [prompt[: 12 + 4 * i] for i, prompt in enumerate(prompts)]
    budgets = [40 - 3 * i for i in range(batch)]
    ks = [(4, 2, 0, 6)[i] for i in range(batch)]
    decoder = SpeculativeDecoder(target, draft)
    got = batched_greedy(decoder, chosen, budgets, ks)
    for prompt, budget, answer in zip(chosen, budgets, got):
        assert answer == plain_answer(target, prompt, budget - 1)[len(prompt):]
    assert decoder.num_accepted / decoder.num_proposed > 0.15  # fixed k up to 6 proposes past its agreement


# Random models of each family, wide enough (128 wide, 2 heads of 64, one kv head) that every linear runs
# on our kernel, so the step runs the C++ layer (session/model/cpu/fused_layer.py): Qwen2's q/k/v biases, Qwen3's
# q/k norms, Mistral's 16-key window crossed.
WIDE_FAMILIES = {"llama": {}, "mistral": {"sliding_window": 16}, "qwen2": {}, "qwen3": {}}


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory) -> dict[str, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = {}
    for family, extra in WIDE_FAMILIES.items():
        config = AutoConfig.for_model(family, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=512,
                                      max_position_embeddings=512, tie_word_embeddings=False, **extra)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[family] = str(path)
    return paths


class CountedStep:
    """A DecodeStack that counts its runs."""

    def __init__(self, step):
        self.step, self.batches = step, []

    def run(self, ids, *rest):
        self.batches.append(len(ids))
        return self.step.run(ids, *rest)


@pytest.mark.parametrize("family", list(WIDE_FAMILIES))
def test_the_cpp_layer_computes_the_python_layers_bits(family, wide_models, monkeypatch):
    """Three sessions, 24 steps: the whole step in one C++ call (embedding, rotary table, layers, final
    norm, head), the layers one C++ call each, and the Python layer give the same logits as
    transformers' own bfloat16 forward, bit for bit (with AMX: the same logits as each other, bit for
    bit, and transformers' to rounding)."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(wide_models[family], device="cpu", dtype="bfloat16")
    assert runner.linear_kernels == {"resident": 7 * 2 + 1, "onednn": 0}
    if family == "qwen2":
        assert runner.layers[0].self_attn.q_proj.bias is not None
    stack = runner.path.stack
    assert stack is not None and stack.head and stack.positions == runner.info.max_positions
    stack.step = CountedStep(stack.step)
    prompts = [list(range(3, 40 + 7 * i)) for i in range(3)]
    tokens = torch.randint(5, 512, (STEPS, 3), generator=torch.Generator().manual_seed(1)).tolist()
    whole = ours(runner, prompts, tokens)
    assert stack.step.batches == [3] * STEPS  # one call a step

    layered_runner = ModelRunner(wide_models[family], device="cpu", dtype="bfloat16")  # a fresh pool: same blocks
    layered_runner.path.stack = None
    calls = []
    run = fused_layer.run
    monkeypatch.setattr(fused_layer, "run", lambda h, *rest: calls.append(h.shape) or run(h, *rest))
    layered = ours(layered_runner, prompts, tokens)
    assert calls == [(3, 128)] * (STEPS * 2)  # one call per layer and step
    python_runner = ModelRunner(wide_models[family], device="cpu", dtype="bfloat16")
    python_runner.path.fused = None  # the Python layer
    python = ours(python_runner, prompts, tokens)
    assert len(calls) == STEPS * 2 and torch.equal(whole, layered) and torch.equal(whole, python)
    reference = AutoModelForCausalLM.from_pretrained(wide_models[family], dtype=torch.bfloat16).eval()
    for row, prompt in enumerate(prompts):
        assert_same_logits(whole[:, row], transformers_steps(reference, prompt, [step[row] for step in tokens]))


def test_engine_churn_on_the_whole_step_answers_as_alone(wide_models, tmp_path):
    churn_answers_as_alone(wide_models["llama"], tmp_path, "bfloat16")


def churn_answers_as_alone(model_dir: str, tmp_path, dtype: str) -> None:
    """The engine in ``dtype`` on the one-call step, under churn: 14 requests of random prompt lengths and
    budgets arrive at random moments into a batch of at most 4 (rows join and finish mid-batch, blocks
    are recycled), three are cancelled while decoding. Every request ends with one terminal event, and
    every finished answer is token for token the one its prompt gets decoded alone (each row of a
    batch computes as if alone, bit for bit)."""
    import random
    import shutil
    import threading
    import time

    from session.engine.events import Cancelled

    path = tmp_path / "llama"  # the random model with a tokenizer (the deep pair's: ids < 512 are in it)
    shutil.copytree(model_dir, path)
    target_dir, _ = train_deep_pair.ensure()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(target_dir / name, path / name)
    path = str(path)
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype=dtype, max_batch_size=4,
                                 max_context_tokens=256)).start()
    try:
        stack = engine.parts.runner.path.stack
        assert stack is not None
        stack.step = CountedStep(stack.step)
        rng = random.Random(7)
        specs = [([1] + [rng.randrange(5, 512) for _ in range(rng.randrange(3, 60))], rng.randrange(4, 40))
                 for _ in range(14)]
        cancelled_ids = {"churn-3", "churn-7", "churn-11"}
        requests = [GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=budget),
                                      stream=EventStream(deltas=False), token_ids=prompt, request_id=f"churn-{i}")
                    for i, (prompt, budget) in enumerate(specs)]

        def submit_all():
            for request in requests:
                engine.submit(request)
                time.sleep(rng.random() * 0.02)
                if request.request_id in cancelled_ids:
                    time.sleep(0.005)
                    engine.cancel(request.request_id)

        feeder = threading.Thread(target=submit_all)
        feeder.start()
        ends = {}
        for request in requests:
            while not isinstance(event := request.stream.get(timeout=120), (Finished, Cancelled)):
                assert not hasattr(event, "error"), event
            ends[request.request_id] = event
        feeder.join(timeout=60)
    finally:
        engine.stop()
    assert len(ends) == len(requests) and max(stack.step.batches) > 1  # rows shared steps
    alone = ModelRunner(path, device="cpu", dtype=dtype)
    finished = [(spec, ends[r.request_id]) for spec, r in zip(specs, requests) if isinstance(ends[r.request_id], Finished)]
    assert len(finished) >= len(requests) - len(cancelled_ids)
    for (prompt, budget), event in finished:
        kv = alone.new_kv_cache(block_tokens=16, max_tokens=256)
        tokens = [int(alone.prefill(kv, alone.embed(prompt, [])).argmax())]
        while len(tokens) < budget and tokens[-1] not in alone.info.eos_token_ids:
            tokens.append(int(alone.decode([kv], [tokens[-1]])[0].argmax()))
        kv.release()
        assert list(event.token_ids) == tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_stacks_workspace_follows_the_batch_size(family, wide_models):
    batch_sizes_share_the_workspace(wide_models[family], "bfloat16")


def batch_sizes_share_the_workspace(model_dir: str, dtype: str) -> None:
    """One DecodeStack keeps its step's buffers across steps (csrc/decode_layer.h's Workspace): steps
    whose batches change size (3, 3, 1, 2, 2, 1, 1, ... rows) remake them, and every step's logits are those
    the layers one C++ call each compute (a fresh workspace per call), bit for bit. The logits a step
    returned stay as they were after later steps (nothing returned is the workspace's)."""
    prompts = [list(range(3, 30 + 5 * i)) for i in range(3)]
    schedule = [[0, 1, 2], [0, 1, 2], [1], [0, 2], [1, 2], [2], [0], [0, 1, 2], [1], [0, 2]] * 2
    runs = []
    for use_stack in (True, False):
        runner = ModelRunner(model_dir, device="cpu", dtype=dtype)
        stack = runner.path.stack
        assert stack is not None and stack.head
        if use_stack:
            stack.step = CountedStep(stack.step)
        else:
            runner.path.stack = None
        kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=256) for _ in prompts]
        for kv, prompt in zip(kvs, prompts):
            runner.prefill(kv, runner.embed(prompt, []))
        steps = [runner.decode([kvs[b] for b in rows], [5 + 7 * b + t for b in rows]) for t, rows in enumerate(schedule)]
        runs.append((steps, [step.clone() for step in steps]))
        if use_stack:
            assert stack.step.batches == [len(rows) for rows in schedule]
    (stacked, stacked_then), (layered, _) = runs
    assert all(torch.equal(a, b) for a, b in zip(stacked, layered))
    assert all(torch.equal(a, b) for a, b in zip(stacked, stacked_then))


def test_a_step_past_the_rotary_table_runs_the_layers(wide_models):
    """Positions past the rotary table (capped at ROPE_TABLE_POSITIONS) run the layers one call each,
    with the same bits as the stack up to there."""
    runner = ModelRunner(wide_models["llama"], device="cpu", dtype="bfloat16")
    stack = runner.path.stack
    stack.positions = 44  # the table's last row is position 43
    stack.step = CountedStep(stack.step)
    kv = runner.new_kv_cache(block_tokens=16, max_tokens=128)
    runner.prefill(kv, runner.embed(list(range(3, 43)), []))  # 40 tokens: steps at positions 40 .. 47
    logits = [runner.decode([kv], [7 + i]) for i in range(8)]
    assert stack.step.batches == [1] * 4
    reference_runner = ModelRunner(wide_models["llama"], device="cpu", dtype="bfloat16")
    reference_runner.path.stack = None
    kv = reference_runner.new_kv_cache(block_tokens=16, max_tokens=128)
    reference_runner.prefill(kv, reference_runner.embed(list(range(3, 43)), []))
    assert all(torch.equal(a, reference_runner.decode([kv], [7 + i])) for i, a in enumerate(logits))


def test_the_rotary_table_is_refused_where_the_module_differs():
    """A rotary module whose per-step output is not the table's rows (here: one that depends on the
    batch) gets no table, so the stack is not built; a default one gets the module's own rows."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=64)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = fused_layer.rope_table(rotary, 64, 64, torch.bfloat16)
    step_cos, step_sin = rotary(torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.tensor([[5], [63]]))
    assert torch.equal(cos[[5, 63]], step_cos[:, 0]) and torch.equal(sin[[5, 63]], step_sin[:, 0])

    class BatchDependent(LlamaRotaryEmbedding):
        def forward(self, x, position_ids):
            cos, sin = super().forward(x, position_ids)
            return cos * (1 + (position_ids.shape[0] > 1)), sin

    assert fused_layer.rope_table(BatchDependent(config), 64, 64, torch.bfloat16) is None
    rotary.rope_type = "dynamic"
    assert fused_layer.rope_table(rotary, 64, 64, torch.bfloat16) is None


def test_adapter_rows_run_in_the_cpp_step_with_the_python_layers_bits(wide_models):
    lora_rows_in_the_cpp_step(wide_models["llama"], "bfloat16")


def lora_rows_in_the_cpp_step(model_dir: str, dtype: str) -> None:
    """Steps with LoRA rows run the one-call step with the deltas added in C++ by LoRALinear's own ATen
    calls: one adapter for every row, a mix of two adapters and the base, and the base alone give the
    Python layer's logits bit for bit, as does the per-layer C++ call (and the adapters change them)."""
    from session.model.lora import TARGETS
    from tests.conftest import random_adapter

    def adapter(seed: int, rank: int, targets):
        return random_adapter(shapes, seed, rank, targets)

    runs = {}
    for name in ("cpp", "layered", "python"):
        runner = ModelRunner(model_dir, device="cpu", dtype=dtype)
        bank, shapes = runner.enable_lora(num_slots=2, max_rank=8)
        bank.load(1, adapter(1, 8, TARGETS))
        bank.load(2, adapter(2, 4, ("q_proj", "v_proj", "down_proj")))  # an attention-and-down adapter
        if name == "python":
            runner.path.fused = None
        elif name == "layered":
            runner.path.stack = None
        else:
            stack = runner.path.stack
            assert stack is not None
            stack.step = CountedStep(stack.step)
        kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=256) for _ in range(3)]
        for kv, start in zip(kvs, (3, 9, 20)):
            runner.prefill(kv, runner.embed(list(range(start, start + 30)), []))
        steps = [runner.decode(kvs, [5, 6, 7], adapter_slots=slots)
                 for slots in ([1, 1, 1], [1, 0, 2], [2, 1, 0], [0, 0, 0], [2, 2, 2])]
        if name == "cpp":
            assert stack.step.batches == [3] * 5  # every step one C++ call, adapter rows or not
        runs[name] = torch.stack(steps)
    assert torch.equal(runs["cpp"], runs["python"]) and torch.equal(runs["layered"], runs["python"])
    assert not torch.equal(runs["cpp"][0], runs["cpp"][3])  # the adapters change the logits


def test_our_rms_norm_is_transformers_bits_at_many_widths():
    """The written-out RMSNorm (ATen's float sum order, at the lane width found at load) equals
    transformers' LlamaRMSNorm on rows of every width a model may have, odd ones and 2^20 included
    (the cascade's levels), over four decades of scale; the other lane width does not."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert fused_layer.load()
    with torch.inference_mode():
        lanes = fused_layer.sum_lanes({64, 128, 512, 4096})
        assert lanes in fused_layer.SUM_LANES
        generator = torch.Generator().manual_seed(4)
        for width, rows in ((64, 512), (100, 512), (1000, 256), (4096, 64), (5120, 64), (2 ** 20, 2)):
            norm = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
            norm.weight.copy_(torch.randn(width, generator=generator))
            scales = torch.exp2(torch.randint(-6, 6, (rows, 1), generator=generator).float())
            x = (torch.randn(rows, width, generator=generator) * scales).to(torch.bfloat16)
            assert torch.equal(torch.ops.resident.rms_norm_bf16(x, norm.weight, 1e-5, lanes), norm(x)), width
        other = 24 - lanes
        norm = LlamaRMSNorm(512, eps=1e-5).to(torch.bfloat16)
        x = torch.randn(512, 512, generator=generator).to(torch.bfloat16)
        assert not torch.equal(torch.ops.resident.rms_norm_bf16(x, norm.weight, 1e-5, other), norm(x))


def test_our_rotary_embedding_is_transformers_bits():
    """The written-out rotary embedding equals transformers' apply_rotary_pos_emb (each product and the
    sum rounded to bfloat16), for head dims 64 and 128 and several rows and heads; a bad shape is refused."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    assert fused_layer.load()
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for batch, heads, dim in ((1, 8, 64), (5, 3, 128), (16, 2, 64)):
            x = (torch.randn(batch, heads, dim, generator=generator) * 8).to(torch.bfloat16)
            cos, sin = (torch.randn(batch, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
            theirs, _ = apply_rotary_pos_emb(x[:, :, None], x[:, :, None], cos[:, None], sin[:, None])
            assert torch.equal(torch.ops.resident.rotary_bf16(x, cos, sin), theirs[:, :, 0])
        with pytest.raises(RuntimeError, match="rotary: x"):
            torch.ops.resident.rotary_bf16(x, cos[:1], sin[:1])
