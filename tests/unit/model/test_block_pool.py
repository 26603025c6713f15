"""The block pool's bookkeeping without a tensor: ids, ref counts, the free list, publishing,
idle blocks and eviction, settling behind a host copy, and the invariant under random schedules."""

import random
import subprocess
import sys

import pytest

from session.model.block_pool import PAD_BLOCK, BlockPool
from session.model.prefix_cache import block_keys


class FakeCopies:
    """A host copy that is in flight until ``done``; ``wait`` finishes it."""

    def __init__(self):
        self.in_flight = False
        self.waits = 0

    def pending(self) -> bool:
        return self.in_flight

    def wait(self) -> None:
        self.waits += 1
        self.in_flight = False


def test_the_module_imports_no_torch():
    code = "import sys, session.model.block_pool; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_take_hands_out_the_lowest_free_ids_once_each_and_never_the_padding_block():
    pool = BlockPool(6)
    assert (pool.num_blocks, pool.num_free, pool.available) == (6, 5, 5)
    assert pool.take(2) == [1, 2] and pool.take(3) == [3, 4, 5]
    assert (pool.num_held, pool.num_free, pool.refs) == (5, 0, [0, 1, 1, 1, 1, 1])
    pool.free([2, 4])
    assert pool.take(2) == [2, 4] and pool.check([[1, 2, 3, 4, 5]]) == []


def test_a_pool_that_may_grow_reports_its_shortfall_and_a_fixed_one_refuses():
    pool = BlockPool(3)
    assert pool.shortfall(5) == 3 and pool.can_take(5)
    pool.grow(6)
    assert pool.shortfall(5) == 0 and pool.take(5) == [1, 2, 3, 4, 5]
    fixed = BlockPool(3)
    fixed.fixed = True
    assert not fixed.can_take(3) and fixed.can_take(2)
    with pytest.raises(AssertionError):
        fixed.take(3)


def test_grown_ids_are_taken_after_the_old_free_ones():
    pool = BlockPool(3)
    assert pool.take(1) == [1]
    pool.grow(5)
    assert pool.take(3) == [2, 3, 4] and pool.check([[1, 2, 3, 4]]) == []


def test_a_published_block_goes_idle_is_found_again_and_is_evicted_least_recent_first():
    pool = BlockPool(5)
    keys = block_keys(list(range(12)), 4)
    table = pool.take(3)
    assert pool.publish(table, keys) == 3 and pool.publish(table, keys) == 0
    pool.free(table)
    assert pool.usage() == {"pinned": 0, "shared": 0, "cached": 3} and pool.num_free == 1
    assert pool.lookup(keys[:2]) == table[:2] and pool.prefix.num_hit_blocks == 2
    assert pool.usage() == {"pinned": 2, "shared": 0, "cached": 1}
    assert pool.evict(5) == [table[2]] and pool.prefix.num_evicted == 1
    assert pool.check([table[:2]]) == []


def test_a_fixed_pool_evicts_idle_blocks_for_a_take_and_counts_them_available():
    pool = BlockPool(4)
    pool.fixed = True
    table = pool.take(3)
    pool.publish(table, block_keys(list(range(12)), 4))
    pool.free(table)
    assert pool.available == 3 and pool.num_free == 0
    taken = pool.take(2)
    assert sorted(taken) == sorted(table[1:])  # the tail went idle first: evicted first
    assert list(pool.prefix.key_of) == [table[0]] and pool.check([taken]) == []


def test_sharing_counts_holders_and_is_shared_says_who_may_not_write():
    pool = BlockPool(4)
    [block] = pool.take(1)
    assert not pool.is_shared(block)
    pool.publish([block], block_keys([1, 2, 3, 4], 4))
    assert pool.is_shared(block)  # published: another cache may look it up
    assert pool.lookup(block_keys([1, 2, 3, 4], 4)) == [block]
    assert (pool.refs[block], pool.num_shared, pool.usage()["shared"]) == (2, 1, 1)
    pool.free([block])
    assert (pool.refs[block], pool.num_shared) == (1, 0)


def test_blocks_given_back_during_a_host_copy_settle_until_it_is_done():
    copies = FakeCopies()
    pool = BlockPool(5, copies=copies)
    table = pool.take(2)
    copies.in_flight = True
    pool.free(table)
    assert sorted(pool.settling) == [1, 2]
    assert pool.num_free == 4 and pool.take(2) == [3, 4] and copies.waits == 0  # the never-copied ones first
    assert sorted(pool.take(2)) == [1, 2] and copies.waits == 1  # then the host waits for the copy
    assert pool.settling == [] and pool.check([[3, 4], [1, 2]]) == []


def test_check_names_a_wrong_count():
    pool = BlockPool(4)
    table = pool.take(2)
    pool.refs[table[0]] += 1
    assert pool.check([table]) == [f"block {table[0]}: 2 refs, 1 holders"]


def test_a_random_schedule_keeps_the_invariant():
    """Caches take, share, publish, crop and free blocks in a random order; the pool's invariant holds
    after every operation and every block is accounted for."""
    rng = random.Random(7)
    pool = BlockPool(9)
    pool.fixed = True
    tables: list[list[int]] = [[] for _ in range(4)]
    for _ in range(2000):
        index = rng.randrange(len(tables))
        table = tables[index]
        op = rng.choice(["take", "share", "publish", "crop", "free", "evict"])
        if op == "take":
            want = rng.randint(1, 3)
            if pool.can_take(want):
                table += pool.take(want)
        elif op == "share" and not table:
            tokens = [rng.randrange(3) for _ in range(8)]
            table += pool.lookup(block_keys(tokens, 4))
        elif op == "publish" and table:
            tokens = [rng.randrange(3) for _ in range(4 * len(table))]
            pool.publish(table, block_keys(tokens, 4))
        elif op == "crop" and table:
            keep = rng.randrange(len(table))
            pool.free(table[keep:])
            del table[keep:]
        elif op == "free":
            pool.free(table)
            table.clear()
        elif op == "evict":
            pool.evict(rng.randint(1, 2))
        assert pool.check(tables) == [], op
        assert PAD_BLOCK not in pool.free_ids
