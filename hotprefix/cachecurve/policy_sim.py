"""The engine's prefix-cache policy, replayed at one size without the engine's objects.

tools/cache_sim.py replays a log through the engine's own Scheduler and KVCacheManager
(~0.2 ms a request); the curve (curve.py) needs the same answer at many sizes, and
on spatial samples of a log, so this is the same policy written over two ordered
dicts (~20x faster), and tests/tools/test_curve.py holds it equal to cache_sim request
by request. What it follows, as the engine does for requests run one after another:

- the pool is a queue of free blocks, least recently released first; between requests
  every block is free. A request's hits are the longest run of its leading blocks in
  the pool, capped so its last prompt token is computed, then the host tier's run;
- the prompt's blocks are taken first (a hit leaves the queue, a new block is its
  head, whose hash is evicted to the host tier), its full blocks are cached unless the
  same hash is cached already (then the new block stays uncached and the cached one
  stays where it is), then the output's blocks the same way; but first each uncached
  copy whose cached block the output's blocks evicted is cached in its place, back from
  the output to the last hash still cached (every cached block's parent is cached);
- the request releases its blocks last first, so its first block is the most recent;
- the host tier is LRU over lookups and offloads; it keeps a block it loads back, and
  the slots of a step's run and its offloads are not given up in that step;
- pinned blocks (a pinned prefix) hold their slots and are always found;
- a request whose blocks exceed the pool is refused and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from hotprefix.cachecurve.request import SimRequest
from hotprefix.cachecurve.spatial import Key, Sample, Share
from hotprefix.sizing import blocks_for_tokens, max_cached_blocks

WHOLE = Sample()

# Blocks without a key of the log are ints: >= 0 uncached (a partial block, or a copy of a cached one), < 0 full and
# cached (a block the log names no hash of: never found again).


class PolicySim:
    """A pool of `device` blocks (and a host tier of `host`) serving requests one by one.

    `run` mutates the pool and returns the prompt tokens found cached, or None when the
    request cannot fit (nothing changes). On a sample (a miniature simulation) the pool
    and the tier are `rate` times the size, fed the sample's blocks of each request in
    one step, and `run` returns the tokens the whole cache would find (scaled back).
    Raises ValueError for a pool of no block."""

    def __init__(self, device: int, host: int, block_size: int, pinned: frozenset[Key] = frozenset(),
                 sample: Sample = WHOLE) -> None:
        if device < 1 or host < 0:
            raise ValueError(f"a pool needs at least one block and a host tier >= 0, got {device}, {host}")
        self.bs = block_size
        self.device = device
        self.sample = sample
        self.pinned = frozenset(sample.keep(list(pinned)))
        self._share = Share(sample.rate)
        self._ids = count()
        free = max(1, round(device * sample.rate)) - len(self.pinned)
        self.queue: OrderedDict[Key | int, None] = OrderedDict((next(self._ids), None) for _ in range(max(free, 0)))
        self.host_slots = round(host * sample.rate)
        self.host: OrderedDict[Key | int, None] = OrderedDict()

    def run(self, r: SimRequest) -> float | None:
        n = blocks_for_tokens(r.computed_tokens, self.bs)
        if n > self.device:
            return None
        full = r.computed_tokens // self.bs
        cap = min(max_cached_blocks(r.prompt_tokens, self.bs), len(r.hashes), full)
        prompt_full = min(r.prompt_tokens // self.bs, full)
        if self.sample.whole:
            keys: list[Key | int] = list(r.hashes[:full])
            keys += [-1 - next(self._ids) for _ in range(full - len(keys))]  # full blocks the log has no hash of
            return self._serve(keys, (cap, prompt_full, blocks_for_tokens(r.prompt_tokens, self.bs), n)) * self.bs
        known = r.hashes[:full]
        keys = self.sample.keep(known)
        cap, stand_ins = len(self.sample.keep(known[:cap])), self._share.take(full - len(known))
        keys += [-1 - next(self._ids) for _ in range(stand_ins)]
        n = len(keys) + self._share.take(n - full)
        return self._serve(keys, (cap, len(keys), n, n)) * self.bs / self.sample.rate

    def _serve(self, keys: list[Key | int], shape: tuple[int, int, int, int]) -> int:
        """One request whose full blocks have `keys`, shaped (hit cap, full blocks of the
        prompt, blocks of the prompt, all blocks): the blocks found cached."""
        cap, prompt_full, prompt_blocks, n = shape
        q, pinned = self.queue, self.pinned
        m = 0
        while m < cap and (keys[m] in q or keys[m] in pinned):
            m += 1
        locked: set[Key | int] = set()
        run = 0
        while self.host_slots and m + run < cap and keys[m + run] in self.host:
            self.host.move_to_end(keys[m + run])
            locked.add(keys[m + run])
            run += 1
        held: list[Key | int] = list(keys[:m])
        for k in held:
            if k not in pinned:
                del q[k]
        self._take(prompt_blocks - m, keys, m, prompt_full, held, locked)
        self._take(n - len(held), keys, prompt_full, len(keys), held, set())
        for k in reversed(held):
            if k not in pinned:
                q[k] = None
        return m + run

    def _take(self, need: int, keys: list[Key | int], start: int, full: int, held: list[Key | int],
              locked: set[Key | int]) -> None:
        """One step: `need` more blocks from the head of the queue (their hashes offloaded
        to the host tier), then positions start..full-1 cached, each unless its hash is
        (after the chain before them is refilled, see _refill)."""
        q = self.queue
        evicted = [k for k in (q.popitem(last=False)[0] for _ in range(need)) if type(k) is not int or k < 0]
        held += [next(self._ids) for _ in range(need)]
        if 0 < start < full:
            self._refill(keys, start, held)
        for i in range(start, full):
            if keys[i] not in q and keys[i] not in self.pinned:
                held[i] = keys[i]
        if self.host_slots:
            self._offload(evicted, locked)

    def _refill(self, keys: list[Key | int], start: int, held: list[Key | int]) -> None:
        """KVCacheManager._refill_chain: the positions before `start` whose hash is no longer
        cached (this request's copy stayed uncached and the cached block was evicted since)
        are cached from this request's own copies, from the last cached hash on. Mutates held."""
        j = start
        while j > 0 and held[j - 1] != keys[j - 1] and keys[j - 1] not in self.queue and keys[j - 1] not in self.pinned:
            j -= 1
        held[j:start] = keys[j:start]

    def _offload(self, evicted: list[Key | int], locked: set[Key | int]) -> None:
        host = self.host
        for k in evicted:
            if k in host:
                host.move_to_end(k)
                continue
            if len(host) >= self.host_slots:
                victim = next((v for v in host if v not in locked), None)
                if victim is None:
                    continue
                del host[victim]
            host[k] = None
            locked.add(k)
