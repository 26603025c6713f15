"""session/model/sampling.py: greedy, seeded temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import pytest
import torch

import session.model.sampling
from session.errors import BadRequest, ResidentError
from session.model.sampling import NOT_FINITE, make_generator, sample_one, sample_rows
from session.serving.chat_request import parse_request
from session.types import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=1)


def sampled(temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=seed)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, default_seed: int = 0) -> list[int]:
    generator = make_generator(params, default_seed, CPU)
    return [sample_rows(logits[None], [params], [generator])[0] for _ in range(n)]


def test_greedy_rows_pick_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0], [3.0, -1.0, 2.0, 2.9], [-9.0, -8.0, -7.0, -1.0]])
    assert sample_rows(logits, [GREEDY] * 3, [None] * 3) == [1, 0, 3]


def test_greedy_needs_no_generator():
    assert make_generator(GREEDY, 0, CPU) is None


def test_generator_uses_the_request_seed_or_the_default():
    assert make_generator(sampled(seed=42), 7, CPU).initial_seed() == 42
    assert make_generator(sampled(), 7, CPU).initial_seed() == 7


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0], [4.0, 1.0, 0.0]])
    params = [GREEDY, sampled(seed=1), GREEDY]
    generators = [make_generator(p, 0, CPU) for p in params]
    for _ in range(20):
        tokens = sample_rows(logits, params, generators)
        assert tokens[0] == 1 and tokens[2] == 0
        assert tokens[1] in (0, 1, 2)


def test_same_seed_is_reproducible_and_different_seeds_differ():
    flat = torch.zeros(1000)
    first = draws(flat, sampled(seed=123), 20)
    again = draws(flat, sampled(seed=123), 20)
    other = draws(flat, sampled(seed=124), 20)
    assert first == again
    assert first != other
    assert len(set(first)) > 10  # a flat distribution over 1000 ids rarely repeats


def test_a_row_does_not_depend_on_its_batch_neighbours():
    logits = torch.zeros(2, 500)
    alone = draws(logits[0], sampled(seed=5), 10)
    params = [sampled(seed=5), sampled(seed=99)]
    generators = [make_generator(p, 0, CPU) for p in params]
    batched = [sample_rows(logits, params, generators)[0] for _ in range(10)]
    assert batched == alone


def test_small_top_p_keeps_only_the_top_token():
    logits = torch.tensor([1.0, 3.0, 2.9, 0.5, 2.95])
    for seed in range(5):
        assert set(draws(logits, sampled(temperature=2.0, top_p=0.05, seed=seed), 50)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    logits = probs.log()
    # mass before token 1 is 0, before token 2 is 0.5 (< 0.6: kept), before the rest is 0.8 (dropped)
    tokens = draws(logits, sampled(top_p=0.6, seed=0), 400)
    assert set(tokens) == {1, 2}
    assert abs(tokens.count(1) / 400 - 0.5 / 0.8) < 0.08


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_match_the_tempered_softmax(temperature):
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor(probs).log()
    tempered = [p ** (1 / temperature) for p in probs]
    expected = [p / sum(tempered) for p in tempered]  # softmax(log p / T)
    n = 4000
    tokens = draws(logits, sampled(temperature=temperature, seed=2024), n)
    frequencies = [tokens.count(i) / n for i in range(4)]
    # Tolerance 0.03: over 3.5 standard deviations for every p at n=4000 (sd <= 0.0079).
    for observed, p in zip(frequencies, expected):
        assert abs(observed - p) < 0.03, (frequencies, expected)
    assert sum(tokens.count(i) for i in range(4)) == n


def test_sample_one_returns_a_scalar_index():
    generator = torch.Generator().manual_seed(0)
    token = sample_one(torch.tensor([0.0, 100.0]), 1.0, 1.0, generator)
    assert token.dim() == 0
    assert int(token) == 1


def test_tiny_accepted_temperature_still_samples():
    body = '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-40, "seed": 1}'
    request = parse_request(body, {}, default_max_tokens=4, max_new_tokens=8)
    logits = torch.tensor([1.0, 3.0, 2.0])
    generator = make_generator(request.sampling, 0, CPU)
    assert sample_rows(logits[None], [request.sampling], [generator]) == [1]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_any_seed_the_protocol_accepts_makes_a_generator(seed):
    body = '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": %d}' % seed
    try:
        request = parse_request(body, {}, default_max_tokens=4, max_new_tokens=8)
    except BadRequest as exc:  # refusing it up front is also correct
        assert "seed" in exc.message
        return
    assert make_generator(request.sampling, 0, CPU) is not None


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad", [[0.0, NAN, 1.0], [INF, 0.0, 1.0], [-INF, -INF, -INF], [NAN] * 3])
def test_a_greedy_row_that_is_not_finite_fails_alone(bad):
    logits = torch.tensor([[0.0, 5.0, 1.0], bad, [4.0, 1.0, -INF]])  # -Inf (a banned token) is fine
    tokens = sample_rows(logits, [GREEDY] * 3, [None] * 3)
    assert tokens[0] == 1 and tokens[2] == 0
    assert isinstance(tokens[1], ResidentError) and tokens[1].status == 500 and tokens[1].message == NOT_FINITE


@pytest.mark.parametrize("bad", [[0.0, NAN, 1.0], [INF, 0.0, 1.0], [3e38, -3e38, 0.0]])  # the last: logits / T overflow
def test_a_sampled_row_that_is_not_finite_fails_alone(bad):
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], bad + [0.0], [0.0, 0.0, 0.0, 0.0]])
    params = [sampled(seed=3), sampled(temperature=0.5, seed=4), sampled(seed=5)]
    generators = [make_generator(p, 0, CPU) for p in params]
    batched = [sample_rows(logits, params, generators) for _ in range(10)]
    assert all(isinstance(tokens[1], ResidentError) and tokens[1].message == NOT_FINITE for tokens in batched)
    assert [tokens[0] for tokens in batched] == draws(logits[0], params[0], 10)
    assert [tokens[2] for tokens in batched] == draws(logits[2], params[2], 10)


def test_a_row_whose_draw_raises_fails_alone(monkeypatch):
    warp = session.model.sampling.warp_probs

    def failing(logits, temperature, top_p, top_k=0):
        if temperature == 0.7:
            raise RuntimeError("injected sampling fault")
        return warp(logits, temperature, top_p, top_k)

    monkeypatch.setattr(session.model.sampling, "warp_probs", failing)
    logits = torch.tensor([[0.0, 9.0, 1.0]] * 3)
    params = [GREEDY, sampled(temperature=0.7, seed=1), sampled(seed=2)]
    tokens = sample_rows(logits, params, [make_generator(p, 0, CPU) for p in params])
    assert tokens[0] == 1 and isinstance(tokens[2], int)
    assert isinstance(tokens[1], ResidentError) and "injected sampling fault" in tokens[1].message
    assert isinstance(tokens[1].__cause__, RuntimeError)
