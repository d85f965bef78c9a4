"""One pass over a log that gives the prefix-cache hits at every pool size at once.

Mattson's stack algorithm, adapted to the engine's pool (policy_sim.py states the
policy). Run one request after another, the pool is LRU over blocks if a request is
read as touching its blocks last first: it releases them tail first, so its first block
becomes the most recent, and every block it holds is free again when it ends. So the
pool of N blocks holds the N most recent entries of one stack, the same stack for
every N, and a block hits at every pool larger than its depth in that stack. Chains
make the stack simple to keep: a block is always more recent than the blocks after it
in its chain (whoever used a block used the ones before it, and released them later),
so a request finds a run of its blocks in the order they sit in the stack, and its hits
at pool N are its leading blocks shallower than N, up to the cap (the last prompt token
is always computed). Each request pushes one *chunk*, its blocks in chain order (then
the blocks a log names no hash of, and its partial block: they take room and never
hit); a later request that finds blocks of a chunk takes them from its front (the
blocks before them in their chain were taken already), so a chunk's live blocks are
always a tail of it. A Fenwick tree over chunks counts the live blocks above any chunk,
so a request costs O(log requests) per run of blocks it finds in one chunk, plus a
dict lookup per block.

Where this is not the engine's policy, exactly:
- a request larger than a pool is refused by the engine and changes nothing there,
  while the stack takes it: the pass is exact only for pools that hold every request
  (`Pass.largest`);
- past the cap, a block whose hash is cached already is recomputed into a new block and
  the cached copy stays where it was (an identical prompt sent again); the stack moves
  it to the top. These blocks are counted (`Pass.moved`): where there are none, the
  pass is exact.

On a sample (spatial.py) the chunks hold the kept blocks; depths divided by the
rate estimate the whole log's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby, repeat

import numpy as np

from hotprefix.cachecurve.request import SimRequest
from hotprefix.cachecurve.spatial import Key, Sample, Share
from hotprefix.sizing import blocks_for_tokens, max_cached_blocks


@dataclass
class Pass:
    """The stack and what the requests found in it. `feed` one request at a time
    (mutates the stack); then `histogram` and `moved` describe every pool size.

    A hit is recorded as the smallest pool (in blocks) at which it happens; in a sample
    that is its depth divided by the rate."""

    block_size: int
    sample: Sample = field(default_factory=Sample)
    pinned: frozenset[Key] = frozenset()
    largest: int = 0  # blocks of the largest request: pools below it are not exact
    _last: dict[Key, int] = field(default_factory=dict)  # block -> the chunk (request) that last took it
    _dead: list[int] = field(default_factory=list)  # per chunk: its leading blocks taken by later requests
    _tree: list[int] = field(default_factory=lambda: [0])  # Fenwick tree of live blocks per chunk
    _live: int = 0
    _hits: list[list[int]] = field(default_factory=lambda: [[], [], [], []])  # depth, run, least pool, tenant
    _moved: int = 0
    _fixed: list[list[int]] = field(default_factory=lambda: [[], [], []])  # pinned hits: blocks, least pool, tenant

    def __post_init__(self) -> None:
        self._share = Share(self.sample.rate)

    def feed(self, r: SimRequest, tenant: int = 0) -> None:
        """One request, after every earlier one."""
        bs = self.block_size
        full = r.computed_tokens // bs
        known = list(r.hashes[:full])
        n = blocks_for_tokens(r.computed_tokens, bs)
        self.largest = max(self.largest, n)
        cap = min(max_cached_blocks(r.prompt_tokens, bs), len(known))
        lead = 0
        while lead < len(known) and known[lead] in self.pinned:
            lead += 1
        floor = max(n, len(self.pinned))
        if min(lead, cap):
            for lst, v in zip(self._fixed, (min(lead, cap), floor, tenant)):
                lst.append(v)
        keys = self.sample.keep(known[lead:])
        kept_cap = len(self.sample.keep(known[lead:cap])) if cap > lead else 0
        self._push(keys, kept_cap, len(keys) + self._share.take(n - len(known)), floor, tenant)

    def _push(self, keys: list[Key], cap: int, size: int, floor: int, tenant: int) -> None:
        """The stack's step for one request: find its runs, record, take, push its chunk."""
        runs, at = [], 0
        for c, g in groupby(map(self._last.get, keys)):
            if c is None:
                break
            length = sum(1 for _ in g)
            runs.append((c, at, at + length, self._live - self._prefix(c) + at - self._dead[c]))
            at += length
        hits = self._hits
        for _, a, b, depth in runs:
            if a < cap:
                for lst, v in zip(hits, (depth, min(b, cap) - a, floor, tenant)):
                    lst.append(v)
            if b > cap:
                self._moved += b - max(a, cap)
        for c, a, b, _ in runs:
            self._add(c, a - b)
            self._dead[c] = b
        chunk = len(self._dead)
        self._dead.append(0)
        self._tree.append(0)
        self._grow(chunk)
        self._add(chunk, size)
        self._live += size - at
        self._last.update(zip(keys, repeat(chunk)))

    # -- the Fenwick tree over chunks ------------------------------------------------------
    def _grow(self, i: int) -> None:
        """Make node i+1 hold the sum its range covers (the new node's range ends at it)."""
        t, j = self._tree, i + 1
        low = j - (j & -j)
        k = j - 1
        while k > low:
            t[j] += t[k]
            k -= k & -k

    def _add(self, i: int, v: int) -> None:
        t, j, n = self._tree, i + 1, len(self._tree)
        while j < n:
            t[j] += v
            j += j & -j

    def _prefix(self, i: int) -> int:
        """Live blocks in chunks 0..i."""
        t, j, s = self._tree, i + 1, 0
        while j:
            s += t[j]
            j &= j - 1
        return s

    # -- results ---------------------------------------------------------------------------
    def histogram(self, tenant: int | None = None) -> np.ndarray:
        """Hit blocks of the whole log (estimated from the sample: each counts 1 / rate) by
        the least pool at which they hit: out[s] blocks hit at every pool of s blocks or
        more (those of one tenant, or all)."""
        depth, run, floor, who = (np.asarray(x, dtype=np.int64) for x in self._hits)
        fixed, ffloor, fwho = (np.asarray(x, dtype=np.int64) for x in self._fixed)
        if tenant is not None:
            depth, run, floor = depth[who == tenant], run[who == tenant], floor[who == tenant]
            fixed, ffloor = fixed[fwho == tenant], ffloor[fwho == tenant]
        pinned, rate = len(self.pinned), self.sample.rate
        if rate < 1:  # the sample's hits one by one: depths scale by 1 / rate
            per = _expand(depth, run)
            least = np.maximum(np.floor(per / rate).astype(np.int64) + 1 + pinned, np.repeat(floor, run))
            points, weights, start, end = least, np.full(len(least), 1 / rate), least[:0], least[:0]
        else:  # a run of hits at consecutive depths: a range of pools, cut below at the request's own size
            low = depth + 1 + pinned
            points, weights = floor, np.clip(floor - low, 0, run).astype(np.float64)
            start, end = np.maximum(low, floor), low + run
            start, end = start[start < end], end[start < end]
        size = int(max(end.max(initial=0), points.max(initial=0), ffloor.max(initial=0))) + 2
        out = np.bincount(points, weights, size) + np.bincount(ffloor, fixed.astype(np.float64), size)
        ranges = np.bincount(start, minlength=size + 1)[:size + 1] - np.bincount(end, minlength=size + 1)[:size + 1]
        return out + np.cumsum(ranges)[:size]

    @property
    def moved(self) -> float:
        """Blocks the stack moved where the engine keeps them in place (see the module doc),
        estimated for the whole log."""
        return self._moved / self.sample.rate


def _expand(start: np.ndarray, run: np.ndarray) -> np.ndarray:
    """start[i], start[i]+1, ..., start[i]+run[i]-1 for every i, concatenated."""
    total = int(run.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(run) - run, run)
    return np.repeat(start, run) + offsets
