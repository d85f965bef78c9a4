"""A grouped pool (core/kv_groups.py): a full group and a window group of 512 tokens,
blocks of 16. Exact block accounting after a 3,000-token prompt, the retention rule's
order in the free queue, a hit at each retained boundary and none past what the window
group keeps, pins, and the scheduler's integrity after every step."""

from __future__ import annotations

from hotprefix.config import SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.kv_groups import Retention, group_key, longest_tail, window_start
from hotprefix.core.outputs import ModelRunnerOutput
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request

BS, W, EVERY = 16, 512, 1024
PROMPT = list(range(1, 3001))


def _manager(num_blocks: int = 400) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, group_windows=(None, W), retain_every=EVERY, max_pinned_fraction=1.0)


def _run_prompt(kv: KVCacheManager, rid: str, prompt: list[int]):
    """Admit a request whole (one step), as the scheduler does: hits, allocation, commit, release."""
    req = make_request(rid, 0, prompt=prompt, max_tokens=50)
    hits = kv.get_computed_blocks(req)
    req.num_computed_tokens = len(hits) * BS
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens, hits) is not None
    kv.commit()
    req.num_computed_tokens = req.num_tokens
    kv.advance(req)
    kv.check_integrity()
    return req, len(hits)


def test_window_rule_helpers():
    assert window_start(3000, W, BS) == (3000 - 511) // 16 == 155
    assert window_start(100, W, BS) == 0 and window_start(3000, None, BS) == 0
    # a hit of p blocks needs [window_start(p * 16), p): block 3 missing allows at most p = 3
    def tail(cached: list[bool]) -> int:
        return longest_tail(len(cached), cached.__getitem__, W, BS)

    assert tail([True] * 3 + [False] + [True] * 20) == 3
    # ... unless the run after the miss covers a whole window tail: p = 37 reads blocks 5..36
    assert tail([True] * 3 + [False] + [True] * 33) == 37
    r = Retention(BS, EVERY)
    assert r.keeps(32, W, ()) and r.keeps(63, W, ()) and not r.keeps(31, W, ()) and not r.keeps(64, W, ())


def test_exact_accounting_after_a_3000_token_prompt():
    kv = _manager()
    req, _ = _run_prompt(kv, "a", PROMPT)
    full, window = kv.req_to_blocks["a"], kv.windows.tables["a"][0]
    assert len(full) == 188 == len(window)  # ceil(3000 / 16)
    # the window group holds exactly the blocks a query at position 3000 reads: from 155 on
    assert [i for i, b in enumerate(window) if b is not None] == list(range(155, 188))
    assert kv.pool.num_free_blocks == 400 - 188 - 33
    # released window blocks, by their index in the sequence
    index = {kv.pool.lookup(group_key(h, 1)).block_id: i for i, h in enumerate(req.block_hashes[:155])}
    # reused first (after the blocks that hold nothing): the 91 released blocks outside every retained tail
    first_out = [b.block_id for b in kv.pool.first_out]
    assert sorted(index[i] for i in first_out) == [*range(32), *range(64, 96), *range(128, 155)]
    # in the free queue: the 24 never used, then the retained window tails of the 1,024 and 2,048
    # boundaries (every 1,024 tokens; the prompt's end at block 187 is still held), 32 blocks each
    order = [b.block_id for b in kv.pool.free_queue]
    assert all(kv.pool.blocks[i].block_hash is None for i in order[:24])
    assert sorted(index[i] for i in order[24:]) == [*range(32, 64), *range(96, 128)]
    taken = kv.pool.allocate(25)
    assert [b.block_id for b in taken] == order[:24] + first_out[:1]
    kv.pool.free(taken)
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 400


def test_a_hit_at_each_retained_boundary_after_the_released_blocks_are_reused():
    kv = _manager()
    a, _ = _run_prompt(kv, "a", PROMPT)
    kv.free(a)
    # others take the 24 blocks never used and the 91 window blocks no boundary keeps, and give them
    # back uncached, first in line again
    taken = kv.pool.allocate(91 + 24)
    # of the window group's 155 released blocks, only the retained tails (2 x 32) are still cached
    assert sum(kv.pool.lookup(group_key(h, 1)) is not None for h in a.block_hashes[:155]) == 64
    kv.pool.free(taken, front=True)
    kv.check_integrity()
    # a prompt sharing 1,024, 2,048 or 3,000 tokens hits 64, 128 or 187 blocks (the prompt's end, rounded down)
    for shared, expect in ((1024, 64), (2048, 128), (3000, 187), (1500, 64), (2500, 128)):
        req, hits = _run_prompt(kv, f"b{shared}", PROMPT[:shared] + [7] * 40)
        assert hits == expect, shared
        kv.free(req)
        kv.check_integrity()


def test_a_shared_prefix_end_is_a_boundary_for_the_requests_that_hit_it():
    kv = _manager()
    system = PROMPT[:2000]
    a, hits = _run_prompt(kv, "a", system + [5] * 600)
    assert hits == 0
    b, hits = _run_prompt(kv, "b", system + [6] * 600)
    # the window blocks at 2,000 were released by "a" first in line (no boundary of its own there), but
    # nothing was allocated since: b hits the whole system prompt (125 blocks)
    assert hits == 125
    kv.free(a)
    kv.free(b)
    kv.check_integrity()


def test_pin_keeps_the_full_group_and_the_window_tail_at_its_end():
    kv = _manager()
    a, _ = _run_prompt(kv, "a", PROMPT)
    kv.free(a)
    hashes = a.block_hashes[:100]
    assert kv.pin(hashes) == 100 + (100 - window_start(1600, W, BS))
    pinned = {b.block_id for b in kv.pins[hashes[-1]]}
    big = make_request("big", 0, prompt=list(range(50_000, 50_000 + 120 * BS)))
    assert kv.allocate_slots(big, 120 * BS) is not None  # 240 of the 268 blocks not pinned
    assert all(kv.pool.blocks[i].block_hash is not None for i in pinned)
    kv.check_integrity()


def test_scheduler_steps_keep_integrity_and_release_the_window():
    kv = _manager(num_blocks=300)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=700, max_num_seqs=4), kv)
    reqs = [make_request(f"r{i}", 0, prompt=PROMPT[:1200] + [i] * 300, max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {sr.request_id: 3 for sr in out.requests if sr.sample}
        sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
        sched.check_integrity()
        for req in sched.running:  # the window group holds the window of the next position on, no more
            table = kv.windows.tables[req.request_id][0]
            lo = window_start(req.num_computed_tokens, W, BS)
            assert [i for i, b in enumerate(table) if b is not None] == list(range(lo, len(table)))
        steps += 1
        assert steps < 200
    assert kv.pool.num_free_blocks == 300
