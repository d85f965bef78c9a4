"""The KV tiers' bookkeeping (core/kv_tiers.py) through the real scheduler: exact LRU
and lock rules, which hashes sit where after evictions, and a Hypothesis state machine
whose fake runner carries every block's content through the copies the scheduler asks
for, so a hit that would read the wrong KV (an offload after a load, a slot reused while
read, a failed disk read) fails the test."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hotprefix.config import SchedulerConfig
from hotprefix.core.block_pool import IntegrityError
from hotprefix.core.hashing import CacheScope
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.kv_tiers import KVTiers, SlotState, Source
from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.core.request import Request
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_host_tier_is_lru_and_skips_locked_and_loading_slots():
    t = KVTiers(3)
    host = t.host
    assert [host.put(h(i), SlotState.READY, Source.HOST).slot for i in range(3)] == [0, 1, 2]
    host.get(h(0))  # h0 becomes the most recent: h1 is the victim
    assert host.put(h(3), SlotState.READY, Source.HOST).slot == 1 and h(1) not in host.entries
    host.locked.add(2)  # h2 (next in line) is locked: h0 goes instead
    assert host.put(h(4), SlotState.READY, Source.HOST).slot == 0 and list(host.entries) == [h(2), h(3), h(4)]
    host.entries[h(3)].state = SlotState.LOADING
    host.locked.add(0)
    assert host.put(h(5), SlotState.READY, Source.HOST) is None  # locked, loading, locked: nothing to take
    t.end_step()
    assert host.put(h(5), SlotState.READY, Source.HOST).slot == 2
    host.check_integrity()
    try:
        host.put(h(5), SlotState.READY, Source.HOST)
        raise AssertionError("a second entry for one hash was accepted")
    except IntegrityError:
        pass


class FakeDisk:
    """A disk tier in a dict; reads finish when `progress` says, some of them failing."""

    def __init__(self, host: dict[int, object]) -> None:
        self.files: dict[bytes, object] = {}
        self.pending: list[tuple[bytes, int]] = []
        self.done: list[tuple[bytes, bool]] = []
        self.host = host

    def has(self, block_hash):
        return block_hash in self.files

    def load(self, block_hash, slot):
        self.pending.append((block_hash, slot))

    def finished(self):
        done, self.done = self.done, []
        return done

    def progress(self, rng: random.Random, fail: bool) -> None:
        for bh, slot in self.pending:
            ok = not (fail and rng.random() < 0.3)
            if ok:
                self.host[slot] = self.files[bh]
            else:
                self.files.pop(bh, None)  # a corrupt file is deleted
                self.host[slot] = "garbage"
            self.done.append((bh, ok))
        self.pending = []


def scheduler(num_blocks: int, bs: int, host_slots: int, disk: FakeDisk | None = None,
              reused_only: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)
    return Scheduler(cfg, KVCacheManager(num_blocks, bs, tiers=KVTiers(host_slots, disk),
                                         persist_reused_only=reused_only))


class FakeRunner:
    """Each pool block and host slot holds the hash of the block whose KV it has."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.disk: FakeDisk | None = s.kv.tiers.disk

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for b, slot in out.tier_offload:
            self.host[slot] = self.device.get(b)
        for slot, b in out.tier_load:
            self.device[b] = self.host.get(slot)
        self.compute(out)
        for b, bh in out.persist:
            assert self.device[b] == bh
            if self.disk is not None:
                self.disk.files[bh] = bh
        return ModelRunnerOutput({r.request_id: 7 for r in out.requests if r.sample})

    def compute(self, out: SchedulerOutput) -> None:
        """Check that every block before each chunk holds exactly its hash; write the chunk's."""
        bs = self.s.kv.block_size
        for sr in out.requests:
            req = self.s.requests[sr.request_id]
            for j in range(sr.start_pos // bs):
                assert self.device.get(sr.block_ids[j]) == req.block_hashes[j], (sr.request_id, j)
            end = sr.start_pos + len(sr.token_ids)
            for j in range(sr.start_pos // bs, -(-end // bs)):
                full = (j + 1) * bs <= end and j < len(req.block_hashes)
                self.device[sr.block_ids[j]] = req.block_hashes[j] if full else ("partial", sr.request_id, j)

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.s.update(out, self.run(out))
        self.s.check_integrity()
        return out


def drain(r: FakeRunner, limit: int = 200) -> None:
    for _ in range(limit):
        if not r.s.has_unfinished():
            return
        r.step()
        if r.disk is not None:
            r.disk.progress(random.Random(0), False)
    raise AssertionError("requests did not finish")


def test_evicted_blocks_go_to_the_host_tier_and_come_back_as_host_hits():
    s = scheduler(num_blocks=6, bs=4, host_slots=8)
    r = FakeRunner(s)
    a = make_request("a", 16, max_tokens=1)
    s.add_request(a)
    drain(r)
    a_hashes = list(a.block_hashes[:4])
    s.add_request(make_request("b", 16, max_tokens=1))  # needs 5 blocks of 6: evicts a's
    drain(r)
    # the free queue was [4, 5, 3, 2, 1, 0] (a released tail first): b took 4, 5, 3, 2,
    # evicting a's last two blocks, which went to the host tier, in eviction order
    assert list(s.kv.tiers.host.entries) == [a_hashes[3], a_hashes[2]]
    st0 = s.make_stats()
    assert st0.tiers.offloaded_blocks == 2 and st0.prefix_cache.evicted_blocks == 2
    again = make_request("a2", 0, prompt=a.prompt_token_ids, max_tokens=1)
    s.add_request(again)
    out = s.schedule()
    # blocks 0-1 from the pool, block 2 from the host (block 3 holds the last token: computed)
    assert again.num_cached_tokens == 12
    assert out.tier_load == [(s.kv.tiers.host.entries[a_hashes[2]].slot, out.requests[0].block_ids[2])]
    assert out.requests[0].block_ids[:2] == [0, 1]
    s.update(out, r.run(out))
    tiers = s.make_stats().tiers
    assert tiers.hit_blocks == {Source.DEVICE: 2, Source.HOST: 1, Source.DISK: 0} and tiers.loaded_blocks == 1


def after_restart(bs: int, host_slots: int) -> tuple[Scheduler, FakeRunner, FakeDisk, Request]:
    """A 13-token request computed and written to a fake disk, then the pool and host
    tier emptied (what a restart leaves): the scheduler, its runner, the disk, the request."""
    host: dict[int, object] = {}
    disk = FakeDisk(host)
    s = scheduler(num_blocks=16, bs=bs, host_slots=host_slots, disk=disk)
    r = FakeRunner(s)
    r.host = host
    first = make_request("first", 13, max_tokens=1)
    s.add_request(first)
    drain(r)
    s.kv.reset_prefix_cache()
    assert not s.kv.tiers.host.entries
    return s, r, disk, first


def test_a_request_waits_for_disk_reads_without_holding_the_step():
    s, r, disk, first = after_restart(bs=4, host_slots=8)
    assert set(disk.files) == set(first.block_hashes[:3])  # the computed blocks were persisted
    s.add_request(make_request("other", 5, max_tokens=3))
    again = make_request("again", 0, prompt=first.prompt_token_ids, max_tokens=1)
    s.add_request(again)
    out = r.step()
    assert [x.request_id for x in out.requests] == ["other"]  # "again" waits for its reads
    assert s.kv.tiers.loading and len(disk.pending) == 3
    disk.progress(random.Random(0), False)
    out = r.step()
    assert [x.request_id for x in out.requests] == ["other", "again"] and again.num_cached_tokens == 12
    assert len(out.tier_load) == 3
    assert s.make_stats().tiers.hit_blocks[Source.DISK] == 3


def test_a_failed_disk_read_is_a_miss_and_the_block_is_computed():
    s, r, disk, first = after_restart(bs=4, host_slots=8)
    again = make_request("again", 0, prompt=first.prompt_token_ids, max_tokens=1)
    s.add_request(again)
    r.step()
    bad = first.block_hashes[1]
    disk.progress(_FailOnly(bad), True)  # block 1's file is corrupt
    out = r.step()
    # block 0 from the disk; block 1 failed, so the run stops there: tokens 4.. are computed
    assert again.num_cached_tokens == 4 and len(out.tier_load) == 1
    assert [(x.start_pos, len(x.token_ids)) for x in out.requests] == [(4, 9)]
    stats = s.make_stats().tiers
    assert stats.disk_loads_failed == 1 and stats.hit_blocks[Source.DISK] == 1
    assert bad not in s.kv.tiers.host.entries and first.block_hashes[2] in s.kv.tiers.host.entries


class _FailOnly(random.Random):
    """A `random` whose draw fails exactly the read of one hash (FakeDisk reads in order)."""

    def __init__(self, bad: bytes) -> None:
        super().__init__(0)
        self.bad, self.calls = bad, 0

    def random(self) -> float:
        self.calls += 1
        return 0.0 if self.calls == 2 else 1.0


def test_a_disk_run_longer_than_the_host_tier_still_makes_progress():
    """6 blocks on disk, 4 host slots: the request loads 4 and computes the rest (it
    once evicted its own reads forever)."""
    s, r, disk, first = after_restart(bs=2, host_slots=4)
    again = make_request("again", 0, prompt=first.prompt_token_ids, max_tokens=1)
    s.add_request(again)
    r.step()
    assert len(disk.pending) == 4  # no slot for blocks 4 and 5
    disk.progress(random.Random(0), False)
    out = r.step()
    assert again.num_cached_tokens == 8 and len(out.tier_load) == 4
    assert [(x.start_pos, len(x.token_ids)) for x in out.requests] == [(8, 5)]


def test_the_reused_write_policy_writes_only_blocks_hit_again():
    host: dict[int, object] = {}
    disk = FakeDisk(host)
    s = scheduler(num_blocks=16, bs=4, host_slots=8, disk=disk, reused_only=True)
    r = FakeRunner(s)
    r.host = host
    first = make_request("first", 13, max_tokens=1)
    s.add_request(first)
    s.add_request(make_request("unique", 9, max_tokens=2))
    drain(r)
    assert disk.files == {}  # nothing was hit: nothing written
    s.add_request(make_request("again", 0, prompt=first.prompt_token_ids[:10], max_tokens=1))
    drain(r)
    assert set(disk.files) == set(first.block_hashes[:2])  # the two blocks it hit


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # + 4 outputs fit the pool


class TierMachine(RuleBasedStateMachine):
    """Random requests over a 3-token alphabet in a pool of 8 blocks of 2, a host tier of
    5 slots and a disk tier whose reads may fail; the fake runner checks every hit."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, object] = {}
        self.disk = FakeDisk(self.host)
        self.s = scheduler(num_blocks=8, bs=2, host_slots=5, disk=self.disk)
        self.r = FakeRunner(self.s)
        self.r.host = self.host
        self.n = 0
        self.rng = random.Random(0)

    @rule(prompt=prompts, salt=st.sampled_from([None, "t1"]), max_tokens=st.integers(1, 4))
    def add(self, prompt, salt, max_tokens):
        if len(self.s.requests) < 6:
            self.n += 1
            self.s.add_request(make_request(f"r{self.n}", 0, prompt=prompt, cache_scope=CacheScope(salt),
                                                max_tokens=max_tokens))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            if self.s.has_unfinished():
                self.r.step()

    @rule(fail=st.booleans())
    def disk_reads(self, fail):
        self.disk.progress(self.rng, fail)

    @rule()
    def reset(self):
        self.s.kv.reset_prefix_cache()

    @invariant()
    def consistent(self):
        self.s.check_integrity()
        host = self.s.kv.tiers.host
        assert len(host.entries) <= host.num_slots
        for bh, e in host.entries.items():  # a READY host block holds exactly its KV
            if e.state is SlotState.READY:
                assert self.host.get(e.slot) == bh

    def teardown(self):
        for _ in range(300):
            if not self.s.has_unfinished():
                break
            self.disk.progress(self.rng, False)
            self.r.step()
        assert not self.s.has_unfinished()
        assert self.s.kv.pool.num_free_blocks == self.s.kv.num_blocks


TierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tier_state_machine = TierMachine.TestCase


class ReusedOnlyTierMachine(TierMachine):
    """The same, with the disk tier writing only blocks that were hit again."""

    def __init__(self) -> None:
        super().__init__()
        self.s = scheduler(num_blocks=8, bs=2, host_slots=5, disk=self.disk, reused_only=True)
        self.r = FakeRunner(self.s)
        self.r.host = self.host


ReusedOnlyTierMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_reused_only_tier_state_machine = ReusedOnlyTierMachine.TestCase


def test_tier_settings_out_of_range_are_refused_at_start():
    import pytest

    from hotprefix.config import CacheConfig, ConfigError

    for bad in ({"kv_offloading_size": -1}, {"kv_disk_size": -1}, {"kv_disk_write": "sometimes"},
                {"kv_disk_dir": "/tmp/x", "prefix_caching_hash_algo": "xxhash"}):
        with pytest.raises(ConfigError):
            CacheConfig(**bad)
    assert CacheConfig(kv_disk_dir="/tmp/x").host_tier_bytes == 512 << 20  # disk reads need a host tier
    assert CacheConfig(kv_offloading_size=1 << 30, kv_disk_dir="/tmp/x").host_tier_bytes == 1 << 30
