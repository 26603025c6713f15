"""benchmarks.decode's rates divide by the tokens each answer holds, not by the ones it asked for: an
answer that ended at EOS after 60 of 128 tokens took 59 decode steps, and timing it as 127 read a
SmolLM2 session twice as fast as it ran."""

import pytest

from benchmarks.decode import decode_rates


def test_each_answer_is_divided_by_its_own_decode_steps():
    rates = decode_rates(first=[10.0, 10.0, 10.5], last=[10.59, 11.27, 11.14], tokens=[60, 128, 65])
    # 0.59 s / 59 steps, 1.27 / 127, 0.64 / 64: 10 ms each
    assert rates["per_token_s"] == pytest.approx(0.010)
    assert rates["tokens_per_s"] == pytest.approx((59 + 127 + 64) / 1.27)


def test_an_answer_without_a_decode_step_is_refused():
    with pytest.raises(RuntimeError, match="an answer of 1 tokens"):
        decode_rates(first=[1.0, 1.0], last=[1.0, 2.0], tokens=[1, 64])
