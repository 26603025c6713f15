"""session/kv_cache.py: block-grown and static per-session KV buffers."""

from __future__ import annotations

import pytest
import torch

from session.kv_cache import KVCache

LAYERS, HEADS, HEAD_DIM, BLOCK, MAX = 2, 3, 4, 8, 20


def make(static: bool = False, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
                   device=torch.device("cpu"), block_tokens=BLOCK, max_tokens=MAX, static=static)


def fill(cache: KVCache, start: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write distinct values for positions start..start+num_tokens-1 in every layer; returns them."""
    shape = (LAYERS, HEADS, num_tokens, HEAD_DIM)
    k = torch.arange(start * 1000, start * 1000 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    v = -k
    for layer in range(LAYERS):
        cache.write(layer, start, k[layer], v[layer])
    cache.length = start + num_tokens  # the model runner advances length after a step
    return k, v


def expected_nbytes(capacity: int, element_size: int = 4) -> int:
    return 2 * LAYERS * HEADS * capacity * HEAD_DIM * element_size


def test_starts_empty():
    cache = make()
    assert (cache.capacity, cache.length, cache.nbytes) == (0, 0, 0)
    assert cache.k.shape == (LAYERS, HEADS, 0, HEAD_DIM)


def test_capacity_grows_in_whole_blocks_up_to_max():
    cache = make()
    seen = []
    for num_tokens in (1, 8, 9, 16, 17, 20):
        cache.ensure_capacity(num_tokens)
        seen.append(cache.capacity)
    assert seen == [8, 8, 16, 16, 20, 20]  # the last block is cut at max_tokens
    assert cache.k.shape == cache.v.shape == (LAYERS, HEADS, 20, HEAD_DIM)


def test_ensure_capacity_within_capacity_does_not_reallocate():
    cache = make()
    cache.ensure_capacity(3)
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    for num_tokens in (0, 1, 5, 8):
        cache.ensure_capacity(num_tokens)
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == (k_ptr, v_ptr)


def test_growing_preserves_written_contents():
    cache = make()
    cache.ensure_capacity(6)
    k, v = fill(cache, 0, 6)
    old_ptr = cache.k.data_ptr()
    cache.ensure_capacity(9)
    assert cache.capacity == 16
    assert cache.k.data_ptr() != old_ptr
    assert cache.length == 6
    for layer in range(LAYERS):
        assert torch.equal(cache.keys(layer, 6), k[layer])
        assert torch.equal(cache.values(layer, 6), v[layer])
    k2, v2 = fill(cache, 6, 10)  # then keep writing after the copy
    cache.ensure_capacity(20)
    assert torch.equal(cache.keys(1, 16), torch.cat([k[1], k2[1]], dim=1))
    assert torch.equal(cache.values(0, 16), torch.cat([v[0], v2[0]], dim=1))


def test_keys_and_values_are_views_of_the_buffers():
    cache = make()
    cache.ensure_capacity(4)
    k, _ = fill(cache, 0, 4)
    view = cache.keys(0, 4)
    assert view.shape == (HEADS, 4, HEAD_DIM)
    assert view.data_ptr() == cache.k.data_ptr()
    assert torch.equal(cache.keys(0, 2), k[0, :, :2])


def test_static_allocates_max_tokens_up_front_and_never_reallocates():
    cache = make(static=True)
    assert cache.capacity == MAX
    assert cache.nbytes == expected_nbytes(MAX)
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    for num_tokens in (1, 8, 9, 17, 20):
        cache.ensure_capacity(num_tokens)
        fill(cache, 0, num_tokens)
        assert cache.capacity == MAX
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == (k_ptr, v_ptr)


@pytest.mark.parametrize("static", [False, True])
def test_ensure_capacity_beyond_max_raises(static):
    cache = make(static=static)
    cache.ensure_capacity(5)
    capacity = cache.capacity
    with pytest.raises(ValueError) as info:
        cache.ensure_capacity(MAX + 1)
    assert str(info.value) == f"KV cache cannot hold {MAX + 1} tokens (max {MAX})"
    assert cache.capacity == capacity


def test_nbytes_is_exact():
    cache = make()
    cache.ensure_capacity(9)
    assert cache.nbytes == expected_nbytes(16) == 2 * 2 * 3 * 16 * 4 * 4 == 3072
    half = make(dtype=torch.bfloat16)
    half.ensure_capacity(1)
    assert half.nbytes == expected_nbytes(8, element_size=2) == 2 * 2 * 3 * 8 * 4 * 2 == 768


def test_crop_forgets_positions_but_keeps_buffers():
    cache = make()
    cache.ensure_capacity(10)
    fill(cache, 0, 10)
    ptr = cache.k.data_ptr()
    cache.crop(4)
    assert cache.length == 4
    cache.crop(8)  # cropping never extends
    assert cache.length == 4
    assert cache.capacity == 16
    assert cache.k.data_ptr() == ptr
    assert cache.nbytes == expected_nbytes(16)


def test_release_frees_the_buffers():
    cache = make()
    cache.ensure_capacity(12)
    fill(cache, 0, 12)
    cache.release()
    assert (cache.length, cache.capacity, cache.nbytes) == (0, 0, 0)
    cache.ensure_capacity(3)  # usable again
    assert cache.capacity == 8


def test_release_of_a_static_cache_frees_its_buffers():
    cache = make(static=True)
    cache.release()
    assert (cache.length, cache.capacity, cache.nbytes) == (0, 0, 0)
