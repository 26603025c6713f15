"""Shared KV blocks: content keys, ref counts, lookup, publish, copy-on-write, idle eviction, the
pool's invariant, and the memory manager evicting idle blocks before it demotes any session."""

from __future__ import annotations

import pytest
import torch

from session.errors import CapacityExceeded
from session.model.kv_cache import KVPool, PoolAccounts
from session.model.prefix_cache import block_keys
from session.state.memory import MemoryManager
from session.state.session import SessionState, Tier
from session.state.store import SessionStore

IMAGE = 9


def pool(num_blocks: int = 1, block_tokens: int = 4) -> KVPool:
    return KVPool(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device=torch.device("cpu"),
                  block_tokens=block_tokens, num_blocks=num_blocks)


def fill(kv, tokens: list[int]) -> None:
    """Write ``tokens`` as the cache's keys and values from its length on (what the fake runner does)."""
    start = kv.length
    kv.ensure_capacity(start + len(tokens))
    value = torch.tensor(tokens, dtype=torch.float64)[None, :, None]
    kv.write(0, start, value, value)
    kv.length = start + len(tokens)


def stored(kv) -> list[int]:
    return [int(x) for x in kv.keys(0, kv.length)[0, :, 0].tolist()]


def sharing_pair(p: KVPool):
    """An owner that wrote and published 8 tokens (2 blocks), and another cache holding both blocks."""
    owner = p.new_cache(64)
    fill(owner, list(range(8)))
    owner.publish(block_keys(list(range(8)), 4))
    other = p.new_cache(64)
    other.share_prefix(block_keys(list(range(8)) + [1], 4))
    return owner, other


# ---------------------------------------------------------------- keys


def test_keys_chain_over_tokens_and_leave_the_partial_block_out():
    keys = block_keys(list(range(10)), 4)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert block_keys(list(range(8)), 4) == keys  # block 1's key depends only on tokens 0..7
    other = block_keys([0, 1, 2, 3, 4, 5, 6, 99], 4)
    assert other[0] == keys[0] and other[1] != keys[1]
    assert block_keys([0, 1, 2, 99, 4, 5, 6, 7], 4)[1] != keys[1]  # a change in block 0 changes block 1's key


def test_keys_tell_adapters_and_images_apart():
    ids = [1, 2, IMAGE, IMAGE, IMAGE, 3, 4, 5]
    a = block_keys(ids, 4, image_token_id=IMAGE, image_digests=["a"], image_counts=[3])
    b = block_keys(ids, 4, image_token_id=IMAGE, image_digests=["b"], image_counts=[3])
    assert a[0] != b[0] and a[1] != b[1]  # the image begins in block 0: every key from there differs
    assert block_keys(ids, 4, salt=b"adapter:x#1", image_token_id=IMAGE, image_digests=["a"],
                      image_counts=[3]) != a
    # two images, placeholders adjacent: the split between them is part of the content
    two = [1, IMAGE, IMAGE, IMAGE, IMAGE, 2, 3, 4]
    split_a = block_keys(two, 4, image_token_id=IMAGE, image_digests=["a", "b"], image_counts=[1, 3])
    split_b = block_keys(two, 4, image_token_id=IMAGE, image_digests=["a", "b"], image_counts=[3, 1])
    assert split_a[1] != split_b[1]
    # counts that do not add up to the placeholders (an image of unknown count): nothing to share
    assert block_keys(ids, 4, image_token_id=IMAGE, image_digests=["a"], image_counts=[2]) == []
    assert block_keys(ids, 4, image_token_id=IMAGE) == []


# ---------------------------------------------------------------- sharing


def test_a_published_prefix_is_shared_once_and_written_past_only():
    p = pool()
    first = p.new_cache(64)
    fill(first, list(range(10)))
    keys = block_keys(list(range(10)), 4)
    assert first.publish(keys) == 2
    second = p.new_cache(64)
    assert second.share_prefix(block_keys(list(range(8)) + [50, 51], 4)) == 8
    assert second.block_ids == first.block_ids[:2]
    fill(second, [50, 51])
    assert stored(second) == list(range(8)) + [50, 51]
    assert stored(first) == list(range(10))  # the sharer's writes never reached the first cache
    assert p.blocks.usage() == {"pinned": 2, "shared": 2, "cached": 0}  # 2 shared + first's tail + second's tail
    assert p.blocks.check([first.block_ids, second.block_ids]) == []


def test_released_published_blocks_go_idle_and_are_found_again_then_evicted_tail_first():
    p = pool()
    kv = p.new_cache(64)
    tokens = list(range(12))
    fill(kv, tokens)
    kv.publish(block_keys(tokens, 4))
    kv.release()
    assert p.blocks.usage() == {"pinned": 0, "shared": 0, "cached": 3} and p.blocks.num_held == 0
    assert p.blocks.check([]) == []
    assert p.evict_idle_bytes(p.block_nbytes) == p.block_nbytes  # the chain's last block goes first
    again = p.new_cache(64)
    assert again.share_prefix(block_keys(tokens, 4)) == 8
    assert stored(again) == tokens[:8]
    assert p.blocks.check([again.block_ids]) == []


def test_crop_into_a_shared_block_copies_it_first():
    p = pool()
    owner, other = sharing_pair(p)
    assert other.length == 8
    other.crop(6)  # a rollback into block 1, which the owner also holds
    assert other.block_ids[0] == owner.block_ids[0] and other.block_ids[1] != owner.block_ids[1]
    fill(other, [70, 71])
    assert stored(other) == [0, 1, 2, 3, 4, 5, 70, 71]
    assert stored(owner) == list(range(8))
    assert p.blocks.check([owner.block_ids, other.block_ids]) == []
    # a published block a cache holds alone is not written either: crop gives it back (still published)
    owner.crop(4)
    assert len(owner.block_ids) == 1 and p.blocks.check([owner.block_ids, other.block_ids]) == []


def test_the_idle_cap_and_a_fixed_pool_evict_rather_than_grow():
    p = pool(num_blocks=4)  # 3 usable blocks
    p.blocks.fixed = True
    kv = p.new_cache(64)
    fill(kv, list(range(12)))
    kv.publish(block_keys(list(range(12)), 4))
    kv.release()
    taken = p.new_cache(64)
    fill(taken, [1, 2, 3, 4, 5])  # 2 blocks: evicts the 2 least recently used idle ones, no growth
    assert p.num_blocks == 4 and p.blocks.prefix.num_evicted == 2 and p.blocks.usage()["cached"] == 1
    capped = pool()
    capped.blocks.prefix.max_idle_blocks = 1
    kv = capped.new_cache(64)
    fill(kv, list(range(12)))
    kv.publish(block_keys(list(range(12)), 4))
    kv.release()
    assert capped.blocks.usage()["cached"] == 1 and capped.blocks.check([]) == []


def test_the_pool_check_finds_a_wrong_ref_count():
    p = pool()
    kv = p.new_cache(64)
    fill(kv, [1, 2, 3, 4, 5])
    p.blocks.refs[kv.block_ids[0]] += 1
    assert p.blocks.check([kv.block_ids]) != []


def test_the_memory_manager_evicts_idle_blocks_before_it_demotes_a_session():
    p = pool()
    store = SessionStore(ttl_s=100, max_sessions=8, clock=lambda: 0.0)
    memory = MemoryManager(device_budget_bytes=4 * p.block_nbytes, host_budget_bytes=1 << 20, store=store,
                           blocks=PoolAccounts([p]))
    resident = store.open(SessionState(session_id="a", kv=p.new_cache(64), created_at=0, expires_at=100,
                                       tier=Tier.DEVICE))
    fill(resident.kv, [1, 2, 3, 4, 5])  # 2 blocks, held
    gone = p.new_cache(64)
    fill(gone, [9, 9, 9, 9, 8, 8, 8, 8])
    gone.publish(block_keys([9, 9, 9, 9, 8, 8, 8, 8], 4))
    gone.release()  # 2 idle blocks: the budget (4) is full
    assert memory.device_bytes == 2 * p.block_nbytes and memory.idle_bytes == 2 * p.block_nbytes
    newcomer = store.open(SessionState(session_id="b", kv=p.new_cache(64), created_at=0, expires_at=100,
                                       tier=Tier.DEVICE))
    memory.reserve(newcomer, p.block_nbytes)
    assert resident.tier is Tier.DEVICE and memory.num_to_host == 0  # the session stayed
    assert memory.idle_bytes == p.block_nbytes and p.blocks.prefix.num_evicted == 1
    memory.reserve(newcomer, 3 * p.block_nbytes)  # now idle blocks are not enough: the session is demoted
    assert memory.idle_bytes == 0 and resident.tier is Tier.HOST


def test_a_session_restored_from_the_host_tier_shares_the_published_prefix_and_copies_the_rest():
    p = pool(num_blocks=2)
    tokens = list(range(100, 111))  # 11 tokens: blocks 0 and 1 full, 3 in a third
    keys = block_keys(tokens, 4)
    other = p.new_cache(16)
    fill(other, tokens[:8])
    other.publish(keys)
    demoted = p.new_cache(16)
    fill(demoted, tokens[:10])
    k, v = demoted.to_host()
    demoted.release()  # demoted: only its host copy is left
    restored = p.new_cache(16)
    restored.ensure_capacity(16)  # what the turn reserved before the restore
    assert restored.load(k, v, keys) == 8  # two blocks shared, two tokens copied
    assert restored.block_ids[:2] == other.block_ids and restored.length == 10
    assert stored(restored) == tokens[:10] and p.blocks.usage()["shared"] == 2
    assert p.blocks.check([other.block_ids, restored.block_ids]) == []
    plain = p.new_cache(16)
    assert plain.load(k, v) == 0 and stored(plain) == tokens[:10]  # without keys: all copied
    assert set(plain.block_ids).isdisjoint(other.block_ids)


def test_a_full_fixed_pool_refuses_rather_than_grows():
    p = pool(num_blocks=3)  # 2 usable blocks
    p.blocks.fixed = True
    kv = p.new_cache(64)
    fill(kv, [1, 2, 3, 4, 5])
    with pytest.raises(CapacityExceeded, match="KV block pool is full") as refused:
        p.new_cache(64).ensure_capacity(1)
    assert refused.value.headers == {"Retry-After": "1"}
    assert (p.num_blocks, p.num_grows, p.blocks.available) == (3, 0, 0) and p.blocks.check([kv.block_ids]) == []
    unfixed = pool(num_blocks=3)  # no budget (CPU): grows instead
    fill(unfixed.new_cache(64), [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert unfixed.num_blocks == 6 and unfixed.num_grows == 0  # within its reserved address space: no copy


def test_crop_into_a_shared_block_of_a_full_fixed_pool_ends_before_it():
    """No block to copy the kept positions into: the cache ends at the block before (never grows)."""
    p = pool(num_blocks=3)
    p.blocks.fixed = True
    owner, other = sharing_pair(p)
    other.crop(6)
    assert (other.length, other.block_ids, p.num_blocks) == (4, owner.block_ids[:1], 3)
    assert stored(other) == [0, 1, 2, 3] and stored(owner) == list(range(8))
    assert p.blocks.check([owner.block_ids, other.block_ids]) == []


def test_the_memory_manager_makes_room_in_each_fixed_pool():
    """A target pool and a draft pool reserved side by side fill at their own pace (image tokens are
    the target's only): a turn that fits the byte budget but not the target's pool demotes a session."""
    target, draft = pool(num_blocks=4), pool(num_blocks=4)  # 3 usable blocks each
    target.blocks.fixed = draft.blocks.fixed = True
    store = SessionStore(ttl_s=100, max_sessions=8, clock=lambda: 0.0)
    memory = MemoryManager(device_budget_bytes=6 * target.block_nbytes, host_budget_bytes=1 << 20, store=store,
                           blocks=PoolAccounts([target, draft]))
    resident = store.open(SessionState(session_id="a", kv=target.new_cache(64), created_at=0, expires_at=100,
                                       tier=Tier.DEVICE))
    resident.draft_kv = draft.new_cache(64)
    fill(resident.kv, list(range(9)))  # 3 target blocks (an image's tokens among them)
    fill(resident.draft_kv, [1])  # 1 draft block (its text)
    newcomer = store.open(SessionState(session_id="b", kv=target.new_cache(64), created_at=0, expires_at=100,
                                       tier=Tier.DEVICE))
    memory.reserve(newcomer, 2 * target.block_nbytes, [(draft, 2)])  # 4 + 2 of 6 bytes' worth: both fit
    assert resident.tier is Tier.DEVICE
    memory.reserve(newcomer, target.block_nbytes, [(target, 1)])  # 4 + 1 bytes fit, the target's pool does not
    assert resident.tier is Tier.HOST and target.blocks.available == 3 and draft.blocks.available == 3
    assert (target.num_grows, draft.num_grows) == (0, 0)
    with pytest.raises(CapacityExceeded):  # more than a pool holds, with no session left to demote
        memory.reserve(newcomer, target.block_nbytes, [(target, 4)])


def test_crop_on_a_full_fixed_pool_copies_into_a_block_it_gives_back():
    """The rollback's own private tail frees a block first: the kept positions are copied, not lost."""
    p = pool(num_blocks=4)  # 3 usable blocks
    p.blocks.fixed = True
    owner, other = sharing_pair(p)
    fill(other, [50, 51, 52])  # a private third block: the pool is full
    assert p.blocks.available == 0
    other.crop(6)
    assert other.length == 6 and stored(other) == [0, 1, 2, 3, 4, 5] and stored(owner) == list(range(8))
    assert other.block_ids[0] == owner.block_ids[0] and other.block_ids[1] not in owner.block_ids
    assert p.num_blocks == 4 and p.blocks.check([owner.block_ids, other.block_ids]) == []


def test_a_restore_sharing_a_prefix_keeps_the_capacity_its_turn_reserved():
    p = pool(num_blocks=16)
    p.blocks.fixed = True
    kv = p.new_cache(64)
    fill(kv, list(range(10)))
    kv.publish(block_keys(list(range(10)), 4))
    host = kv.to_host()
    restored = p.new_cache(64)
    restored.ensure_capacity(20)  # what the memory manager made room for: the turn's whole length
    assert restored.load(*host, keys=block_keys(list(range(10)), 4)) == 8
    assert restored.capacity == 20 and restored.length == 10 and stored(restored) == list(range(10))
