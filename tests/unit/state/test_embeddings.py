"""The embedding cache on its own: references, and the byte bound (which tensors go, in which order)."""

from __future__ import annotations

import pytest
import torch

from session.state.embeddings import EmbeddingCache


def tensor(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes // 4, dtype=torch.float32)  # [nbytes / 4]: 4 bytes each


def always(digest: str) -> bool:
    return True


def cache_with(max_bytes: int, sizes: dict[str, int]) -> EmbeddingCache:
    """One reference and one stored tensor per digest, stored (so used) in the order given."""
    cache = EmbeddingCache(max_bytes=max_bytes)
    for digest, nbytes in sizes.items():
        cache.acquire(digest)
        cache.store(digest, tensor(nbytes), grid=(1, 2, 2))
    return cache


def with_tensor(cache: EmbeddingCache, digests) -> list[str]:
    return [d for d in digests if cache.get(d).tensor is not None]


def test_no_bound_never_evicts():
    cache = cache_with(0, {"a": 400, "b": 400, "c": 400})
    assert cache.evict(always) == []
    assert cache.nbytes == 1200 and cache.num_evictions == 0


def test_within_the_bound_nothing_goes():
    cache = cache_with(300, {"a": 100, "b": 100, "c": 100})  # exactly at the bound is within it
    assert cache.evict(always) == []
    assert cache.nbytes == 300 and cache.num_evictions == 0


def test_least_recently_stored_goes_first_and_keeps_its_entry():
    cache = cache_with(250, {"a": 100, "b": 100, "c": 100})
    cache.acquire("a")  # a second reference
    assert cache.evict(always) == ["a"]
    entry = cache.get("a")
    assert (entry.tensor, entry.refs, entry.grid) == (None, 2, (1, 2, 2))
    assert with_tensor(cache, "abc") == ["b", "c"]
    assert (len(cache), cache.nbytes, cache.num_evictions) == (3, 200, 1)


def test_a_use_makes_a_tensor_the_most_recent():
    cache = cache_with(150, {"a": 100, "b": 100, "c": 100})
    assert cache.use("a") is cache.get("a").tensor
    assert cache.evict(always) == ["b", "c"]  # 300 -> 200 -> 100
    assert with_tensor(cache, "abc") == ["a"]
    assert (cache.nbytes, cache.num_evictions) == (100, 2)


def test_only_as_many_as_bring_it_under_the_bound():
    cache = cache_with(300, {"a": 400, "b": 100, "c": 100})
    assert cache.evict(always) == ["a"]  # 600 -> 200: b and c stay
    assert (cache.nbytes, cache.num_evictions) == (200, 1)


def test_unrecoverable_images_keep_their_tensors():
    cache = cache_with(100, {"a": 100, "b": 100, "c": 100})
    asked = []

    def recoverable(digest: str) -> bool:
        asked.append(digest)
        return digest != "a"

    assert cache.evict(recoverable) == ["b", "c"]
    assert with_tensor(cache, "abc") == ["a"]
    assert asked == ["a", "b", "c"] and (cache.nbytes, cache.num_evictions) == (100, 2)


def test_kept_digests_are_never_evicted():
    cache = cache_with(100, {"a": 100, "b": 100, "c": 100})
    assert cache.evict(always, keep={"a", "c"}) == ["b"]
    assert with_tensor(cache, "abc") == ["a", "c"]
    assert (cache.nbytes, cache.num_evictions) == (200, 1)  # still over: nothing else may go


def test_nothing_evictable_leaves_it_over_the_bound():
    cache = cache_with(100, {"a": 100, "b": 100})
    assert cache.evict(lambda digest: False) == []
    assert cache.evict(always, keep={"a", "b"}) == []
    assert (cache.nbytes, cache.num_evictions) == (200, 0)


def test_a_re_encoded_tensor_is_the_most_recent_again():
    cache = cache_with(200, {"a": 100, "b": 100, "c": 100})
    assert cache.evict(always) == ["a"]
    cache.store("a", tensor(100), grid=(1, 4, 4))  # re-encoded for a prefill
    assert cache.get("a").grid == (1, 4, 4)
    assert cache.evict(always, keep={"a"}) == ["b"]
    assert with_tensor(cache, "abc") == ["a", "c"]
    assert (cache.nbytes, cache.num_evictions) == (200, 2)


def test_the_last_release_removes_an_evicted_entry():
    cache = cache_with(100, {"a": 100, "b": 100})
    assert cache.evict(always) == ["a"]
    assert cache.release("a") is True
    assert "a" not in cache and len(cache) == 1
    assert cache.evict(always) == []  # b alone is within the bound
    assert (cache.nbytes, cache.num_evictions) == (100, 1)


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        EmbeddingCache(max_bytes=-1)
