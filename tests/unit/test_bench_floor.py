"""benchmarks.decode's bandwidth floor: the language model's weight bytes (embedding aside, head
included) over the best bandwidth reading, with the session's KV, and over the readings' median."""

from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.decode import bandwidth_floor


def test_the_floor_takes_the_best_reading_and_the_typical_one_the_median():
    lm = nn.Module()
    lm.embed_tokens = nn.Embedding(10, 4)  # 160 bytes, not read per token
    lm.layer = nn.Linear(4, 8, bias=False)  # 128 bytes
    lm.layer.register_buffer("packed", torch.zeros(2, 4))  # 32 bytes (packed weights count; a 1-d bias would not)
    runner = SimpleNamespace(lm=lm, lm_head=nn.Linear(4, 10, bias=False),  # 160 bytes
                             info=SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4), kv_dtype=torch.float32)
    floor = bandwidth_floor(runner, [(100.0, 50.0), (80.0, 40.0), (120.0, 30.0)], context_tokens=3)
    assert floor["weight_bytes"] == 320 and floor["kv_bytes"] == 2 * 2 * 1 * 4 * 4 * 3
    assert floor["bandwidth"] == 120.0 and floor["typical_bandwidth"] == 40.0
    assert floor["floor_s"] == 320 / 120.0
    assert floor["floor_with_kv_s"] == (320 + 192) / 120.0
    assert floor["typical_floor_s"] == 320 / 40.0
