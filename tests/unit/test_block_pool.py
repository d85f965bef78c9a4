"""Block pool and KV cache manager: exact white-box assertions."""

from __future__ import annotations

import pytest

from hotprefix.core.block_pool import BlockPool, FreeBlockQueue, IntegrityError
from hotprefix.core.kv_cache_manager import KVCacheManager
from tests.unit.builders import make_request


def test_allocation_takes_from_the_head_in_id_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]
    assert pool.free_queue.block_ids() == [5]
    pool.check_integrity()


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool.free_queue.block_ids()
    assert pool.allocate(2) is None
    assert pool.free_queue.block_ids() == before and pool.num_free_blocks == 1
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_freed_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(5)
    a = pool.allocate(3)
    pool.free(reversed(a))
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    # Next allocation takes the never-used blocks first, then a's tail.
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 2]


def test_manager_frees_a_request_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1, r2 = make_request("r1", 10), make_request("r2", 5)
    assert [b.block_id for b in kv.allocate_slots(r1, 10)] == [0, 1, 2]
    assert [b.block_id for b in kv.allocate_slots(r2, 5)] == [3, 4]
    kv.free(r1)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 2, 1, 0]
    kv.check_integrity()


def test_manager_allocates_only_missing_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("r", 10)
    kv.allocate_slots(r, 3)
    assert kv.block_ids("r") == [0]
    r.num_computed_tokens = 3
    assert kv.allocate_slots(r, 1) == []  # token 4 still fits block 0
    r.num_computed_tokens = 4
    assert [b.block_id for b in kv.allocate_slots(r, 6)] == [1, 2]
    assert kv.blocks_needed(r, 6) == 0


def test_manager_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = make_request("r", 20)
    assert kv.allocate_slots(r, 20) is None
    assert kv.block_ids("r") == [] and kv.pool.num_free_blocks == 3
    kv.check_integrity()


def test_integrity_catches_double_free_and_bad_counts():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(IntegrityError):
        pool.free([b])
    blocks = pool.allocate(2)
    with pytest.raises(IntegrityError):
        pool.check_integrity(held={blocks[0].block_id: 1})  # owners forgot blocks[1]
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()
