"""GGUF blocks in our formats (session/model/gguf.py) and where a model path's checkpoint is
(session/checkpoints.py).

Every kept format is unpacked from random blocks (any bytes are a valid block once its float16 scales
are finite) and must give, element for element, the float32 weights gguf's own ``dequantize`` gives:
the check ``keep_packed`` makes against transformers' weights at load, here on formats no test file
of ours holds (Q4_0, Q4_K). Then our kernels on those blocks against the float64 product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from session.checkpoints import Checkpoint, locate, require
from session.errors import ConfigError
from session.model import gguf
from session.model.cpu import linear as cpu_linear

# byte offsets of each format's float16 fields within a block (scales, mins)
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}


def random_rows(kind: str, rows: int, inputs: int, seed: int) -> np.ndarray:
    """[rows, blocks * bytes] uint8 of random blocks whose float16 fields are small finite numbers."""
    per_block = gguf.SUPER_BLOCK if kind == "Q4_K" else gguf.GROUP
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, inputs // per_block, gguf.BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in HALVES[kind]:
        values = (rng.standard_normal((rows, inputs // per_block)) * 0.01).astype(np.float16)
        blocks[..., at:at + 2] = values[..., None].view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_blocks_give_ggufs_own_weights_exactly(kind):
    rows, inputs = 48, 512
    data = random_rows(kind, rows, inputs, seed=len(kind))
    want = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, inputs)
    assert want.dtype == np.float32
    if kind in gguf.INT8_FORMATS:
        q, scales = gguf.unpack_q8_0(data)
        got = gguf.dequantize_int8(q, scales)
        assert q.dtype == torch.int8 and scales.shape == (rows, inputs // 32)
    else:
        q, scales, offsets = gguf.unpack_q4(data, kind)
        assert int(q.min()) >= 0 and int(q.max()) <= 15 and scales.shape == offsets.shape == (rows, inputs // 32)
        got = gguf.dequantize_q4(q, scales, offsets)
    assert torch.equal(got.float(), torch.from_numpy(want))


def test_a_wrong_nibble_order_would_show():
    """Swapping the two halves of each Q4_1 block's nibbles gives other weights (the test above can fail)."""
    data = random_rows("Q4_1", 16, 64, seed=1)
    q, scales, offsets = gguf.unpack_q4(data, "Q4_1")
    swapped = q.view(16, 2, 2, 16).flip(2).reshape(16, 64)
    want = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_1).reshape(16, 64))
    assert not torch.equal(gguf.dequantize_q4(swapped, scales, offsets).float(), want)


@pytest.mark.skipif(not (cpu_linear.INT8_KERNEL.load() and cpu_linear.INT4_KERNEL.load()),
                    reason="kernels not buildable here")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_our_kernels_on_the_blocks_within_rounding_of_the_float64_product(kind):
    rows, inputs = 40, 768 if kind != "Q4_K" else 512
    data = random_rows(kind, rows, inputs, seed=7)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    linear, weights = gguf.packed_linear(data, kind, bias)
    assert linear.ours and linear.block == 32 and linear.group_size == 32
    x = torch.randn(5, inputs, generator=torch.Generator().manual_seed(3))
    reference = x.double() @ weights.T + bias.double()
    magnitude = x.double().abs() @ weights.abs().T + bias.double().abs()
    assert ((linear(x).double() - reference).abs() <= 1e-6 * magnitude).all()


def test_the_start_up_line():
    report = gguf.GgufReport("m.gguf", {"Q4_1": 210, "Q8_0": 1}, "Q8_0", {"Q6_K": 2}, 1, "", 538_000_000,
                             225_000_000)
    assert report.num_kept == 211
    assert report.describe() == (
        "weights: GGUF m.gguf, kept packed on our kernels (float32 inputs): 210 Q4_1 -> int4 (groups of 32), 1 Q8_0 -> int8 "
        "(groups of 32) (the head from Q8_0); linears dequantized to float by transformers: 2 Q6_K; 1 left "
        "float: their blocks did not give transformers' weights; 538 MB -> 225 MB")


def test_where_our_kernels_cannot_keep_them_the_line_says_why():
    assert "CPU" in gguf.can_keep(torch.device("cuda"), torch.float32, True)
    assert "float32 activations" in gguf.can_keep(torch.device("cpu"), torch.bfloat16, True)
    assert gguf.can_keep(torch.device("cpu"), torch.float32, False) == "RESIDENT_CPU_KERNELS=0"


# ------------------------------------------------------------------ session/checkpoints.py


def test_locate(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"")  # config.json wins: a Hugging Face folder
    assert locate(hf) == Checkpoint(str(hf))
    one = tmp_path / "one"
    one.mkdir()
    (one / "model.Q4_K_M.gguf").write_bytes(b"")
    assert locate(one) == Checkpoint(str(one), "model.Q4_K_M.gguf")
    assert locate(one / "model.Q4_K_M.gguf").kwargs == {"gguf_file": "model.Q4_K_M.gguf"}
    assert locate(one).gguf_path == one / "model.Q4_K_M.gguf"
    assert locate(tmp_path / "missing") is None and locate(hf / "config.json") is None
    assert require(hf) == Checkpoint(str(hf))
    with pytest.raises(ConfigError) as info:
        require(tmp_path / "missing")
    assert str(info.value) == f"no Hugging Face checkpoint or GGUF file at {str(tmp_path / 'missing')!r}"
    (one / "other.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="several GGUF files .*model.Q4_K_M.gguf, other.gguf"):
        locate(one)
