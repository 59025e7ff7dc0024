import pytest

from scheduler import AllocStatus, BlockPool


def test_block_zero_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.allocate_many(4)
    assert sorted(blocks) == [1, 2, 3, 4] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()
    pool.check_integrity()


def test_can_allocate_ok_later_never():
    pool = BlockPool(5)  # 4 usable
    assert pool.can_allocate(4) is AllocStatus.OK
    assert pool.can_allocate(5) is AllocStatus.NEVER
    pool.allocate()
    assert pool.can_allocate(4) is AllocStatus.LATER
    assert pool.can_allocate(3) is AllocStatus.OK


def test_reference_counts_and_pin():
    pool = BlockPool(4)
    block = pool.allocate()
    pool.pin(block)
    pool.free(block)
    assert pool.ref_counts[block] == 1 and pool.num_free == 2
    pool.free(block)
    assert pool.ref_counts[block] == 0 and pool.num_free == 3
    with pytest.raises(RuntimeError, match="cannot pin free"):
        pool.pin(block)
    with pytest.raises(ValueError, match="outside"):
        pool.pin(0)
    pool.check_integrity()


def test_usage_counts_planned_blocks():
    pool = BlockPool(11)
    pool.allocate_many(3)
    assert pool.usage() == pytest.approx(0.3)
    assert pool.usage(num_planned=2) == pytest.approx(0.5)


def test_cached_blocks_stay_until_evicted_lru():
    pool = BlockPool(4)
    evicted = []
    pool.on_evict = evicted.append
    a, b, c = pool.allocate_many(3)
    pool.mark_cached(a)
    pool.mark_cached(b)
    pool.free(a)
    pool.free(b)
    pool.free(c)
    assert pool.num_free == 3 and pool.is_evictable(a) and pool.is_evictable(b)
    assert pool.allocate() == c  # truly free blocks go first
    assert pool.allocate() == a and evicted == [a]  # then the least recently released
    pool.pin(b)  # a cached block can be revived
    assert not pool.is_evictable(b) and pool.num_free == 0
    pool.check_integrity()


def test_integrity_check_catches_corruption():
    pool = BlockPool(4)
    block = pool.allocate()
    pool.ref_counts[block] = 0  # leaked: neither free nor held
    with pytest.raises(AssertionError, match=f"block {block}"):
        pool.check_integrity()


def test_too_small_pool_is_an_error():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)
