"""A replay of requests through the prefix cache, with the engine's own pool.

Requests run one after another, as a sequential replay of a log sends them. Each
looks up the longest run of its leading full blocks that is cached (capped so its
last prompt token is computed), then the host tier for the blocks that follow,
takes blocks for its prompt and output from the pool (the engine's BlockPool:
least recently released first, a request's last blocks released first), enters
its full blocks in the cache, and releases them. Evicted blocks go to the host
tier (the engine's HostTier index). With no device size the cache is unbounded.
A disk tier is not modelled: with one, the prediction is a lower bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hotprefix.core.block_pool import BlockPool
from hotprefix.core.kv_tiers import HostTier, SlotState, Source
from hotprefix.sizing import blocks_for_tokens, max_cached_blocks


@dataclass(frozen=True)
class CacheSize:
    """The cache a prediction assumes: device blocks (None: unbounded) and host-tier blocks."""

    device_blocks: int | None = None
    host_blocks: int = 0
    source: str = "default"  # where the size came from (flags, the log)

    def __post_init__(self) -> None:
        if self.device_blocks is not None and self.device_blocks < 1:
            raise ValueError(f"the cache needs at least one block, got {self.device_blocks}")
        if self.host_blocks < 0:
            raise ValueError(f"host tier blocks must be >= 0, got {self.host_blocks}")

    def describe(self, block_size: int) -> str:
        if self.device_blocks is None:
            return "an unbounded cache (no eviction)"
        host = f" + host tier {self.host_blocks} blocks" if self.host_blocks else ""
        return (f"{self.device_blocks} blocks of {block_size} tokens ({self.device_blocks * block_size} tokens)"
                f"{host}, LRU eviction as the server's pool ({self.source})")


@dataclass(frozen=True)
class SimRequest:
    """One request as the cache sees it: the hashes of its full blocks (prompt, then
    output), its prompt length and how many tokens it generated."""

    hashes: Sequence[bytes]
    prompt_tokens: int
    output_tokens: int = 1

    @property
    def computed_tokens(self) -> int:
        """Tokens whose KV is written: the last sampled token never is."""
        return self.prompt_tokens + max(self.output_tokens, 1) - 1


@dataclass
class Replay:
    """Per request: cached prompt tokens, and blocks shared with some earlier request
    (what an unbounded cache could give, before the cap)."""

    hits: list[int] = field(default_factory=list)
    shared_blocks: list[int] = field(default_factory=list)
    too_big: int = 0  # requests that did not fit the pool at all (the server would refuse them)

    @property
    def total_hits(self) -> int:
        return sum(self.hits)


def replay(reqs: Sequence[SimRequest], block_size: int, size: CacheSize = CacheSize()) -> Replay:
    """Run reqs in order through a cache of the given size (see the module doc)."""
    if size.device_blocks is None:
        return _unbounded(reqs, block_size)
    return _Pool(size, block_size).run(reqs)


def _unbounded(reqs: Sequence[SimRequest], block_size: int) -> Replay:
    seen: set[bytes] = set()
    out = Replay()
    for r in reqs:
        cap = min(max_cached_blocks(r.prompt_tokens, block_size), len(r.hashes))
        n = 0
        while n < len(r.hashes) and r.hashes[n] in seen:
            n += 1
        out.shared_blocks.append(n)
        out.hits.append(min(n, cap) * block_size)
        seen.update(r.hashes[:r.computed_tokens // block_size])
    return out


class _Pool:
    """The engine's pool and host index, driven as the scheduler drives them for one
    request at a time (core/kv_cache_manager.py, core/scheduler.py._admit)."""

    def __init__(self, size: CacheSize, block_size: int) -> None:
        self.bs = block_size
        self.pool = BlockPool(size.device_blocks or 1)
        self.host = HostTier(size.host_blocks) if size.host_blocks else None
        if self.host is not None:
            self.pool.evictions = []
        self.seen: set[bytes] = set()

    def run(self, reqs: Sequence[SimRequest]) -> Replay:
        out = Replay()
        for r in reqs:
            n = 0
            while n < len(r.hashes) and r.hashes[n] in self.seen:
                n += 1
            out.shared_blocks.append(n)
            hit = self._one(r)
            if hit is None:
                out.too_big += 1
                hit = 0
            out.hits.append(hit)
            self.seen.update(r.hashes[:r.computed_tokens // self.bs])
        return out

    def _one(self, r: SimRequest) -> int | None:
        cap = min(max_cached_blocks(r.prompt_tokens, self.bs), len(r.hashes))
        hits = []
        for h in r.hashes[:cap]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        loaded = self._host_run(r.hashes[len(hits):cap])
        need = blocks_for_tokens(r.computed_tokens, self.bs) - len(hits)
        if need + sum(1 for b in hits if b.ref_cnt == 0) > self.pool.num_free_blocks:
            self._unlock()
            return None
        self.pool.touch(hits)
        blocks = hits + (self.pool.allocate(need) or [])
        self._offload()
        for i in range(len(hits), min(r.computed_tokens // self.bs, len(r.hashes))):
            self.pool.cache_block(blocks[i], r.hashes[i])
        self.pool.free(reversed(blocks))
        return (len(hits) + loaded) * self.bs

    def _host_run(self, hashes: Sequence[bytes]) -> int:
        """How many blocks continue the device hits in the host tier (locked, as the engine locks them)."""
        if self.host is None:
            return 0
        n = 0
        for h in hashes:
            e = self.host.get(h)
            if e is None:
                break
            self.host.locked.add(e.slot)
            n += 1
        return n

    def _offload(self) -> None:
        """Evicted device blocks go to the host tier (KVTiers.offload), then the step ends."""
        if self.host is None:
            return
        for _, h in self.pool.take_evictions():
            if self.host.get(h) is None:
                e = self.host.put(h, SlotState.READY, Source.HOST)
                if e is not None:
                    self.host.locked.add(e.slot)
        self._unlock()

    def _unlock(self) -> None:
        if self.host is not None:
            self.host.locked.clear()
