"""The KV events are enough to route precisely: a small router that keeps, per replica,
the index a precise router keeps (from the replica's events, decoded with vLLM's
structs) and sends each request to the replica whose index holds its longest cached
prefix gives, with 2 replicas of 60% of the working set each on the tenants workload,
a hit rate within 5 points of one replica holding the whole working set. The replicas
are the engine's own Scheduler and KVCacheManager without a model (as lint's replay)."""

from __future__ import annotations

import itertools
import zlib

import msgpack
import msgspec

from hotprefix.config import EventEncoding, SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.outputs import ModelRunnerOutput
from hotprefix.core.request import Request
from hotprefix.core.scheduler import Scheduler
from hotprefix.engine.kv_events import Announced, WireBatch
from hotprefix.sampling_params import SamplingParams
from hotprefix.tools.workloads import build
from tests.kv_events_client import KV_EVENT_BATCH, ROOT_KEY, RouterIndex, router_key

BS = 16
DECODE = msgspec.msgpack.Decoder(KV_EVENT_BATCH)
_ids = itertools.count()


def tokens(text: str) -> list[int]:
    """A word-level tokenization (one token a word, as the workload's words are for SmolLM2)."""
    return [zlib.crc32(w.encode()) % 49_152 for w in text.split()]


class Replica:
    """A model-free engine that publishes its KV events into a router's index of it."""

    def __init__(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BS)
        self.kv.record_events()
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1 << 20), self.kv)
        self.announced, self.wire = Announced(), WireBatch(BS, EventEncoding.TAGGED)
        self.index = RouterIndex(BS)

    def run(self, prompt: list[int], output: int = 8) -> int:
        """Serve one request to its end; its cached prompt tokens."""
        req = Request(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=output))
        self.scheduler.add_request(req)
        while not req.status.finished:
            sched = self.scheduler.schedule()
            self.scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={req.request_id: 7}))
            self._publish()
        return req.num_cached_tokens

    def _publish(self) -> None:
        items = self.announced.apply(self.kv.take_events())
        if items:
            self.index.apply(DECODE.decode(msgpack.packb(self.wire.build(items, self.announced.records))))

    def cached_prefix(self, keys: list[bytes]) -> int:
        """Leading blocks of a request (by router key) that this replica's index holds."""
        held = set(self.index.keys.values())
        return next((i for i, k in enumerate(keys) if k not in held), len(keys))


def router_keys(prompt: list[int]) -> list[bytes]:
    keys, key = [], ROOT_KEY
    for i in range(len(prompt) // BS):
        key = router_key(key, prompt[i * BS:(i + 1) * BS], None)
        keys.append(key)
    return keys


def hit_rate(replicas: list[Replica], prompts: list[list[int]], pick) -> float:
    hits = sum(replicas[pick(replicas, p, i)].run(p) for i, p in enumerate(prompts))
    return hits / sum(len(p) for p in prompts)


def longest_prefix(replicas: list[Replica], prompt: list[int], i: int) -> int:
    """The replica holding the longest cached prefix; ties to the one holding fewer blocks."""
    keys = router_keys(prompt)
    return max(range(len(replicas)), key=lambda r: (replicas[r].cached_prefix(keys), -len(replicas[r].index.keys)))


def test_two_replicas_routed_by_their_events_hit_as_one_replica_holding_everything():
    jobs, _, _ = build("tenants", seed=0)
    prompts = [tokens(j.prompt) for j in jobs]
    working_set = len({tuple(p[:(k + 1) * BS]) for p in prompts for k in range(len(p) // BS)}) + 64
    whole = hit_rate([Replica(working_set + 64)], prompts, lambda *_: 0)
    half = int(0.6 * working_set)
    two = [Replica(half), Replica(half)]
    precise = hit_rate(two, prompts, longest_prefix)
    blind = hit_rate([Replica(half), Replica(half)], prompts, lambda reps, p, i: i % 2)
    print(f"hit rate: one replica {whole:.3f}, two routed by events {precise:.3f}, two round robin {blind:.3f}")
    assert whole > 0.8  # 20 system prompts shared by 200 requests
    assert precise >= whole - 0.05
    assert blind < precise  # (round robin, for contrast: every tenant on both replicas)
    assert two[0].index.violations == two[1].index.violations == []
