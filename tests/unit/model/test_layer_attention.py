"""The one loop over the layers and a pass's attention plan (session/model/layer_attention.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from session.model.kv_pool import KVPool
from session.model.layer_attention import SpanAttention, run_layers


class Stack:
    """Three layers whose projections and finish are plain arithmetic, so the loop's result is known."""

    def __init__(self):
        self.layers = [SimpleNamespace(name=f"layer {i}") for i in range(3)]

    def attention_inputs(self, layer, h, cos, sin):
        return h + cos, h * sin, h - 1  # q, k, v

    def finish_layer(self, layer, h, attn_out):
        return h + attn_out


def test_the_loop_gives_each_layer_its_own_q_k_v_once_in_order_and_feeds_on_the_attention():
    seen = []

    def attention(index, layer, q, k, v):
        seen.append((index, layer.name, q.tolist(), k.tolist(), v.tolist()))
        return 2 * q

    h = run_layers(Stack(), torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([3.0]), attention)
    # layer i: q = h + 0.5, k = 3h, v = h - 1; then h + 2q = 3h + 1: 1 -> 4 -> 13 -> 40
    assert seen == [(0, "layer 0", [1.5], [3.0], [0.0]), (1, "layer 1", [4.5], [12.0], [3.0]),
                    (2, "layer 2", [13.5], [39.0], [12.0])]
    assert h.tolist() == [40.0]


def test_a_span_over_scattered_blocks_in_place_equals_the_gathered_copy_and_writes_its_keys():
    """A prefill's attention on CPU reads the session's runs of blocks in place (full-attention layers);
    the same plan over a gathered copy (what a sliding-window layer, or another device, takes) gives
    the same output, and either way the new keys land in the cache at the span's positions."""
    generator = torch.Generator().manual_seed(3)
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=4)
    kv, other = pool.new_cache(64), pool.new_cache(64)
    for length in (4, 8, 11):  # the two caches take turns at the pool: kv's blocks are not consecutive
        for cache in (kv, other):
            cache.ensure_capacity(length)
    past = torch.randn(2, 2, 7, 8, generator=generator)  # layers, KVH, 7 cached tokens, hd
    for layer in range(2):
        kv.write(layer, 0, past[layer], past[layer])
    kv.length = 7
    assert len(kv.runs(0, 0, 11)) > 1
    layer = SimpleNamespace(self_attn=SimpleNamespace(scaling=0.35))
    q = torch.randn(1, 4, 4, 8, generator=generator)  # 4 query heads over 2 KV heads, 4 new tokens
    k, v = torch.randn(1, 2, 4, 8, generator=generator), torch.randn(1, 2, 4, 8, generator=generator)
    in_place = SpanAttention(kv, 7, 4, [None, None], torch.device("cpu"), grouped=True)
    gathered = SpanAttention(kv, 7, 4, [None, None], torch.device("cpu"), grouped=True)
    gathered.in_place = None
    assert in_place.in_place is kv
    got = in_place(0, layer, q, k, v)
    torch.testing.assert_close(kv.keys(0, 11)[:, 7:], k[0])
    torch.testing.assert_close(got, gathered.attend(0, layer, q), rtol=1e-5, atol=1e-5)
    keys = torch.cat([past[0], k[0]], dim=1)  # [KVH, 11, hd]: what the four queries see, causally
    values = torch.cat([past[0], v[0]], dim=1)
    mask = torch.ones(4, 11, dtype=torch.bool).tril(7)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask,
                                                            scale=0.35, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
