"""No host sync inside a prefill or a decode step, counted on CPU.

On CUDA a call that reads a device tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)``, ``nonzero``, a boolean index) waits for every kernel queued before it: one in a layer's
loop costs a round trip per layer. The calls are the same whatever the device, so a TorchFunctionMode
counts them here on CPU tensors, over the paths a GPU runs (torch's operators, RESIDENT_CPU_KERNELS=0,
batched decode attention). On the device the check (scripts/device_check.sh) runs the same steps
under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from session.model.runner import ModelRunner

READS_ON_HOST = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                 "is_nonzero", "masked_select"}


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that read a value back to the host, and boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS_ON_HOST or (name in ("__getitem__", "__setitem__") and boolean_index(args[1])):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def test_the_counter_sees_each_kind_of_host_read():
    t = torch.arange(4)
    with HostReads() as reads:
        t.tolist(), t[0].item(), bool(t[1]), t.nonzero(), t[t > 1]
        t[t > 2] = 0
    assert reads.calls == Counter({"tolist": 1, "item": 1, "__bool__": 1, "nonzero": 1, "__getitem__": 1,
                                   "__setitem__": 1})


@pytest.fixture(scope="module")
def text_runner() -> ModelRunner:
    from model_store.build_text_models import ensure

    runner = ModelRunner(str(ensure(["llama"])["llama"]), device="cpu", cpu_kernels=False)
    runner.configure_decode("batched")
    return runner


def test_a_decode_step_and_a_prefill_read_nothing_back(text_runner):
    runner = text_runner
    kvs = [runner.new_kv_cache(block_tokens=8, max_tokens=256) for _ in range(3)]
    kvs[0].pool.reserve(1 + 3 * 32)  # no pool growth inside the measured steps
    for i, kv in enumerate(kvs):
        runner.prefill(kv, runner.embed(list(range(3, 8 + 3 * i)), []))
    runner.decode(kvs, [5, 6, 7])  # warm-up
    with HostReads() as reads:
        runner.decode(kvs, [5, 6, 7])  # lengths 6, 9, 12 -> 7, 10, 13: two rows cross into a new block
        runner.prefill(kvs[0], runner.embed(list(range(3, 20)), []))  # a follow-up across two blocks
        runner.prefill(kvs[1], runner.embed(list(range(3, 20)), []), all_logits=True)  # a verify's shape
    assert reads.calls == Counter()


def test_embedding_an_image_reads_nothing_back(tiny_model_path):
    runner = ModelRunner(str(tiny_model_path), device="cpu", cpu_kernels=False)
    image_token, hidden = runner.info.image_token_id, runner.info.hidden_size
    ids = [1, 5, image_token, image_token, image_token, 7, image_token, image_token, 9]
    images = [torch.randn(3, hidden), torch.randn(2, hidden)]
    with HostReads() as reads:
        embeds = runner.embed(ids, images)
    assert reads.calls == Counter()
    expected = runner.lm.embed_tokens(torch.tensor(ids))
    expected[torch.tensor(ids) == image_token] = torch.cat(images)
    assert torch.equal(embeds, expected)
