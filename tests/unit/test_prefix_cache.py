"""Automatic prefix caching, white-box: which blocks each request gets, the free
queue order, what is evicted next, partial blocks, the last-token cap, salts,
pins, reset and stats."""

from __future__ import annotations

import pytest

from hotprefix.config import SchedulerConfig
from hotprefix.core.hashing import BlockHasher, CacheScope, make_hash_fn, root_hash
from hotprefix.core.kv_cache_manager import KVCacheManager, PinError
from hotprefix.core.outputs import ModelRunnerOutput
from hotprefix.core.request import RequestStatus
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request

BS = 4
SYS = list(range(1000, 1012))  # a 12-token "system prompt": exactly 3 blocks


def sched(num_blocks=16, budget=64, **kv_kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                     KVCacheManager(num_blocks, BS, **kv_kw))


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    s.update(out, ModelRunnerOutput({r.request_id: token for r in out.requests if r.sample}))
    s.kv.check_integrity()
    s.check_integrity()
    return out


def run_to_end(s: Scheduler):
    while s.has_unfinished():
        run_step(s)


def plan(out):
    return [(r.request_id, r.start_pos, len(r.token_ids), r.block_ids) for r in out.requests]


def test_second_request_shares_the_prefix_blocks():
    s = sched()
    s.add_request(make_request("a", 0, prompt=SYS + [1, 2], max_tokens=1))
    out = run_step(s)
    assert plan(out) == [("a", 0, 14, [0, 1, 2, 3])]
    s.add_request(make_request("b", 0, prompt=SYS + [5, 6, 7], max_tokens=1))
    out = run_step(s)
    # a finished and released its blocks; b hits the 3 full prefix blocks and
    # gets a fresh block for its own tail. Blocks 4.. are never-used, so the
    # head of the free queue is block 4.
    assert plan(out) == [("b", 12, 3, [0, 1, 2, 4])]
    assert s.requests == {} and s.kv.pool.free_queue.block_ids()[:1] == [5]


def test_requests_in_the_same_step_hit_blocks_that_fill_in_that_step():
    s = sched()
    s.add_request(make_request("a", 0, prompt=SYS + [1], max_tokens=2))
    s.add_request(make_request("b", 0, prompt=SYS + [2], max_tokens=2))
    out = run_step(s)
    assert plan(out) == [("a", 0, 13, [0, 1, 2, 3]), ("b", 12, 1, [0, 1, 2, 4])]
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 2, 1, 1]
    assert s.requests["b"].num_cached_tokens == 12 and s.requests["a"].num_cached_tokens == 0


def test_free_queue_order_and_lru_eviction():
    s = sched(num_blocks=6)
    s.add_request(make_request("a", 0, prompt=list(range(8)) + [99], max_tokens=1))  # blocks 0,1,(2 partial)
    run_to_end(s)
    # a released tail first: 2 (partial, uncached), 1, 0 behind never-used 3, 4, 5.
    assert s.kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert [s.kv.pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    # A miss needing 5 blocks takes 3, 4, 5, 2 and then evicts block 1 (a's second block) first.
    s.add_request(make_request("c", 18, max_tokens=1))
    out = run_step(s)
    assert plan(out)[0][3] == [3, 4, 5, 2, 1]
    assert s.kv.make_stats().evicted_blocks == 1
    # a's first block is still cached: a repeat of a's first 4 tokens + more hits it.
    s.add_request(make_request("d", 0, prompt=list(range(4)) + [50, 51], max_tokens=1))
    out = run_step(s)
    assert plan(out) == [("d", 4, 2, [0, 1])]  # block 1 came back free (c finished) and is reused


def test_a_hit_removes_the_block_from_the_middle_of_the_free_queue():
    s = sched(num_blocks=8)
    s.add_request(make_request("a", 0, prompt=SYS + [1], max_tokens=1))
    run_to_end(s)
    assert s.kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    s.add_request(make_request("b", 0, prompt=SYS[:8] + [9, 9, 9], max_tokens=2))
    run_step(s)
    assert s.kv.pool.free_queue.block_ids() == [5, 6, 7, 3, 2]  # 1 and 0 were hits; 4 is b's tail


def test_partial_blocks_are_never_cached():
    s = sched()
    s.add_request(make_request("a", 0, prompt=list(range(7)), max_tokens=1))
    run_to_end(s)
    assert s.kv.pool.num_cached_blocks == 1  # 7 prompt tokens + 0 computed outputs: one full block
    s.add_request(make_request("b", 0, prompt=list(range(7)) + [8], max_tokens=1))
    out = run_step(s)
    assert plan(out)[0][1] == 4  # only the full block hits


def test_hits_are_capped_so_the_last_prompt_token_is_computed():
    s = sched()
    s.add_request(make_request("a", 0, prompt=SYS, max_tokens=1))
    run_to_end(s)
    assert s.kv.pool.num_cached_blocks == 3
    s.add_request(make_request("b", 0, prompt=SYS, max_tokens=1))  # an identical 12-token prompt
    out = run_step(s)
    # 12 tokens, all 3 blocks cached, but at most 11 tokens may come from cache: 2 blocks.
    assert plan(out) == [("b", 8, 4, [0, 1, 3])]  # block 3: head of the free queue
    assert s.kv.make_stats().hits == 8


def test_output_blocks_become_cached_as_they_fill():
    s = sched()
    s.add_request(make_request("a", 0, prompt=[1, 2, 3], max_tokens=6))
    run_to_end(s)  # tokens: 1 2 3 7 | 7 7 7 7 | 7 (the last output is never computed)
    assert s.kv.pool.num_cached_blocks == 2
    s.add_request(make_request("b", 0, prompt=[1, 2, 3, 7, 7, 7, 7, 7, 5], max_tokens=1))
    assert plan(run_step(s))[0][1] == 8


def test_salts_isolate_and_offset_salts_share_the_public_part():
    s = sched(num_blocks=32)
    user = [5, 6, 7, 8, 9]
    s.add_request(make_request("t1", 0, prompt=SYS + user, cache_scope=CacheScope("tenant-1"), max_tokens=1))
    run_to_end(s)
    # Same tokens, other salt: no hit at all.
    s.add_request(make_request("t2", 0, prompt=SYS + user, cache_scope=CacheScope("tenant-2"), max_tokens=1))
    assert plan(run_step(s))[0][1] == 0
    # Same salt: hits.
    s.add_request(make_request("t1b", 0, prompt=SYS + user, cache_scope=CacheScope("tenant-1"), max_tokens=1))
    assert plan(run_step(s))[0][1] == 16
    # No salt: no hit on salted blocks.
    s.add_request(make_request("anon", 0, prompt=SYS + user, max_tokens=1))
    assert plan(run_step(s))[0][1] == 0
    # Public system prompt: salt from offset 12 (block 3) on. Two tenants share blocks 0-2 only.
    s.add_request(make_request("p1", 0, prompt=SYS + user, cache_scope=CacheScope("A", 12), max_tokens=1))
    p1 = plan(run_step(s))[0]
    s.add_request(make_request("p2", 0, prompt=SYS + user, cache_scope=CacheScope("B", 12), max_tokens=1))
    p2 = plan(run_step(s))[0]
    assert p1[1] == 12 and p2[1] == 12  # both hit the unsalted SYS blocks left by "anon"
    assert p1[3][:3] == p2[3][:3] and p1[3][3] != p2[3][3]
    # An offset inside a block rounds down: offset 13 salts block 3 as well.
    h13 = BlockHasher(BS).hashes_of(SYS + user, CacheScope("A", 13))
    h12 = BlockHasher(BS).hashes_of(SYS + user, CacheScope("A", 12))
    assert h13 == h12


def test_hashes_are_identical_across_instances_for_sha256_only():
    toks = list(range(40))
    a, b = BlockHasher(16, "sha256"), BlockHasher(16, "sha256")
    assert a.hashes_of(toks, CacheScope("s", 16)) == b.hashes_of(toks, CacheScope("s", 16))
    assert len(a.hashes_of(toks)) == 2
    # Chained: the second block's hash depends on the first block's tokens.
    other = [99] + toks[1:]
    assert a.hashes_of(other)[1] != a.hashes_of(toks)[1]
    # The root is fixed; a known value guards against accidental changes to the encoding.
    assert root_hash("sha256").hex()[:16] == root_hash("sha256").hex()[:16]
    h = make_hash_fn("sha256")(root_hash("sha256"), [1, 2, 3], ())
    assert len(h) == 32
    x1, x2 = BlockHasher(16, "xxhash"), BlockHasher(16, "xxhash")
    assert x1.hashes_of(toks) == x1.hashes_of(toks)
    assert x1.hashes_of(toks) != x2.hashes_of(toks)  # seeded randomly per instance
    with pytest.raises(ValueError, match="sha256 or xxhash|must be one of"):
        make_hash_fn("md5")


def test_caching_off_shares_nothing():
    s = sched(enable_caching=False)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 0, prompt=SYS + [1], max_tokens=1))
        out = run_step(s)
        assert plan(out)[0][1] == 0
    assert s.kv.pool.num_cached_blocks == 0


def test_pins_survive_eviction_and_are_capped():
    s = sched(num_blocks=10, max_pinned_fraction=0.5)  # at most 5 pinned blocks
    kv = s.kv
    s.add_request(make_request("a", 0, prompt=SYS + [1], max_tokens=1))
    run_to_end(s)
    hashes = kv.hasher.hashes_of(SYS)
    assert kv.pin(hashes) == 3 and kv.num_pinned_blocks == 3
    assert kv.pin(hashes) == 0  # idempotent
    assert kv.pin(hashes[:2]) == 0  # a shorter prefix of pinned blocks adds no pinned block
    assert [kv.pool.blocks[i].pin_cnt for i in range(3)] == [2, 2, 1]
    # Fill the whole pool with a miss: pinned blocks are not evictable.
    assert kv.pool.num_free_blocks == 7
    s.add_request(make_request("big", 27, max_tokens=1))
    run_to_end(s)
    assert all(kv.pool.lookup(h) is not None for h in hashes)
    # A prefix that is not cached cannot be pinned; nor beyond the cap.
    with pytest.raises(PinError, match="not in the cache"):
        kv.pin(kv.hasher.hashes_of(list(range(500, 512))))
    s.add_request(make_request("c", 0, prompt=list(range(600, 612)) + [1], max_tokens=1))
    run_to_end(s)
    with pytest.raises(PinError, match="exceed the limit of 5"):
        kv.pin(kv.hasher.hashes_of(list(range(600, 612))))
    assert kv.unpin(hashes[:2]) == 0 and kv.unpin(hashes) == 3
    assert kv.num_pinned_blocks == 0 and kv.unpin(hashes) == 0
    kv.check_integrity()


def test_pin_prefix_request_option_pins_its_prompt_blocks():
    s = sched()
    s.add_request(make_request("a", 0, prompt=SYS + [1, 2], max_tokens=3, pin_prefix=True))
    run_to_end(s)
    assert s.kv.num_pinned_blocks == 3
    assert s.kv.pool.num_free_blocks == 16 - 3


def test_reset_drops_unreferenced_cached_blocks_only():
    s = sched()
    s.add_request(make_request("a", 0, prompt=SYS + [1], max_tokens=1))
    run_to_end(s)
    s.add_request(make_request("b", 0, prompt=list(range(300, 309)), max_tokens=5))
    run_step(s)  # b holds 2 full cached blocks while running
    assert s.kv.pool.num_cached_blocks == 5
    assert s.kv.reset_prefix_cache() == 3
    assert s.kv.pool.num_cached_blocks == 2
    s.add_request(make_request("c", 0, prompt=SYS + [1], max_tokens=1))
    assert [p[:3] for p in plan(run_step(s))] == [("b", 9, 1), ("c", 0, 13)]  # c misses entirely


def test_stats_count_tokens_and_reset_on_read():
    s = sched()
    s.add_request(make_request("a", 0, prompt=SYS + [1], max_tokens=1))
    run_to_end(s)
    s.add_request(make_request("b", 0, prompt=SYS + [2, 3], max_tokens=1))
    run_to_end(s)
    st = s.kv.make_stats()
    assert (st.requests, st.queries, st.hits) == (2, 13 + 14, 12)
    assert st.cached_blocks == 3 and st.pinned_blocks == 0 and st.usage == 0.0
    assert s.kv.make_stats().queries == 0


def test_preempted_request_looks_the_cache_up_again_without_counting_twice():
    s = sched(num_blocks=5, budget=32)
    s.add_request(make_request("a", 0, prompt=list(range(7)), max_tokens=8))
    s.add_request(make_request("b", 0, prompt=list(range(100, 107)), max_tokens=8))
    while not any(r.status == RequestStatus.PREEMPTED for r in s.requests.values()):
        run_step(s)
    b = s.requests["b"]
    assert b.num_preemptions == 1
    while b.status != RequestStatus.RUNNING:
        out = run_step(s)
    assert plan(out)[-1][1] > 0  # resumed from its own cached first block
    assert s.kv.make_stats().requests == 2
