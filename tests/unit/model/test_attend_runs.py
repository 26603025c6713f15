"""attend_runs: attention over a cache's runs of blocks in place equals attention over the whole cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from session.model.attention import attend_runs


def split(t: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    bounds = [0, *cuts, t.shape[1]]
    return [t[:, a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("cuts", [[], [5], [3, 9, 10]], ids=["one run", "two runs", "four runs"])
@pytest.mark.parametrize("num_queries", [1, 6])
def test_runs_equal_one_attention_over_the_whole_cache(heads, kv_heads, cuts, num_queries):
    generator = torch.Generator().manual_seed(heads * 10 + len(cuts) + num_queries)
    length = 14
    q = torch.randn(1, heads, num_queries, 8, generator=generator)
    k = torch.randn(kv_heads, length, 8, generator=generator)
    v = torch.randn(kv_heads, length, 8, generator=generator)
    # the new queries are the last positions: query t sees keys 0 .. length - T + t, so an early query
    # sees no key of a run that starts after it (the run is masked whole for that query)
    mask = None if num_queries == 1 else torch.ones(num_queries, length, dtype=torch.bool).tril(length - num_queries)
    want = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=0.3,
                                          enable_gqa=heads != kv_heads)
    runs = list(zip(split(k, cuts), split(v, cuts)))
    got = attend_runs(q, runs, 0.3, heads != kv_heads, mask)
    assert got.shape == want.shape and not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_runs_come_back_in_bfloat16():
    q = torch.randn(1, 2, 3, 8).to(torch.bfloat16)
    k, v = torch.randn(2, 10, 8).to(torch.bfloat16), torch.randn(2, 10, 8).to(torch.bfloat16)
    mask = torch.ones(3, 10, dtype=torch.bool).tril(7)
    got = attend_runs(q, list(zip(split(k, [4]), split(v, [4]))), 0.3, False, mask)
    want = F.scaled_dot_product_attention(q.float(), k[None].float(), v[None].float(), attn_mask=mask, scale=0.3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
