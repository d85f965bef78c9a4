"""KV events end to end on the tiny model: a subscriber decodes the ZMQ stream with vLLM's
own structs, follows the sequence (gaps filled by replay, restarts from 0), and rebuilds
the index a precise router keeps; through requests, evictions, a pin, the host tier, an
abort, a failed step, a salt and a reset, that index equals the engine's cache block for
block, with every key a router recomputes from the tokens."""

from __future__ import annotations

import itertools

import pytest

from hotprefix.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig, SchedulerConfig
from hotprefix.core.hashing import UNSALTED, CacheScope
from hotprefix.core.kv_tiers import SlotState
from hotprefix.engine.kv_events import vllm_extra_keys
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.engine.requests import RequestOptions
from hotprefix.sampling_params import SamplingParams
from tests.kv_events_client import ROOT_KEY, Subscriber, router_key, vllm_wire_hashes
from tests.server.conftest import free_port

BS = 16
_ids = itertools.count()


def events_config(**kw) -> KVEventsConfig:
    port, replay = free_port(), free_port()
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                          replay_endpoint=f"tcp://*:{replay}", topic="kv@pod-a@tiny", **kw)


def local(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


class Rig:
    """An engine with events on, its subscriber, and every token sequence it ran (to
    recompute the router keys the index must hold)."""

    def __init__(self, model: str, cfg: KVEventsConfig, legacy: bool = False, **cache) -> None:
        self.cfg = cfg
        cache.setdefault("num_blocks_override", 20)
        self.engine = LLMEngine(EngineConfig(ModelConfig(model=model), CacheConfig(kv_events=cfg, **cache),
                                             SchedulerConfig(long_prefill_token_threshold=32)))
        self.sub = Subscriber(local(cfg.endpoint), local(cfg.replay_endpoint), cfg.topic, BS, legacy)
        self.expected: dict[int, bytes] = {}  # wire hash -> the router key of its chain
        self.wire: dict[bytes, int] = {}  # the engine's hash -> vLLM's, as vLLM computes it

    def run(self, prompt: list[int], max_tokens: int = 8, scope=UNSALTED, steps: int | None = None) -> str:
        """Add a request and step; `steps`: stop after that many steps (it stays unfinished)."""
        rid = f"r{next(_ids)}"
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                RequestOptions(cache_scope=scope))
        outs = []
        for _ in itertools.count() if steps is None else range(steps):
            if not self.engine.has_unfinished_requests():
                break
            outs += [o for o in self.engine.step() if o.request_id == rid]
            self.engine.scheduler.check_integrity()
        tokens = list(prompt) + (list(outs[-1].outputs[0].token_ids) if outs else [])
        self._expect(tokens, scope)
        return rid

    def _expect(self, tokens: list[int], scope: CacheScope) -> None:
        key = ROOT_KEY
        ours = self.engine.kv.hasher.hashes_of(tokens, scope)
        extra = [vllm_extra_keys(scope.extra_keys(i, BS)) for i in range(len(ours))]
        for i, (h, wire) in enumerate(zip(ours, vllm_wire_hashes(tokens, BS, extra))):
            key = router_key(key, tokens[i * BS:(i + 1) * BS], extra[i])
            self.expected[wire] = key
            self.wire[h] = wire

    def content(self) -> dict[str, set[int]]:
        """What the engine's tiers hold, by vLLM medium."""
        kv, disk = self.engine.kv, self.engine.disk
        out = {"GPU": {self.wire[h] for h in kv.pool.cached}, "CPU": set(), "STORAGE": set()}
        if kv.tiers is not None:
            out["CPU"] = {self.wire[h] for h, e in kv.tiers.host.entries.items() if e.state is SlotState.READY}
        if disk is not None:
            out["STORAGE"] = {self.wire[h] for h in disk.index}
        return out

    def check(self, unseen: set[int] = frozenset()) -> None:
        """The subscriber's index is the engine's cache, block for block and key for key;
        `unseen`: disk blocks of an earlier process, whose tokens no request has named yet."""
        if self.engine.disk is not None:
            self.engine.disk.flush()  # (written behind: the test waits for the writes)
            self.engine.publish_kv_events()
        self.sub.pump(self.engine.kv_events.zmq.queued - 1)
        index, content = self.sub.index, self.content()
        assert index.violations == []
        assert {m: index.in_tier(m) for m in content} == {**content, "STORAGE": content["STORAGE"] - unseen}
        assert {h: index.keys[h] for h in index.keys} == {h: self.expected[h] for h in index.keys}
        assert index.stores - index.removes - index.cleared == sum(len(w) for w in index.tiers.values())
        assert {self.wire[h] for h in self.engine.kv_events.announced.held} == set(unseen)

    def close(self) -> None:
        self.engine.close()
        self.sub.close()


@pytest.fixture
def rig(tiny_llama):
    r = Rig(str(tiny_llama[0]), events_config(), kv_offloading_size=12 * 8192)
    yield r
    r.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 300 + 3 for i in range(n)]


def test_the_index_is_the_cache_through_eviction_a_pin_the_host_tier_and_an_abort(rig):
    e = rig.engine
    assert e.kv.tiers.host.num_slots == 12
    shared = prompt(1, 40)
    rig.run(shared + prompt(2, 30))
    rig.run(shared + prompt(3, 30))  # shares two blocks
    rig.check()
    assert e.pin(shared[:32]) == 2  # pinned: these stay through every eviction below
    for s in range(10, 16):  # more than the pool: evictions, offloads, host evictions
        rig.run(prompt(s, 70))
        rig.check()
    assert e.kv.tiers.stats.offloaded_blocks > 0
    rig.run(prompt(15, 70) + prompt(99, 20))  # hits the pool
    kv = e.kv
    below = [s for s in range(10, 16) if (h := kv.hasher.hashes_of(prompt(s, 70))[0]) in kv.tiers.host.entries
             and h not in kv.pool.cached]
    rig.run(prompt(below[-1], 70))  # hits the host tier: its blocks are loaded into the pool
    assert e.kv.tiers.stats.loaded_blocks > 0
    rig.check()
    real = e.runner.execute

    def fails_once(sched):
        e.runner.execute = real
        raise RuntimeError("a failed step")

    e.runner.execute = fails_once
    rig.run(prompt(30, 60))  # its first chunk's blocks are rolled back
    rig.check()
    aborted = rig.run(prompt(40, 100), steps=2)  # two chunks of its prompt computed, then aborted
    e.abort_request(aborted)
    rig.check()
    rig.run(prompt(41, 50), scope=CacheScope("tenant-a", 16))  # salted from its second block
    rig.check()
    salted = [ev.extra_keys for b in rig.sub.batches for ev in b.events
              if type(ev).__name__ == "BlockStored" and ev.extra_keys]
    assert salted == [[None, ("tenant-a",)]]  # (its first two blocks are computed in one step)
    e.reset_prefix_cache()
    rig.check()
    assert rig.content()["GPU"] == {rig.wire[h] for h in e.kv.hasher.hashes_of(shared[:32])}  # the pin


def test_a_gap_is_filled_by_replay_and_the_positional_encoding_decodes_as_vllms_earlier_structs(tiny_llama):
    r = Rig(str(tiny_llama[0]), events_config(encoding="positional", buffer_steps=64), legacy=True)
    try:
        for s in range(3):
            r.run(prompt(s, 50))
        last = r.engine.kv_events.zmq.queued - 1
        r.sub.pump(last, skip={last - 2, last - 1})  # two batches lost on the way: asked again
        assert r.sub.replays >= 1 and r.sub.next_seq == last + 1
        r.check()
    finally:
        r.close()


def test_a_replay_peer_sending_an_oversized_frame_is_dropped_and_others_are_answered(tiny_llama):
    """The replay socket reads frames of at most REPLAY_MAX_BYTES: a peer sending more is
    disconnected before its frame is held (its next, valid request goes unanswered), and
    a well-behaved subscriber's replay is answered as before."""
    import zmq

    from hotprefix.engine.kv_publisher import REPLAY_MAX_BYTES

    r = Rig(str(tiny_llama[0]), events_config(buffer_steps=64))
    ctx = zmq.Context()  # its own: the subscriber's context ends with the subscriber
    hostile = ctx.socket(zmq.DEALER)
    try:
        r.run(prompt(0, 50))
        hostile.connect(local(r.cfg.replay_endpoint))
        hostile.send_multipart([b"", b"x" * (REPLAY_MAX_BYTES + 1)])
        hostile.send_multipart([b"", (0).to_bytes(8, "big")])
        last = r.engine.kv_events.zmq.queued - 1
        r.sub.pump(last, skip={0})  # the subscriber asks after the hostile peer did: answered
        assert r.sub.replays >= 1 and r.sub.next_seq == last + 1
        assert hostile.poll(0) == 0  # the hostile peer's valid request, sent first, got nothing
        r.check()
    finally:
        ctx.destroy(linger=0)
        r.close()


def test_a_restart_starts_from_sequence_0_with_all_blocks_cleared_and_the_disk_tier_is_announced_when_named(
        tiny_llama, tmp_path):
    cfg = events_config()
    disk = {"kv_disk_dir": str(tmp_path), "kv_offloading_size": 12 * 8192}
    r = Rig(str(tiny_llama[0]), cfg, **disk)
    try:
        for s in range(3):
            r.run(prompt(s, 50))
        r.check()
        assert r.sub.index.in_tier("STORAGE")  # the disk tier's writes, announced as vLLM's storage medium
        on_disk = r.content()["STORAGE"]
        expected, wire = r.expected, r.wire
        r.engine.close()
        r.engine = LLMEngine(EngineConfig(ModelConfig(model=str(tiny_llama[0])), CacheConfig(
            kv_events=cfg, num_blocks_override=20, **disk)))
        r.expected, r.wire = expected, wire
        r.sub.next_seq = 0  # the router sees the pod come back (a new process: sequences from 0)
        r.check(unseen=on_disk)  # nothing of the last process is announced: its tokens are unknown here
        first = r.sub.batches[-r.engine.kv_events.zmq.queued]
        assert [type(ev).__name__ for ev in first.events] == ["AllBlocksCleared"]
        r.run(prompt(1, 50))  # read from disk: its blocks' tokens are named, so the disk copies are announced too
        assert r.engine.kv.tiers.stats.hit_blocks
        named = {r.wire[h] for h in r.engine.kv.hasher.hashes_of(prompt(1, 50))}
        r.check(unseen=on_disk - named)
    finally:
        r.close()
