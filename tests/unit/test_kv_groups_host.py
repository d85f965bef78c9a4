"""A grouped pool below and beside its blocks (core/kv_groups.py): swap preemption copies
every group's held blocks out and back into the same (group, index) places; the host
tier takes blocks evicted from any group and a hit loads them back where they belong."""

from __future__ import annotations

from hotprefix.config import PreemptionMode, SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request

BS, W = 4, 8  # a window group of 8 tokens: a query at p reads blocks (p - 7) // 4 on


def _tables(kv: KVCacheManager, rid: str) -> tuple[list[int], list[int]]:
    """The full group's table and the window group's (-1 where it released a block)."""
    return kv.block_ids(rid), kv.windows.block_ids(rid, -1)[0]


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, ModelRunnerOutput({r.request_id: 7 for r in out.requests if r.sample}))
    s.check_integrity()
    return out


def test_swap_copies_every_groups_blocks_out_and_back_to_their_places():
    kv = KVCacheManager(14, BS, group_windows=(None, W))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=26, max_num_seqs=4, preemption_mode=PreemptionMode.SWAP),
                  kv, 16)
    s.add_request(make_request("a", 13, max_tokens=12))
    s.add_request(make_request("b", 9, max_tokens=12))
    for _ in range(4):
        assert _step(s).swap_out == []
    assert _tables(kv, "b") == ([8, 9, 10], [-1, 12, 13])  # 12 tokens computed: the window holds blocks 1, 2
    out = _step(s)  # a needs blocks for position 16: b goes out, each group's held blocks in order
    assert [r.request_id for r in out.requests] == ["a"]
    assert out.swap_out == [(8, 0), (9, 1), (10, 2), (12, 3), (13, 4)]
    b = s.requests["b"]
    assert b.host_block_ids == [0, 1, 2, 3, 4] and b.num_computed_tokens == 12
    assert "b" not in kv.req_to_blocks and "b" not in kv.windows.tables
    _step(s)
    _step(s)
    out = _step(s)  # b comes back: host blocks into fresh blocks at the same (group, index) places
    assert [(r.request_id, r.start_pos) for r in out.requests] == [("a", 19), ("b", 12)]  # nothing recomputed
    full, window = _tables(kv, "b")
    assert (full, window) == ([11, 10, 13, 9], [-1, 12, 8, 6])  # (block 3: the token the step computes)
    assert out.swap_in == [(0, 11), (1, 10), (2, 13), (3, 12), (4, 8)]
    while s.has_unfinished():
        _step(s)
    assert kv.pool.num_free_blocks == 14 and s.swap.num_free == 16
