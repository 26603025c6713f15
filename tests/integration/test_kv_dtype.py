"""RESIDENT_KV_DTYPE=float32 beside bfloat16 weights (CPU): the cache and attention run in float32,
holding the bfloat16 projections losslessly, and the step answers as the all-bfloat16 one does to
bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from session.config import EngineConfig
from session.errors import ConfigError
from session.model.runner import ModelRunner, cpu_has_bf16

pytestmark = pytest.mark.skipif(not cpu_has_bf16(), reason="bfloat16 runs on CPUs with AVX512-BF16 or AMX only")


def run(runner: ModelRunner, steps: int = 6):
    """Two sessions (crossing 16-token blocks): prefill, then ``steps`` batched greedy decode steps."""
    kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=256) for _ in range(2)]
    logits = torch.stack([runner.prefill(kv, runner.embed(list(range(3, 30 + 9 * i)), [])) for i, kv in enumerate(kvs)])
    for _ in range(steps):
        logits = runner.decode(kvs, logits.argmax(-1).tolist())
    return kvs, logits


def test_float32_kv_beside_bfloat16_weights(tiny_model_path):
    plain = ModelRunner(str(tiny_model_path), device="cpu", dtype="bfloat16")
    wide = ModelRunner(str(tiny_model_path), device="cpu", dtype="bfloat16", kv_dtype="float32")
    assert (plain.kv_dtype, wide.kv_dtype, wide.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    plain_kvs, plain_logits = run(plain)
    wide_kvs, wide_logits = run(wide)
    assert [kv.nbytes for kv in wide_kvs] == [2 * kv.nbytes for kv in plain_kvs]  # float32: twice the bytes
    for kv in wide_kvs:
        keys = kv.keys(0, kv.length)
        assert keys.dtype == torch.float32
        assert torch.equal(keys.to(torch.bfloat16).float(), keys)  # bfloat16 projections, stored losslessly
    torch.testing.assert_close(wide_logits, plain_logits, atol=0.25, rtol=0.05)  # bfloat16 rounding apart


def test_an_unknown_kv_dtype_is_refused(tmp_path):
    with pytest.raises(ConfigError) as caught:
        EngineConfig.from_sources({"model_path": str(tmp_path)}, {"RESIDENT_KV_DTYPE": "int8"})
    assert "RESIDENT_KV_DTYPE must be auto or float32, got 'int8'" in str(caught.value)
