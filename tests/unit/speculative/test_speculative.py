"""session/speculative/decoder.py: accept/reject maths, prompt lookup, adaptive k, compatibility, and the
decoder's cache bookkeeping over fake runners (exact, instant models whose caches record token ids)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from benchmarks import spec_drivers
from session.errors import ConfigError
from session.model.kv_cache import KVCache, KVPool
from session.model.sampling import sample_one, warp_probs
from session.speculative.acceptance import greedy_accept, propose_ngram, sampling_accept
from session.speculative.controller import SpeculationController, StepCosts, batch_should_speculate
from session.speculative.decoder import (
    CATCH_UP_IN_STEP,
    SpecRow,
    SpeculativeDecoder,
    check_compatible,
    check_runners_compatible,
)
from session.types import SamplingParams

V = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads; on a busy 2-core machine each parallel region can wait a
    scheduler quantum (softmax over 5 values took 4 ms), which made the statistical tests crawl."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

CHI2_999 = {3: 16.27, 4: 18.47}  # chi-square critical values at p = 0.001 by degrees of freedom


def logits_for(tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[len(tokens), V] logits whose row argmaxes are ``tokens``."""
    logits = torch.randn(len(tokens), vocab, generator=torch.Generator().manual_seed(len(tokens))) * 0.1
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


# ---------------------------------------------------------------- greedy_accept


@pytest.mark.parametrize("draft, target, emitted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted, plus the bonus token
    ([1, 2, 3], [7, 2, 3, 4], [7]),  # first rejected: the target's own token only
    ([1, 2, 3], [1, 9, 3, 4], [1, 9]),  # a later agreement after a rejection does not count
    ([1, 2, 3], [1, 2, 8, 4], [1, 2, 8]),
    ([], [5], [5]),  # nothing proposed: a plain step
])
def test_greedy_accept_cases(draft, target, emitted):
    assert greedy_accept(draft, logits_for(target)) == emitted


def test_greedy_accept_equals_target_only_greedy_on_random_cases():
    """Emitted tokens are always a prefix of what the target alone picks at each position."""
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randrange(0, 6)
        target = [rng.randrange(3) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.7 else rng.randrange(3) for t in target[:k]]
        emitted = greedy_accept(draft, logits_for(target, vocab=3))
        m = len(emitted) - 1
        assert emitted == target[: m + 1] and draft[:m] == target[:m]
        assert m == k or draft[m] != target[m]


def test_greedy_accept_breaks_ties_like_plain_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]])
    assert greedy_accept([2], logits) == [1]  # argmax takes the first maximum, as sample_rows does


# ---------------------------------------------------------------- propose_ngram


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    context = [5, 1, 6, 9, 5, 1, 7, 8, 5, 1]
    assert propose_ngram(context, k=3, max_ngram=2) == [7, 8, 5]


def test_ngram_prefers_the_longest_matching_tail():
    context = [1, 2, 3, 4, 5, 9, 3, 7, 1, 2, 3]
    assert propose_ngram(context, k=2, max_ngram=3) == [4, 5]  # the 3-gram, not the later 1-gram "3"
    assert propose_ngram(context, k=2, max_ngram=1) == [7, 1]


def test_ngram_stops_at_the_end_of_the_context():
    assert propose_ngram([4, 8, 4], k=5) == [8, 4]


def test_ngram_without_a_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], k=4) == []
    assert propose_ngram([1, 2, 3, 1], k=0) == []
    assert propose_ngram([7], k=3) == []
    assert propose_ngram([], k=3) == []


def test_ngram_respects_min_ngram():
    context = [1, 2, 9, 3, 2]
    assert propose_ngram(context, k=2, max_ngram=3, min_ngram=1) == [9, 3]
    assert propose_ngram(context, k=2, max_ngram=3, min_ngram=2) == []


def test_ngram_never_matches_the_tail_with_itself():
    assert propose_ngram([3, 3], k=2) == [3]  # the earlier "3" is followed by the final "3"
    assert propose_ngram([1, 2, 3], k=2, max_ngram=3) == []


# ---------------------------------------------------------------- controller


def test_controller_first_measures_a_plain_step():
    controller = SpeculationController(k_max=6, k=3)
    assert not controller.should_speculate()
    controller.observe_plain(0.010)
    assert controller.should_speculate()  # draft cost unknown yet: try it


def test_controller_estimates_acceptance_from_geometric_trials():
    controller = SpeculationController(k_max=8, k=4, smoothing=1.0)
    controller.observe_plain(0.010)
    controller.observe(num_proposed=4, num_accepted=2, draft_s=0.004, verify_s=0.012)
    # two successes, then one failure; the fourth proposal was never tested
    assert controller.acceptance == pytest.approx(2 / 3)
    controller.observe(num_proposed=4, num_accepted=4, draft_s=0.004, verify_s=0.012)
    assert controller.acceptance == 1.0  # four successes, no failure
    assert controller.expected_tokens(3) == 4.0


def test_an_untimed_step_counts_its_acceptance_not_its_costs():
    """A verify that also fed prompt chunks (``timed=False``): acceptance, k and the probe counter move as
    for any speculative step; the batch's costs and this row's delivered rate do not."""
    controller = SpeculationController(k_max=8, k=4, smoothing=1.0)
    controller.observe_plain(0.010)
    controller.observe_plain(0.010)
    controller.observe(num_proposed=4, num_accepted=4, draft_s=0.004, verify_s=0.012)
    def recorded():  # copies of what the costs and the delivered rate hold
        return ({size: list(recent) for size, recent in controller.costs._draft.items()},
                {size: list(recent) for size, recent in controller.costs._verify_extra.items()},
                dict(controller.delivered))

    before = recorded()
    controller.observe(num_proposed=4, num_accepted=1, draft_s=0.004, verify_s=0.5, timed=False)
    assert controller.acceptance == pytest.approx(1 / 2)  # one success, then a failure
    assert recorded() == before and before[0]  # costs were recorded before, none added
    assert controller.num_plain_since_probe == 0
    controller.observe(num_proposed=0, num_accepted=0, draft_s=0.0, verify_s=0.5, timed=False)
    assert controller.num_plain_since_probe == 1 and controller.plain_step_s == pytest.approx(0.010)


def test_controller_expected_speedup_formula():
    controller = SpeculationController(k_max=8, k=2, smoothing=1.0, prior_acceptance=0.5)
    controller.observe_plain(0.010)
    controller.observe(num_proposed=2, num_accepted=1, draft_s=0.002, verify_s=0.012)  # r + rho = 0.2
    assert controller.expected_tokens(2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert controller.expected_speedup(2) == pytest.approx(1.75 / 1.4)


def test_controller_grows_k_while_everything_is_accepted_and_the_draft_is_cheap():
    controller = SpeculationController(k_max=8, k=2)
    controller.observe_plain(0.010)
    for _ in range(20):
        controller.observe(controller.k, controller.k, draft_s=0.0002 * controller.k, verify_s=0.011)
    assert controller.k == 8 and controller.should_speculate()


def test_controller_shrinks_k_and_falls_back_when_speculation_does_not_pay_then_probes():
    controller = SpeculationController(k_max=8, k=6, probe_interval=4)
    controller.observe_plain(0.010)
    for _ in range(20):  # nothing accepted, drafting costs half a target step
        controller.observe(controller.k, 0, draft_s=0.005 * controller.k, verify_s=0.012)
    assert controller.k == 1
    assert not controller.should_speculate()
    for _ in range(3):
        controller.observe_plain(0.010)
        assert not controller.should_speculate()
    controller.observe_plain(0.010)
    assert controller.should_speculate()  # a probe after probe_interval plain steps
    controller.observe(1, 0, draft_s=0.005, verify_s=0.012)
    assert not controller.should_speculate()


def test_failed_probes_back_off_and_one_that_pays_resets():
    """Where speculation does not pay, each failed try doubles the plain steps before the next (4, 8, 16,
    32, then capped at 4 x max_probe_backoff); a try that pays brings the wait back to its base (at most
    probe_interval; fewer as the try got cheaper)."""
    controller = SpeculationController(k_max=4, k=1, probe_interval=4, max_probe_backoff=8, smoothing=1.0)
    controller.observe_plain(0.010)
    controller.observe(1, 0, draft_s=0.005, verify_s=0.012)  # S(1) = 1 / 1.7: plain from here

    def plain_steps_to_next_probe() -> int:
        steps = 0
        while not controller.should_speculate():
            controller.observe_plain(0.010)
            steps += 1
        return steps

    gaps = []
    for _ in range(5):
        gaps.append(plain_steps_to_next_probe())
        controller.observe(1, 0, draft_s=0.005, verify_s=0.012)  # the try fails
    assert gaps == [4, 8, 16, 32, 32] and controller.probe_backoff == 8
    plain_steps_to_next_probe()
    for _ in range(controller.min_delivered_steps):  # tries that pay: everything accepted, cheap passes
        controller.observe(1, 1, draft_s=0.0005, verify_s=0.0105)
    assert controller.probe_backoff == 1 and controller.should_speculate()
    controller.observe(1, 0, draft_s=0.005, verify_s=0.030)
    controller.observe(1, 0, draft_s=0.005, verify_s=0.030)
    assert controller.probe_backoff == 1  # those were no tries after plain steps
    assert not controller.should_speculate() and plain_steps_to_next_probe() <= 4


def test_a_draft_far_behind_catches_up_before_the_timed_step():
    """After plain steps the draft lacks many tokens: they are prefilled first (counted as synced, not in
    the step's draft_s), and the step's first draft pass feeds only the last token."""
    clock = iter(range(1000))
    target, draft = FakeRunner(V), FakeRunner(V)
    decoder = SpeculativeDecoder(target, draft, clock=lambda: float(next(clock)))
    ids, target_kv, draft_kv = start(decoder, [1, 2, 3])
    decoder.sync_draft(ids, draft_kv)
    for _ in range(6):  # plain steps: the target moves on, the draft does not
        ids.append(int(spec_drivers.plain_step(decoder, ids, target_kv).argmax()))
    lag = len(ids) - 1 - draft_kv.length
    assert lag == 6 > CATCH_UP_IN_STEP
    fed_before = draft.num_fed_tokens
    result = spec_drivers.step(decoder, ids, target_kv, draft_kv, 2)
    assert decoder.num_draft_synced_tokens == 3 + lag  # the prompt's sync, then the catch-up
    assert draft.num_fed_tokens - fed_before == lag + 1 + 1  # catch-up, the last token, one more proposal
    assert result.draft_s == 1.0  # one clock tick: the catch-up ran before the step's clock started
    ids.extend(result.token_ids)
    assert cached_ids(target_kv) == ids[:-1]


@pytest.mark.parametrize("draft_s, plain_steps_to_probe", [(0.001, 1), (0.006, 3), (0.050, 6)])
def test_controller_probes_sooner_when_a_failed_try_is_cheap(draft_s, plain_steps_to_probe):
    """A failed try costs r (+ rho) of a plain step: tries come every ceil(r / probe_cost) plain steps, at most
    probe_interval apart (r = 0.1 -> 1, 0.6 -> 3, 5.0 -> capped at 6)."""
    controller = SpeculationController(k_max=4, k=1, probe_cost=0.25, probe_interval=6, smoothing=1.0)
    controller.observe_plain(0.010)
    controller.observe(1, 0, draft_s=draft_s, verify_s=0.010)  # nothing accepted, no extra verify cost
    assert not controller.should_speculate()
    for _ in range(plain_steps_to_probe - 1):
        controller.observe_plain(0.010)
        assert not controller.should_speculate()
    controller.observe_plain(0.010)
    assert controller.should_speculate()


def test_controller_costs_ignore_one_slow_step():
    """Interference only adds time: one verify pass at 3x its cost leaves the estimate (and the decision)."""
    controller = SpeculationController(k_max=8, k=4, costs=StepCosts(window=4))
    controller.observe_plain(0.010)
    for verify_s in (0.011, 0.011, 0.033, 0.011):
        controller.observe(4, 3, draft_s=0.004, verify_s=verify_s)
        assert controller.verify_extra_s == pytest.approx(0.00025) and controller.should_speculate()
    for _ in range(4):  # the window forgets the cheap passes once it holds only dear ones
        controller.observe(4, 3, draft_s=0.004, verify_s=0.033)
    assert controller.verify_extra_s == pytest.approx(0.023 / 4)


def test_a_batch_decides_together_on_costs_shared_by_batch_size():
    costs = StepCosts()
    rows = [SpeculationController(k_max=4, k=1, costs=costs, batch_size=2) for _ in range(2)]
    assert not batch_should_speculate(rows)  # nothing measured at batch size 2: a plain step first
    costs.observe_plain(0.010, batch_size=2)
    costs.observe_speculative(num_proposed=1, draft_s=0.004, verify_s=0.010, batch_size=2)  # r = 0.4, rho = 0
    joined = SpeculationController(k_max=4, k=1, costs=costs, batch_size=2)
    assert joined.plain_step_s == 0.010  # a newcomer at a measured batch size needs no plain step of its own
    (good, bad) = rows
    good.num_successes, good.num_trials = 1.0, 1.0  # S(1) = 2 / 1.4
    bad.num_successes, bad.num_trials = 0.0, 1.0  # S(1) = 1 / 1.4
    assert batch_should_speculate([good, bad])  # mean 1.07 >= 1.05: both rows speculate
    assert not batch_should_speculate([bad, bad])
    for row in rows:
        row.batch_size = 3
    assert not batch_should_speculate(rows)  # another batch size: measured afresh


def test_what_a_sequences_steps_delivered_overrules_the_model():
    """The model (acceptance 0.9, r + rho = 0.1 of a plain step) expects well over 1.05x; this row's
    steps at batch size 8 delivered 0.9x plain: plain steps there, with probes; at batch size 1, and
    for another request, the model still rules."""
    costs = StepCosts()
    costs.observe_plain(0.010, batch_size=8)
    costs.observe_speculative(num_proposed=2, draft_s=0.0006, verify_s=0.0114, batch_size=8)  # r = rho = 0.05
    controller = SpeculationController(k_max=4, k=2, costs=costs, batch_size=8)
    controller.num_successes, controller.num_trials = 0.9, 1.0
    assert controller.expected_speedup(2) > 2.0 and controller.should_speculate()
    controller.delivered[8] = (90.0, controller.min_delivered_steps - 1)  # 90 tokens/s; plain: 100/s
    assert controller.realized_speedup() is None and controller.should_speculate()  # too few steps yet
    controller.delivered[8] = (90.0, controller.min_delivered_steps)
    assert controller.realized_speedup() == pytest.approx(0.9) and not controller.should_speculate()
    assert not batch_should_speculate([controller])
    for _ in range(controller.probe_interval):
        controller.observe_plain(0.010)
    assert controller.should_speculate()  # a probe
    controller.batch_size = 1
    assert controller.realized_speedup() is None  # nothing delivered at batch size 1
    other = SpeculationController(k_max=4, k=2, costs=costs, batch_size=8)  # another request, same batch size
    assert other.realized_speedup() is None  # its text is its own


def test_delivered_rate_is_an_average_of_the_rows_own_steps():
    controller = SpeculationController(k_max=4, k=2, batch_size=2)
    controller.observe(num_proposed=2, num_accepted=2, draft_s=0.01, verify_s=0.02)  # 3 tokens in 30 ms
    assert controller.delivered[2] == (pytest.approx(100.0), 1)
    controller.observe(num_proposed=2, num_accepted=0, draft_s=0.01, verify_s=0.02)  # 1 token in 30 ms
    rate, steps = controller.delivered[2]
    assert steps == 2 and rate == pytest.approx(100.0 + controller.smoothing * (100.0 / 3 - 100.0))


def test_controller_counts_an_empty_proposal_as_a_plain_step():
    controller = SpeculationController()
    controller.observe(num_proposed=0, num_accepted=0, draft_s=0.0, verify_s=0.010)
    assert controller.plain_step_s == 0.010 and controller.draft_step_s is None


def test_controller_validates_k():
    with pytest.raises(ConfigError, match=r"k must be in \[1, k_max=4\]"):
        SpeculationController(k_max=4, k=5)


# ---------------------------------------------------------------- sampling correctness


P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])  # target
Q = torch.tensor([0.05, 0.15, 0.30, 0.20, 0.30])  # draft: deliberately far from P


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_accept_emits_the_target_distribution():
    """20,000 steps of k=2 draft proposals from Q: every emitted position must follow P, not Q.

    Tolerance: chi-square with 4 degrees of freedom below its 0.999 quantile (18.47), and every
    frequency within 0.015 of P (over 4.5 standard deviations at 20k draws). Fixed seed.
    """
    generator = torch.Generator().manual_seed(7)
    k, num_steps = 2, 20_000
    first = torch.zeros(5)
    pooled = torch.zeros(5)
    proposed = torch.zeros(5)
    draft_probs, target_probs = Q.expand(k, 5), P.expand(k + 1, 5)
    for _ in range(num_steps):
        draft = torch.multinomial(Q, k, replacement=True, generator=generator).tolist()
        emitted = sampling_accept(draft, draft_probs, target_probs, generator)
        first[emitted[0]] += 1
        for token in emitted:
            pooled[token] += 1
        proposed[draft[0]] += 1
    assert chi_square(first, P) < CHI2_999[4]
    assert chi_square(pooled, P) < CHI2_999[4]
    assert (first / num_steps - P).abs().max() < 0.015
    assert chi_square(proposed, P) > 1000  # the test can fail: the raw proposals follow Q


def test_sampling_accept_with_one_hot_proposals_emits_the_target_distribution():
    """Prompt lookup proposes deterministically: q is one-hot, accepted with probability p(x)."""
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(5)
    one_hot = torch.zeros(1, 5)
    one_hot[0, 2] = 1.0
    for _ in range(20_000):
        counts[sampling_accept([2], one_hot, P.expand(2, 5), generator)[0]] += 1
    assert chi_square(counts, P) < CHI2_999[4]


def test_sampling_accept_keeps_everything_when_draft_equals_target():
    generator = torch.Generator().manual_seed(0)
    assert sampling_accept([1, 3, 0], P.expand(3, 5), P.expand(4, 5), generator)[:3] == [1, 3, 0]


def test_warp_probs_is_the_distribution_plain_sampling_draws_from():
    logits = torch.tensor([1.0, 0.8, 0.5, 0.3, -0.5, -2.0])
    temperature, top_p = 0.9, 0.8  # keeps the first four tokens
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(6)
    for _ in range(20_000):
        counts[sample_one(logits, temperature, top_p, generator)] += 1
    probs = warp_probs(logits, temperature, top_p)
    assert probs.sum() == pytest.approx(1.0)
    kept = probs > 0
    assert kept.tolist() == [True] * 4 + [False] * 2 == (counts > 0).tolist()
    assert chi_square(counts[kept], probs[kept]) < CHI2_999[3]


def test_warp_probs_rows_are_independent():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    batched = warp_probs(logits, 0.9, 0.7)
    assert torch.allclose(batched, torch.stack([warp_probs(row, 0.9, 0.7) for row in logits]))


# ---------------------------------------------------------------- compatibility


class FakeTokenizer(SimpleNamespace):
    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_check_compatible_accepts_the_same_vocabulary():
    vocab = {"a": 0, "b": 1, "</s>": 2}
    check_compatible(FakeTokenizer(vocab=vocab, bos_token_id=None, eos_token_id=2),
                     FakeTokenizer(vocab=dict(vocab), bos_token_id=None, eos_token_id=2))


def test_check_compatible_refuses_a_different_vocabulary_with_a_clear_message():
    target = FakeTokenizer(vocab={"a": 0, "b": 1, "</s>": 2}, bos_token_id=None, eos_token_id=2)
    draft = FakeTokenizer(vocab={"a": 0, "c": 1, "</s>": 2, "d": 3}, bos_token_id=None, eos_token_id=2)
    with pytest.raises(ConfigError) as info:
        check_compatible(target, draft)
    message = str(info.value)
    assert "vocabulary differs" in message and "(4 vs 3 tokens, 3 differ" in message
    assert "'b' is id 1 in the target and None in the draft" in message
    assert "trained with the target's tokenizer" in message


def test_check_compatible_refuses_different_special_tokens():
    vocab = {"a": 0, "b": 1}
    with pytest.raises(ConfigError, match="eos_token_id"):
        check_compatible(FakeTokenizer(vocab=vocab, bos_token_id=None, eos_token_id=0),
                         FakeTokenizer(vocab=vocab, bos_token_id=None, eos_token_id=1))


def test_check_runners_compatible():
    target = FakeRunner(V)
    check_runners_compatible(target, FakeRunner(V))
    with pytest.raises(ConfigError, match=r"vocab_size \(32\) differs from the target's \(16\)"):
        check_runners_compatible(target, FakeRunner(32))
    with pytest.raises(ConfigError, match="multimodal; use a text-only causal LM"):
        check_runners_compatible(target, FakeRunner(V, image_token_id=15))


# ---------------------------------------------------------------- the decoder over fake runners

EOS = 0
IMAGE = 15
NEXT = [(5 * t + 3) % 14 + 1 for t in range(V)]  # a bigram walk over 1..14 (never EOS, never IMAGE)


class FakeRunner:
    """A ModelRunner stand-in: next token = NEXT[last], except where ``disagree(position)`` bumps it.

    Its cache stores the fed token id at each position (layer 0, head 0, dim 0), so tests can read
    back exactly what a cache holds. ``logits`` may be given to return fixed logits (sampling tests).
    """

    def __init__(self, vocab: int, image_token_id: int | None = None, disagree=lambda pos: False,
                 logits: torch.Tensor | None = None):
        self.info = SimpleNamespace(vocab_size=vocab, image_token_id=image_token_id, num_image_tokens=4)
        self.is_multimodal = image_token_id is not None
        self.model_path = "fake"
        self.disagree = disagree
        self.fixed_logits = logits
        self.num_passes = 0  # prefill + decode calls
        self.num_fed_tokens = 0

    def new_kv_cache(self, *, block_tokens: int, max_tokens: int, static: bool = False) -> KVCache:
        return KVPool(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
                      block_tokens=block_tokens).new_cache(max_tokens)

    def embed(self, token_ids: list[int], image_embeds: list) -> torch.Tensor:
        return torch.tensor(token_ids, dtype=torch.float32)  # "embeddings" are the ids

    def _run(self, kv: KVCache, token_ids: list[int]) -> torch.Tensor:
        start = kv.length
        kv.ensure_capacity(start + len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.float32).view(1, -1, 1)  # [kv_heads, T, head_dim]
        kv.write(0, start, ids, torch.zeros_like(ids))
        kv.length = start + len(token_ids)
        self.num_fed_tokens += len(token_ids)
        if self.fixed_logits is not None:
            return self.fixed_logits.expand(len(token_ids), -1).clone()
        logits = torch.zeros(len(token_ids), self.info.vocab_size)
        for i, token in enumerate(token_ids):
            nxt = NEXT[token]
            logits[i, nxt % 14 + 1 if self.disagree(start + i) else nxt] = 1.0
        return logits

    def prefill(self, kv: KVCache, embeds: torch.Tensor, all_logits: bool = False,
                adapter_slot: int = 0) -> torch.Tensor:
        self.num_passes += 1
        logits = self._run(kv, [int(t) for t in embeds.tolist()])
        return logits if all_logits else logits[-1]

    def decode(self, kvs: list[KVCache], token_ids: list[int], adapter_slots: list[int] | None = None) -> torch.Tensor:
        self.num_passes += 1
        return torch.cat([self._run(kv, [t]) for kv, t in zip(kvs, token_ids)])

    def extend(self, kvs: list[KVCache], token_rows: list[list[int]], adapter_slots: list[int] | None = None):
        """[B, T, V]; rows shorter than T are padded with copies of their last logits."""
        self.num_passes += 1
        rows = [self._run(kv, row) for kv, row in zip(kvs, token_rows)]
        width = max(len(r) for r in rows)
        return torch.stack([torch.cat([r, r[-1:].expand(width - len(r), -1)]) for r in rows])


def cached_ids(kv: KVCache) -> list[int]:
    return [int(x) for x in kv.keys(0, kv.length)[0, :, 0].tolist()]


def plain_greedy(runner: FakeRunner, token_ids: list[int], num_new: int) -> list[int]:
    """The reference: the engine's loop (prefill the prompt, then one decode per token)."""
    kv = runner.new_kv_cache(block_tokens=8, max_tokens=512)
    ids = token_ids + [int(runner.prefill(kv, runner.embed(token_ids, [])).argmax())]
    while len(ids) - len(token_ids) < num_new:
        ids.append(int(runner.decode([kv], [ids[-1]])[0].argmax()))
    return ids[len(token_ids):]


def start(decoder: SpeculativeDecoder, prompt: list[int]):
    """Prefill the prompt in the target (engine-style): returns (transcript, target_kv, draft_kv)."""
    target_kv = decoder.target.new_kv_cache(block_tokens=8, max_tokens=512)
    draft_kv = decoder.new_draft_kv(block_tokens=8, max_tokens=512)
    ids = prompt + [int(decoder.target.prefill(target_kv, decoder.target.embed(prompt, [])).argmax())]
    return ids, target_kv, draft_kv


def run_steps(decoder, ids, target_kv, draft_kv, k, num_new):
    """Speculative steps to num_new new tokens, checking both caches' contents after every step."""
    goal = len(ids) + num_new - 1
    while len(ids) < goal:
        result = spec_drivers.step(decoder, ids, target_kv, draft_kv, k, max_new=goal - len(ids))
        assert 1 <= len(result.token_ids) <= k + 1
        ids.extend(result.token_ids)
        assert cached_ids(target_kv) == ids[:-1]
        if draft_kv is not None:
            assert_draft_prefix(ids, draft_kv, caught_up=result.num_proposed > 0)
    return ids


def assert_draft_prefix(ids: list[int], draft_kv: KVCache, caught_up: bool) -> None:
    """The draft holds a prefix of the text; after proposing, all but the last token or one less
    (it never fed an accepted last proposal). A step with nothing to propose leaves it behind."""
    text = [t for t in ids if t != IMAGE]
    assert cached_ids(draft_kv) == text[: draft_kv.length]
    assert draft_kv.length <= len(text) - 1
    assert not caught_up or draft_kv.length >= len(text) - 2


def every_third(pos: int) -> bool:
    return pos % 3 == 1


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("use_draft", [True, False])
def test_decoder_greedy_output_equals_plain(k, use_draft):
    target = FakeRunner(V, disagree=every_third)  # the draft (plain bigram) is wrong at every third position
    decoder = SpeculativeDecoder(target, FakeRunner(V) if use_draft else None)
    for prompt in ([1, 2, 3], [5, 9, 5, 9, 5], [4]):
        expected = plain_greedy(target, prompt, 40)
        ids, target_kv, draft_kv = start(decoder, prompt)
        assert run_steps(decoder, ids, target_kv, draft_kv, k, 40)[len(prompt):] == expected
    assert 0 < decoder.num_accepted < decoder.num_proposed


def test_decoder_text_only_draft_skips_image_placeholders():
    target = FakeRunner(V, image_token_id=IMAGE, disagree=every_third)
    decoder = SpeculativeDecoder(target, FakeRunner(V))
    prompt = [1, IMAGE, IMAGE, IMAGE, IMAGE, 6, 2]
    ids, target_kv, draft_kv = start(decoder, prompt)
    decoder.sync_draft(ids, draft_kv)
    assert cached_ids(draft_kv) == [1, 6, 2]  # text only, all but the last transcript token
    assert run_steps(decoder, ids, target_kv, draft_kv, 4, 30)[len(prompt):] == plain_greedy(target, prompt, 30)


def test_decoder_exact_pass_counts_when_the_draft_is_always_right():
    target, draft = FakeRunner(V), FakeRunner(V)
    decoder = SpeculativeDecoder(target, draft)
    ids, target_kv, draft_kv = start(decoder, [1, 2])
    target.num_passes = 0
    first = spec_drivers.step(decoder, ids, target_kv, draft_kv, 4)
    assert (first.num_proposed, first.num_accepted, len(first.token_ids)) == (4, 4, 5)
    ids.extend(first.token_ids)
    second = spec_drivers.step(decoder, ids, target_kv, draft_kv, 4, max_new=3)  # k clipped to 2: 3 tokens
    assert (second.num_proposed, len(second.token_ids)) == (2, 3)
    assert target.num_passes == 2  # 8 tokens for two target passes
    # step 1: one pass over the prompt and its first token, then 3 decodes; step 2: one pass over the
    # accepted 4th proposal (the draft never fed it) and the bonus token, then 1 decode
    assert draft.num_fed_tokens == (3 + 3) + (2 + 1)
    assert decoder.num_draft_synced_tokens == 0


def test_decoder_cuts_at_eos_and_keeps_caches_consistent():
    target, draft = FakeRunner(V), FakeRunner(V)
    decoder = SpeculativeDecoder(target, draft)
    ids, target_kv, draft_kv = start(decoder, [2, 8])  # the first token is NEXT[8] == 2
    eos = NEXT[2]  # treat the token after 2 as EOS
    result = spec_drivers.step(decoder, ids, target_kv, draft_kv, 5, eos_token_ids=(eos,))
    assert result.token_ids == [eos] and result.num_proposed == 1  # the draft stopped at its EOS
    ids.extend(result.token_ids)
    assert cached_ids(target_kv) == ids[:-1] and cached_ids(draft_kv) == ids[:-1]


def test_decoder_multi_turn_continues_both_caches_and_prefills_only_new_tokens():
    target = FakeRunner(V, image_token_id=IMAGE, disagree=every_third)
    reference = FakeRunner(V, image_token_id=IMAGE, disagree=every_third)
    decoder = SpeculativeDecoder(target, FakeRunner(V))
    turns = [[1, IMAGE, IMAGE, IMAGE, IMAGE, 4, 2], [9, 9, 3], [6, 12]]
    ids, target_kv, draft_kv = start(decoder, turns[0])
    ref_kv = reference.new_kv_cache(block_tokens=8, max_tokens=512)
    ref_ids = turns[0] + [int(reference.prefill(ref_kv, reference.embed(turns[0], [])).argmax())]
    for turn_index, turn in enumerate(turns):
        if turn_index:  # a follow-up: both sides prefill only what their caches lack
            fed_before, draft_cached = target.num_fed_tokens, draft_kv.length
            ids += turn
            ids.append(int(target.prefill(target_kv, target.embed(ids[target_kv.length:], [])).argmax()))
            assert target.num_fed_tokens - fed_before == 1 + len(turn)  # the last answer token + the turn
            num_text = len([t for t in ids if t != IMAGE])
            assert decoder.sync_draft(ids, draft_kv) == num_text - 1 - draft_cached  # no rebuild: only the tail
            assert draft_kv.length == num_text - 1
            ref_ids += turn
            ref_ids.append(int(reference.prefill(ref_kv, reference.embed(ref_ids[ref_kv.length:], [])).argmax()))
        run_steps(decoder, ids, target_kv, draft_kv, 3, 20)
        while len(ref_ids) < len(ids):
            ref_ids.append(int(reference.decode([ref_kv], [ref_ids[-1]])[0].argmax()))
        assert ids == ref_ids


def test_decoder_sampling_emits_the_target_distribution():
    """Whole-path check (draft sampling with warping, verification, acceptance): emitted tokens ~ warp(P)."""
    target_logits = torch.log(torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05]))
    draft_logits = torch.log(torch.tensor([0.05, 0.15, 0.30, 0.20, 0.30]))
    sampling = SamplingParams(max_tokens=1, temperature=0.8, top_p=1.0)
    decoder = SpeculativeDecoder(FakeRunner(5, logits=target_logits), FakeRunner(5, logits=draft_logits))
    generator = torch.Generator().manual_seed(5)
    ids, target_kv, draft_kv = [1, 2], decoder.target.new_kv_cache(block_tokens=64, max_tokens=1 << 16), \
        decoder.new_draft_kv(block_tokens=64, max_tokens=1 << 16)
    counts = torch.zeros(5)
    for _ in range(4_000):
        result = spec_drivers.step(decoder, ids, target_kv, draft_kv, 2, sampling=sampling, generator=generator)
        for token in result.token_ids:
            counts[token] += 1
        ids = ids[:1] + result.token_ids[-1:]  # keep the caches short: the fake ignores the context
        decoder.rewind(ids, target_kv, draft_kv)
    assert chi_square(counts, warp_probs(target_logits, 0.8, 1.0)) < CHI2_999[4]


def test_decoder_sampling_with_prompt_lookup_emits_the_target_distribution():
    """Deterministic proposals (q one-hot) still give the target's distribution."""
    target_logits = torch.log(torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05]))
    sampling = SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0)
    decoder = SpeculativeDecoder(FakeRunner(5, logits=target_logits), None)
    generator = torch.Generator().manual_seed(9)
    ids = [0, 1, 2, 3, 4, 0]  # prompt lookup proposes [1, 2] after the final 0, every step
    target_kv = decoder.target.new_kv_cache(block_tokens=64, max_tokens=64)
    counts = torch.zeros(5)
    for _ in range(4_000):
        result = spec_drivers.step(decoder, ids, target_kv, None, 2, sampling=sampling, generator=generator)
        assert result.num_proposed == 2
        for token in result.token_ids:
            counts[token] += 1
        decoder.rewind(ids, target_kv, None)
    assert chi_square(counts, torch.softmax(target_logits, -1)) < CHI2_999[4]


def test_batched_step_keeps_each_rows_rule():
    """One batched step holds a drafting sampling row (k=2), a plain sampling row riding along (k=0) and a
    greedy drafting row: both sampling rows emit the target's distribution, the greedy row its argmax."""
    target_logits = torch.log(torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05]))
    draft_logits = torch.log(torch.tensor([0.05, 0.15, 0.30, 0.20, 0.30]))
    sampling = SamplingParams(max_tokens=8, temperature=0.8, top_p=1.0)
    decoder = SpeculativeDecoder(FakeRunner(5, logits=target_logits), FakeRunner(5, logits=draft_logits))
    generator = torch.Generator().manual_seed(11)
    rows = [SpecRow([1, 2], decoder.target.new_kv_cache(block_tokens=64, max_tokens=64),
                    decoder.new_draft_kv(block_tokens=64, max_tokens=64), k, sampling=params, generator=generator)
            for k, params in ((2, sampling), (0, sampling), (3, None))]
    counts = {0: torch.zeros(5), 1: torch.zeros(5)}
    for _ in range(3_000):
        results = decoder.step_batch(rows)
        for index in (0, 1):
            for token in results[index].token_ids:
                counts[index][token] += 1
        assert results[1].num_proposed == 0 and len(results[1].token_ids) == 1
        assert results[2].token_ids == [0] and results[2].num_proposed == 3  # the draft's 2 is rejected
        for row in rows:  # keep the caches short: the fake ignores the context
            decoder.rewind(row.token_ids, row.target_kv, row.draft_kv)
    expected = warp_probs(target_logits, 0.8, 1.0)
    assert chi_square(counts[0], expected) < CHI2_999[4]
    assert chi_square(counts[1], expected) < CHI2_999[4]


def test_decoder_refuses_a_step_with_nothing_to_emit():
    decoder = SpeculativeDecoder(FakeRunner(V), None)
    with pytest.raises(ValueError, match="max_new must be >= 1"):
        spec_drivers.step(decoder, [1, 2], decoder.target.new_kv_cache(block_tokens=8, max_tokens=64), None, 3, max_new=0)
