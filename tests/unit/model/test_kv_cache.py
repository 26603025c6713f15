"""session/model/kv_cache.py: paged caches over a shared block pool, and static per-session buffers."""

from __future__ import annotations

import os

import pytest
import torch

from session.model.kv_cache import PAD_BLOCK, STATIC_PAD_TOKENS, KVPool, StaticKVCache

LAYERS, HEADS, HEAD_DIM, BLOCK, MAX = 2, 3, 4, 8, 20
LAYOUT = {"head_major": True}  # the layout make_pool builds (the autouse fixture runs every test in both)


@pytest.fixture(autouse=True, params=[True, False], ids=["head-major", "token-major"])
def layout(request):
    LAYOUT["head_major"] = request.param
    yield request.param


def make_pool(dtype: torch.dtype = torch.float32, num_blocks: int = 1, memory_bytes: int | None = None) -> KVPool:
    return KVPool(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
                  device=torch.device("cpu"), block_tokens=BLOCK, num_blocks=num_blocks,
                  head_major=LAYOUT["head_major"], memory_bytes=memory_bytes)


def block_keys(pool: KVPool, layer: int, block: int) -> torch.Tensor:
    """One block's keys in ``layer``, [KVH, block_tokens, hd], a view of the pool in either layout."""
    return pool.run(layer, block, 1, 0, BLOCK)[0]


def make(static: bool = False, dtype: torch.dtype = torch.float32, pool: KVPool | None = None):
    if static:
        return StaticKVCache(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
                             device=torch.device("cpu"), max_tokens=MAX)
    return (pool or make_pool(dtype)).new_cache(MAX)


def fill(cache, start: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    assert (cache.capacity, cache.length, cache.nbytes, cache.block_ids) == (0, 0, 0, [])


def test_capacity_grows_in_whole_blocks():
    cache = make()
    seen = []
    for num_tokens in (1, 8, 9, 16, 17, 20):
        cache.ensure_capacity(num_tokens)
        seen.append(cache.capacity)
    assert seen == [8, 8, 16, 16, 24, 24]  # whole blocks: 20 tokens take 3 blocks
    assert cache.block_ids == [1, 2, 3]  # block 0 is the pool's padding block
    assert PAD_BLOCK == 0


def test_growth_takes_free_blocks_and_never_moves_what_the_session_holds():
    pool = make_pool(num_blocks=8)
    cache = make(pool=pool)
    cache.ensure_capacity(6)
    k, v = fill(cache, 0, 6)
    first_block = block_keys(pool, 1, cache.block_ids[0])
    before = first_block.clone()
    address = first_block.data_ptr()
    cache.ensure_capacity(9)
    assert cache.capacity == 16 and cache.block_ids[0] == 1 and len(cache.block_ids) == 2
    assert block_keys(pool, 1, cache.block_ids[0]).data_ptr() == address  # the same storage, not a copy
    assert torch.equal(block_keys(pool, 1, cache.block_ids[0]), before)
    assert pool.num_grows == 0
    for layer in range(LAYERS):
        assert torch.equal(cache.keys(layer, 6), k[layer])
        assert torch.equal(cache.values(layer, 6), v[layer])
    k2, v2 = fill(cache, 6, 10)  # then keep writing across the block boundary
    assert torch.equal(cache.keys(1, 16), torch.cat([k[1], k2[1]], dim=1))
    assert torch.equal(cache.values(0, 16), torch.cat([v[0], v2[0]], dim=1))


def test_sessions_share_the_pool_and_interleaved_blocks_read_back_in_order():
    pool = make_pool()
    a, b = make(pool=pool), make(pool=pool)
    written = {}
    for start in (0, 8):  # a and b grow in turn: their blocks interleave in the pool
        for cache in (a, b):
            cache.ensure_capacity(start + 8)
            written[id(cache), start] = fill(cache, start, 8)
    assert (a.block_ids, b.block_ids) == ([1, 3], [2, 4])
    for cache in (a, b):
        assert torch.equal(cache.keys(1, 16), torch.cat([written[id(cache), 0][0][1], written[id(cache), 8][0][1]], 1))


def test_runs_are_views_of_each_consecutive_stretch_and_read_back_the_positions():
    """A session whose blocks interleave with another's: runs() returns one view per stretch of consecutive
    blocks, sharing the pool's storage, together equal to the gathered keys for any window."""
    pool = make_pool()
    a, b = make(pool=pool), make(pool=pool)
    a.ensure_capacity(16)  # blocks 1, 2: consecutive
    b.ensure_capacity(8)  # block 3
    a.ensure_capacity(20)  # block 4: after b's
    fill(a, 0, 20)
    assert a.block_ids == [1, 2, 4]
    runs = a.runs(0, 0, 20)
    assert [k.shape[1] for k, _ in runs] == [16, 4]
    assert runs[0][0].data_ptr() == block_keys(pool, 0, 1).data_ptr()
    assert runs[1][0].data_ptr() == block_keys(pool, 0, 4).data_ptr()
    for start, end in ((0, 20), (5, 19), (9, 16), (16, 20), (17, 18)):
        for layer in range(LAYERS):
            runs = a.runs(layer, start, end)
            assert torch.equal(torch.cat([k for k, _ in runs], 1), a.keys(layer, end)[:, start:])
            assert torch.equal(torch.cat([v for _, v in runs], 1), a.values(layer, end)[:, start:])


def test_keys_are_views_when_blocks_are_consecutive():
    cache = make()
    cache.ensure_capacity(12)
    k, _ = fill(cache, 0, 12)
    view = cache.keys(0, 12)
    assert view.shape == (HEADS, 12, HEAD_DIM)
    assert view.data_ptr() == block_keys(cache.pool, 0, 1).data_ptr()
    assert torch.equal(cache.keys(0, 2), k[0, :, :2])


@pytest.mark.parametrize("reserved", [None, 2], ids=["address space reserved", "2 blocks reserved"])
def test_a_pool_without_free_blocks_grows_and_keeps_every_session(reserved):
    """Within the reserved address space growing is bookkeeping (the same tensors); past it, a copy."""
    block_bytes = make_pool().block_nbytes
    pool = make_pool(num_blocks=2, memory_bytes=None if reserved is None else reserved * block_bytes)
    assert pool.capacity == 2 if reserved else pool.capacity > 2  # the machine's memory, reserved
    address = pool.k.data_ptr()
    a, b = make(pool=pool), make(pool=pool)
    a.ensure_capacity(8)
    ka, _ = fill(a, 0, 8)
    b.ensure_capacity(16)  # needs 2 blocks, none free
    kb, _ = fill(b, 0, 16)
    assert pool.num_blocks == 4 and pool.blocks.check([a.block_ids, b.block_ids]) == []
    if reserved is None:
        assert (pool.num_grows, pool.k.data_ptr()) == (0, address)
    else:  # doubled past the 2 blocks: the copy holds 4
        assert (pool.num_grows, pool.capacity) == (1, 4) and pool.k.data_ptr() != address
    assert torch.equal(a.keys(1, 8), ka[1]) and torch.equal(b.keys(0, 16), kb[0])
    c = make(pool=pool)
    c.ensure_capacity(1)  # a block first taken now reads zeros, as torch.zeros' would
    assert not block_keys(pool, 0, c.block_ids[0]).any()


def test_where_the_os_refuses_the_address_space_the_pool_is_zeroed_tensors_and_copies_to_grow(monkeypatch):
    import session.model.kv_pool as kv_pool

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(kv_pool.mmap, "mmap", refuse)
    pool = make_pool(num_blocks=2)
    assert (pool.capacity, pool.num_blocks) == (2, 2)
    a = make(pool=pool)
    a.ensure_capacity(8)
    ka, _ = fill(a, 0, 8)
    make(pool=pool).ensure_capacity(16)
    assert (pool.num_blocks, pool.capacity, pool.num_grows) == (4, 4, 1)
    assert torch.equal(a.keys(0, 8), ka[0])


def test_reserved_address_space_costs_memory_only_where_written():
    """A CPU pool's tensors span the machine's memory, but a page is committed when first written."""
    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident_bytes()
    pool = KVPool(num_layers=24, num_kv_heads=8, head_dim=128, dtype=torch.float32, device=torch.device("cpu"),
                  block_tokens=256, head_major=LAYOUT["head_major"], memory_bytes=8 << 30)
    assert (pool.capacity, pool.num_blocks) == ((8 << 30) // pool.block_nbytes, 1)
    pool.reserve(64)  # 3 GiB of blocks: bookkeeping only
    assert pool.num_blocks == 64 and pool.num_grows == 0
    assert resident_bytes() - before < 64 << 20


def test_release_returns_blocks_for_reuse():
    pool = make_pool(num_blocks=4)
    a = make(pool=pool)
    a.ensure_capacity(20)
    assert pool.blocks.free_ids == []
    a.release()
    assert (a.length, a.capacity, a.nbytes) == (0, 0, 0)
    b = make(pool=pool)
    b.ensure_capacity(3)
    assert b.block_ids == [1] and pool.num_grows == 0


def test_host_copies_round_trip():
    pool = make_pool()
    a = make(pool=pool)
    a.ensure_capacity(13)
    k, v = fill(a, 0, 13)
    host_k, host_v = a.to_host()
    assert host_k.shape == (LAYERS, HEADS, 13, HEAD_DIM) and torch.equal(host_k, k) and torch.equal(host_v, v)
    a.release()
    other = make(pool=pool)
    other.ensure_capacity(8)  # takes a's first block, so the restored cache lies elsewhere
    a.load(host_k, host_v)
    assert a.length == 13 and torch.equal(a.keys(1, 13), k[1]) and torch.equal(a.values(0, 13), v[0])


def test_static_allocates_max_tokens_up_front_and_never_reallocates():
    cache = make(static=True)
    assert cache.capacity == MAX
    assert cache.nbytes == expected_nbytes(MAX + STATIC_PAD_TOKENS)  # and the positions padding rows write
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


def test_crop_forgets_positions_but_keeps_blocks():
    cache = make()
    cache.ensure_capacity(10)
    fill(cache, 0, 10)
    blocks = list(cache.block_ids)
    cache.crop(4)
    assert cache.length == 4
    cache.crop(8)  # cropping never extends
    assert cache.length == 4
    assert cache.capacity == 16 and cache.block_ids == blocks
    assert cache.nbytes == expected_nbytes(16)


def test_static_keeps_its_contents_where_they_are():
    cache = make(static=True)
    k, v = fill(cache, 0, 6)
    assert torch.equal(cache.keys(1, 6), k[1]) and cache.keys(0, 6).data_ptr() == cache.k.data_ptr()
    host_k, host_v = cache.to_host()
    cache.release()
    cache.load(host_k, host_v)
    assert cache.length == 6 and torch.equal(cache.values(0, 6), v[0]) and cache.capacity == MAX


def test_release_of_a_static_cache_frees_its_buffers():
    cache = make(static=True)
    cache.release()
    assert (cache.length, cache.capacity, cache.nbytes) == (0, 0, 0)


def test_a_cpu_pool_is_head_major_and_each_heads_run_is_one_contiguous_stream():
    pool = KVPool(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                  device=torch.device("cpu"), block_tokens=BLOCK)
    assert pool.head_major and pool.k.shape == (LAYERS, HEADS, pool.capacity, BLOCK, HEAD_DIM)
    assert pool.num_blocks == 1 and pool.capacity > 1000  # the machine's memory, reserved
    cache = pool.new_cache(MAX)
    cache.ensure_capacity(20)
    k, _ = fill(cache, 0, 20)
    (keys, _), = cache.runs(1, 0, 20)
    assert keys.shape == (HEADS, 20, HEAD_DIM) and keys.stride()[1:] == (HEAD_DIM, 1)  # tokens, then dims
    assert torch.equal(keys, k[1])


def test_batched_writes_and_gathers_agree_with_per_session_reads():
    """write_rows / gather (the batched attention path) against write / keys (per session), any layout."""
    pool = make_pool()
    a, b = make(pool=pool), make(pool=pool)
    a.ensure_capacity(12)
    b.ensure_capacity(5)
    ka, va = fill(a, 0, 11)
    kb, vb = fill(b, 0, 4)
    # one more token for each row, written as the batched path writes it
    new_k = torch.randn(2, HEADS, 1, HEAD_DIM)
    new_v = torch.randn(2, HEADS, 1, HEAD_DIM)
    slots = torch.tensor([a.slots(11, 12), b.slots(4, 5)])
    pool.write_rows(0, slots, new_k, new_v)
    table = torch.tensor([a.block_ids[:2], b.block_ids[:1] + [PAD_BLOCK]])
    keys, values = pool.gather(0, table)
    assert keys.shape == (2, HEADS, 2 * BLOCK, HEAD_DIM)
    assert torch.equal(keys[0, :, :12], torch.cat([ka[0], new_k[0]], 1))
    assert torch.equal(values[1, :, :5], torch.cat([vb[0], new_v[1]], 1))
    assert torch.equal(a.keys(0, 12), keys[0, :, :12]) and torch.equal(b.values(0, 5), values[1, :, :5])


def test_a_pass_sends_its_slots_to_the_device_once_and_a_changed_table_gets_new_ones(monkeypatch):
    import session.model.kv_cache as kv_cache

    sent = []
    original = kv_cache.to_device
    monkeypatch.setattr(kv_cache, "to_device", lambda values, device: sent.append(list(values)) or
                        original(values, device))
    pool = make_pool(num_blocks=4)
    cache, other = make(pool=pool), make(pool=pool)
    cache.ensure_capacity(10)
    fill(cache, 0, 10)  # one pass over both layers
    assert len(sent) == 1 and sent[0] == cache.slots(0, 10)
    first_table = list(cache.block_ids)
    cache.release()
    other.ensure_capacity(8)  # takes the lowest free block: the table below differs
    cache.ensure_capacity(10)
    assert cache.block_ids != first_table
    k2, v2 = fill(cache, 0, 10)  # the same positions over other blocks: new slots
    assert len(sent) == 2 and sent[1] == cache.slots(0, 10)
    fill(cache, 0, 10)  # the same positions over the same blocks: the slots already sent
    assert len(sent) == 2
    assert torch.equal(cache.keys(1, 10), k2[1]) and torch.equal(cache.values(0, 10), v2[0])


def test_host_copies_of_interleaved_blocks_round_trip():
    pool = make_pool(num_blocks=6)
    a, b = pool.new_cache(64), pool.new_cache(64)
    for step in range(3):  # a's and b's blocks alternate: no two of a's are consecutive
        a.ensure_capacity(BLOCK * (step + 1))
        b.ensure_capacity(BLOCK * (step + 1))
    assert all(second != first + 1 for first, second in zip(a.block_ids, a.block_ids[1:]))
    k, v = fill(a, 0, 2 * BLOCK + 3)
    host_k, host_v = a.to_host()
    assert torch.equal(host_k, k) and torch.equal(host_v, v)
    b.release()
    c = pool.new_cache(64)
    c.ensure_capacity(4 * BLOCK)  # consecutive blocks: one run
    kc, vc = fill(c, 0, 3 * BLOCK + 1)
    assert [torch.equal(t, want) for t, want in zip(c.to_host(), (kc, vc))] == [True, True]
