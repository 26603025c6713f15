"""Speculation batched across sequences, on real weights (float32, CPU).

Runner level: ``ModelRunner.extend`` (one pass, several rows, several new tokens each, at different
cache lengths) gives the logits and caches that one ``prefill`` per row gives, also in sliding-window
layers. Decoder level: batched speculative steps (rows with different k, plain rows riding along,
different prompt lengths and budgets) emit token for token what plain greedy decoding emits, on both
trained pairs (the 8-layer target with its distilled 1-layer draft; the 24-layer target with its
own first 3 layers as the draft)."""

from __future__ import annotations

import pytest
import torch

from model_store import train_deep_pair
from model_store.train_pair import PAIR_DIR, eval_prompts
from session.model.runner import ModelRunner
from session.speculative.decoder import SpecRow, SpeculativeDecoder
from tests.integration.test_speculative_decode import new_kv, plain_answer, prefill

NUM_NEW = 40


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def load(path) -> ModelRunner:
    return ModelRunner(str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=["pair", "deep-pair"])
def pair(request) -> tuple[ModelRunner, ModelRunner]:
    if request.param == "pair":
        return load(PAIR_DIR / "target"), load(PAIR_DIR / "draft")
    target_dir, draft_dir = train_deep_pair.ensure()
    return load(target_dir), load(draft_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR_DIR / "target")
    return [[tokenizer.bos_token_id] + ids for ids in eval_prompts(tokenizer, 8, 40)]


def random_rows(runner: ModelRunner, batch: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(cached prefix, new tokens) per row: prefixes of 1..60 tokens, 1..5 new tokens (verify-shaped)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        num_cached = int(torch.randint(1, 61, (1,), generator=generator))
        num_new = int(torch.randint(1, 6, (1,), generator=generator))
        ids = torch.randint(3, runner.info.vocab_size, (num_cached + num_new,), generator=generator).tolist()
        rows.append((ids[:num_cached], ids[num_cached:]))
    return rows


def check_extend_equals_prefill(runner: ModelRunner, batch: int, seed: int, attention: str) -> None:
    runner.decode_attention = attention  # both of decode's attention paths: batched over the pool, per row
    rows = random_rows(runner, batch, seed)
    expected, kvs = [], []
    for cached, new in rows:
        reference = new_kv(runner)
        runner.prefill(reference, runner.embed(cached, []))
        expected.append((runner.prefill(reference, runner.embed(new, []), all_logits=True), reference))
        kv = new_kv(runner)
        runner.prefill(kv, runner.embed(cached, []))
        kvs.append(kv)
    logits = runner.extend(kvs, [new for _, new in rows])  # [B, T, V]
    assert logits.shape == (batch, max(len(new) for _, new in rows), runner.info.vocab_size)
    for b, ((cached, new), (want, reference)) in enumerate(zip(rows, expected)):
        got = logits[b, :len(new)]
        # per row on CPU the extend runs as decode steps (our attention kernel, one-row sums;
        # tests/integration/test_f32_decode.py: their bits exactly): the prefill's to float32 rounding,
        # which the deep pair's 24 layers carry to ~5e-4 on logits of ~12
        loose = runner.pooled_decode and attention == "per_row"
        torch.testing.assert_close(got, want, atol=1e-3 if loose else 1e-4, rtol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert kvs[b].length == len(cached) + len(new)
        end = kvs[b].length
        for layer in range(runner.info.num_layers):
            for mine, theirs in ((kvs[b].keys(layer, end), reference.keys(layer, end)),
                                 (kvs[b].values(layer, end), reference.values(layer, end))):
                torch.testing.assert_close(mine, theirs, atol=1e-3 if loose else 1e-5, rtol=1e-4 if loose else 1e-5)


@pytest.mark.parametrize("attention", ["per_row", "batched"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_multi_row_extend_equals_one_prefill_per_row(pair, batch, attention):
    check_extend_equals_prefill(pair[0], batch, seed=batch, attention=attention)


@pytest.mark.parametrize("attention", ["per_row", "batched"])
@pytest.mark.parametrize("batch", [3, 8])
def test_multi_row_extend_respects_sliding_windows(batch, attention):
    """Mistral demo: every layer a 16-key window; the prefixes (up to 60 tokens) cross it."""
    from model_store.build_text_models import ensure

    runner = load(ensure(("mistral",))["mistral"])
    assert set(runner.windows) == {16}
    check_extend_equals_prefill(runner, batch, seed=100 + batch, attention=attention)


def batched_greedy(decoder: SpeculativeDecoder, prompts: list[list[int]], budgets: list[int],
                   ks: list[int]) -> list[list[int]]:
    """Decode every prompt to its budget with batched steps over the sequences still running: row i
    proposes ks[i] tokens per step (0: a plain row in the same pass). Returns the new tokens."""
    target, draft = decoder.target, decoder.draft
    rows = []
    for prompt, k in zip(prompts, ks):
        target_kv = new_kv(target)
        ids = prefill(target, target_kv, prompt)
        draft_kv = None if draft is None else new_kv(draft)
        decoder.sync_draft(ids, draft_kv)
        rows.append(SpecRow(ids, target_kv, draft_kv, k))
    while running := [(i, row) for i, row in enumerate(rows) if len(row.token_ids) - len(prompts[i]) < budgets[i]]:
        for i, row in running:
            row.max_new = budgets[i] - (len(row.token_ids) - len(prompts[i]))
        results = decoder.step_batch([row for _, row in running])
        for (_, row), result in zip(running, results):
            row.token_ids += result.token_ids
            assert row.target_kv.length == len(row.token_ids) - 1
    return [row.token_ids[len(prompt):] for row, prompt in zip(rows, prompts)]


@pytest.mark.parametrize("attention", ["per_row", "batched"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("use_draft", [True, False])
def test_batched_speculative_steps_equal_plain(pair, prompts, batch, use_draft, attention):
    target, draft = pair
    target.decode_attention = draft.decode_attention = attention  # plain decoding and verification alike
    decoder = SpeculativeDecoder(target, draft if use_draft else None)
    chosen = [prompts[i][:12 + 4 * i] for i in range(batch)]  # different lengths
    budgets = [NUM_NEW - 3 * i for i in range(batch)]  # rows finish at different steps
    ks = [(1, 4, 0, 2, 6, 3, 0, 5)[i] for i in range(batch)]  # different k; zeros ride along plainly
    got = batched_greedy(decoder, chosen, budgets, ks)
    for prompt, budget, answer in zip(chosen, budgets, got):
        assert answer == plain_answer(target, prompt, budget - 1)[len(prompt):]
    if use_draft and batch == 8:  # the draft is worth running (fixed k up to 6 proposes past its agreement)
        assert decoder.num_accepted / decoder.num_proposed > 0.3
