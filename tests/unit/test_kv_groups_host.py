"""A grouped pool below and beside its blocks (core/kv_groups.py): swap preemption copies
every group's held blocks out and back into the same (group, index) places; the host
tier takes blocks evicted from any group and a hit loads them back where they belong."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from hotprefix.config import PreemptionMode, SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.kv_groups import group_key
from hotprefix.core.kv_tiers import KVTiers, Source
from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request
from tests.unit.test_kv_tiers import FakeDisk, FakeRunner, TierMachine

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


class GroupRunner(FakeRunner):
    """test_kv_tiers' fake runner on a grouped pool: each pool block and host slot holds the
    key of the block whose KV it has (kv_groups.group_key: its group's); before a chunk,
    every block of every group's table the chunk reads must hold its key."""

    def __init__(self, s: Scheduler, disk: FakeDisk | None = None) -> None:
        super().__init__(s)
        self.host = disk.host if disk is not None else {}

    def compute(self, out: SchedulerOutput) -> None:
        kv, bs = self.s.kv, self.s.kv.block_size
        for sr in out.requests:
            req = self.s.requests[sr.request_id]
            end = sr.start_pos + len(sr.token_ids)
            for g, table in enumerate(sr.group_block_ids):
                for j, b in enumerate(table[:-(-end // bs)]):
                    if b == kv.null_block_id:
                        continue
                    full = (j + 1) * bs <= end and j < len(req.block_hashes)
                    key = group_key(req.block_hashes[j], g) if full else ("partial", sr.request_id, j)
                    if j < sr.start_pos // bs:  # read by the chunk: it must hold its KV
                        assert self.device.get(b) == key, (sr.request_id, g, j)
                    self.device[b] = key

    def drain(self) -> list[SchedulerOutput]:
        outs = []
        while self.s.has_unfinished():
            outs.append(self.step())
            if self.disk is not None:
                self.disk.progress(random.Random(0), False)
            assert len(outs) < 200
        return outs


def _tiered(num_blocks: int, host_slots: int, disk: FakeDisk | None = None) -> tuple[Scheduler, GroupRunner]:
    kv = KVCacheManager(num_blocks, BS, group_windows=(None, W), tiers=KVTiers(host_slots, disk))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv)
    return s, GroupRunner(s, disk)


def _keys(req, blocks: range, group: int) -> list[bytes]:
    return [group_key(req.block_hashes[i], group) for i in blocks]


def _loads(s: Scheduler, rid: str, req) -> list[tuple[int, int]]:
    """The (host slot, pool block) copies a hit of 5 blocks on `req`'s prompt needs: the full
    group's blocks 0..4 in order, then the window group's tail at position 20, blocks 3 and 4."""
    full, window = _tables(s.kv, rid)
    slot = {k: e.slot for k, e in s.kv.tiers.host.entries.items()}
    return ([(slot[k], full[i]) for i, k in enumerate(_keys(req, range(5), 0))]
            + [(slot[k], window[i]) for i, k in zip((3, 4), _keys(req, range(3, 5), 1))])


def test_blocks_evicted_from_every_group_go_to_the_host_tier_and_a_hit_loads_them_back_in_place():
    s, r = _tiered(num_blocks=16, host_slots=32)
    a = make_request("a", 21, max_tokens=1)
    s.add_request(a)
    r.drain()
    s.add_request(make_request("b", 29, max_tokens=1))  # 8 full-group blocks and 8 window ones: a's are evicted
    r.drain()
    assert set(s.kv.tiers.host.entries) == set(_keys(a, range(5), 0) + _keys(a, range(5), 1))
    assert s.make_stats().tiers.offloaded_blocks == 10
    again = make_request("a2", 0, prompt=a.prompt_token_ids, max_tokens=3)
    s.add_request(again)
    out = r.step()  # (the runner checks every block the chunk reads holds its group's KV)
    assert again.num_cached_tokens == 20 and [(x.start_pos, len(x.token_ids)) for x in out.requests] == [(20, 1)]
    assert out.tier_load == _loads(s, "a2", again)
    tiers = s.make_stats().tiers
    assert tiers.hit_blocks[Source.HOST] == 5 and tiers.loaded_blocks == 7  # hits count the full group's
    r.drain()
    assert s.kv.pool.num_free_blocks == 16


def test_a_grouped_pools_blocks_come_back_from_the_disk_tier_after_a_restart():
    disk = FakeDisk({})
    s, r = _tiered(num_blocks=32, host_slots=32, disk=disk)
    a = make_request("a", 21, max_tokens=1)
    s.add_request(a)
    r.drain()
    assert set(disk.files) == set(_keys(a, range(5), 0) + _keys(a, range(5), 1))  # every group's computed blocks
    s.kv.reset_prefix_cache()  # what a restart leaves: the disk
    again = make_request("a2", 0, prompt=a.prompt_token_ids, max_tokens=3)
    s.add_request(again)
    assert r.step().requests == []  # it waits for its reads: the full group's 5 and the window tail's 2
    assert sorted(h for h, _ in disk.pending) == sorted(_keys(a, range(5), 0) + _keys(a, range(3, 5), 1))
    disk.progress(random.Random(0), False)
    out = r.step()
    assert again.num_cached_tokens == 20 and out.tier_load == _loads(s, "a2", again)
    assert s.make_stats().tiers.hit_blocks[Source.DISK] == 5
    r.drain()


class GroupedTierMachine(TierMachine):
    """test_kv_tiers' machine on a grouped pool (a full group and a window group of 4 tokens,
    blocks of 2, 24 pages), a host tier of 8 slots and a disk tier whose reads may fail: the
    fake runner checks every block every group's chunk reads, loaded or not."""

    reused_only = False

    def __init__(self) -> None:
        super().__init__()
        self.disk = FakeDisk(self.host)
        kv = KVCacheManager(20, 2, group_windows=(None, 4), tiers=KVTiers(8, self.disk),
                            persist_reused_only=self.reused_only)
        self.s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv)
        self.r = GroupRunner(self.s, self.disk)

    @rule(prefix=st.sampled_from([(1, 2, 0, 1, 1, 2, 0, 0), (2, 2, 1, 0, 1, 1)]), cut=st.integers(1, 8),
          tail=st.lists(st.integers(0, 2), max_size=4), max_tokens=st.integers(1, 4))
    def add_shared(self, prefix, cut, tail, max_tokens):
        """A request on one of two shared prefixes (what makes hits, in the pool and below it)."""
        self.add(list(prefix[:cut]) + tail, None, max_tokens)


GroupedTierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_grouped_tier_state_machine = GroupedTierMachine.TestCase


class GroupedReusedOnlyTierMachine(GroupedTierMachine):
    """The same, with the disk tier writing only blocks that were hit again (every group's)."""

    reused_only = True


GroupedReusedOnlyTierMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_grouped_reused_only_tier_state_machine = GroupedReusedOnlyTierMachine.TestCase
