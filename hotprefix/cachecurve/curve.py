"""The prefix-cache hit rate of a log as a function of the pool's size (`hotprefix lint --curve`).

One pass (stack_pass.py) gives the device pool's hits at every size; where the
engine's policy is not a stack algorithm the pass says how many blocks it moved that
the engine would not, and `build` replays the log (policy_sim.py, the engine's
policy) at a few sizes to measure the difference. A host tier is not a stack algorithm
(it keeps the blocks it loads back, so what it holds depends on the pool above it): its
curve is replayed at a grid of sizes. A log too large to keep every block in memory is
sampled by block hash (spatial.py), in disjoint shards whose spread states the
error. The numbers are token-weighted, as the server's hit rate is: cached prompt
tokens over prompt tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np

from hotprefix.cachecurve.policy_sim import PolicySim
from hotprefix.cachecurve.request import SimRequest
from hotprefix.cachecurve.spatial import Key, Sample
from hotprefix.cachecurve.stack_pass import Pass

BLOCK_BUDGET = 4_000_000  # distinct blocks one pass may keep (~100 bytes each) before the log is sampled
REPLAY_BUDGET = 2_000_000  # blocks the host tier's replays may walk, all sizes together, before they sample
SHARDS = 4  # a sampled curve is the mean of this many disjoint samples; their spread is its error
T95 = 3.182  # Student's t at 97.5 %, 3 degrees of freedom: a 95 % interval from SHARDS values
CHECK_REQUESTS = 5000  # the replays that check the pass use at most this many requests
GRID = 8  # sizes the host tier is replayed at
TOP_TENANTS = 8  # tenants (most prompt tokens first) with a curve of their own


@dataclass(frozen=True)
class Hits:
    """Hit blocks of a population by pool size: `cum[s]` blocks hit at a pool of s blocks
    (the last value holds for every larger pool)."""

    cum: np.ndarray

    @classmethod
    def mean(cls, histograms: Sequence[np.ndarray]) -> Hits:
        """The mean of histograms (Pass.histogram) of disjoint samples."""
        size = max((len(h) for h in histograms), default=1)
        cums = [np.cumsum(np.pad(h, (0, size - len(h)))) for h in histograms]
        return cls(np.mean(cums, axis=0) if cums else np.zeros(1))

    def at(self, pool: int | np.ndarray) -> np.ndarray:
        """Blocks hit at each pool size."""
        return self.cum[np.clip(pool, 0, len(self.cum) - 1)]

    @property
    def total(self) -> float:
        return float(self.cum[-1])

    def reaching(self, blocks: float) -> int | None:
        """The least pool at which at least `blocks` hit (None: never)."""
        i = int(np.searchsorted(self.cum, blocks - 1e-9))
        return i if i < len(self.cum) else None


@dataclass(frozen=True)
class Tenant:
    """One tenant's share of the traffic (by the digest of its cache salt; None: unsalted)."""

    salt: str | None
    requests: int
    prompt_tokens: int
    hits: Hits


@dataclass(frozen=True)
class Check:
    """A replay of the engine's policy at one size against the pass at the same size."""

    blocks: int
    requests: int
    replayed: float
    curve: float


@dataclass(frozen=True)
class Curve:
    """The hit rate at every pool size (see the module doc). Sizes are in blocks."""

    block_size: int
    requests: int
    prompt_tokens: int
    duration_s: float | None
    hits: Hits
    tenants: tuple[Tenant, ...]  # the TOP_TENANTS with the most prompt tokens
    largest: int  # blocks of the largest request: smaller pools refuse it, and the pass is exact from here
    moved: int  # blocks the pass moved to the top that the engine leaves where they were
    sample_rate: float = 1.0
    sample_error: float | None = None  # points, 95 %, the largest over the grid (None: not sampled)
    host_blocks: int = 0
    host_points: tuple[tuple[int, float], ...] = ()  # (pool, hit rate with the host tier)
    checks: tuple[Check, ...] = ()

    def rate(self, pool: int) -> float:
        return float(self.hits.at(pool)) * self.block_size / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def unbounded(self) -> float:
        return self.hits.total * self.block_size / self.prompt_tokens if self.prompt_tokens else 0.0

    def pool_for(self, share: float, hits: Hits | None = None) -> int | None:
        """The least pool whose hit rate reaches `share` of the unbounded cache's."""
        h = hits or self.hits
        return max(h.reaching(share * h.total) or 0, self.largest, 1) if h.total else None

    def host_rate(self, pool: int) -> float | None:
        return dict(self.host_points).get(pool)

    @property
    def check_error(self) -> float | None:
        """The largest difference (points) between the pass and the replays."""
        return max((abs(c.curve - c.replayed) * 100 for c in self.checks), default=None)

    def grid(self, n: int = 40, extra: Sequence[int] = ()) -> list[int]:
        """Pool sizes from the largest request to past the working set, evenly spaced, and `extra`."""
        top = max(self.hits.reaching(self.hits.total) or 1, self.largest, 1)
        end = max(top + top // 4, self.largest + 1)
        sizes = {max(self.largest, 1, round(self.largest + (end - self.largest) * i / (n - 1))) for i in range(n)}
        return sorted(sizes | {e for e in extra if e >= 1})


@dataclass(frozen=True)
class Options:
    """What `build` computes besides the device curve: a host tier of `host_blocks`
    replayed at the sizes of interest (`pools`: the server's, say) and on a grid of
    `host_grid` sizes; how many sizes check the pass; the sample rate (None: sample only
    what does not fit BLOCK_BUDGET); pinned block keys (held out of the LRU, always found)."""

    host_blocks: int = 0
    pools: tuple[int, ...] = ()
    checks: int = 3
    host_grid: int = GRID
    sample_rate: float | None = None
    pinned: frozenset[Key] = frozenset()


def build(reqs: Sequence[SimRequest], tenants: Sequence[str | None], block_size: int,
          duration_s: float | None = None, opts: Options | None = None) -> Curve:
    """The curve of `reqs` (in arrival order; tenants: each one's salt digest). Raises
    ValueError for a sample rate outside (0, 1]."""
    opts = opts or Options()
    rate = opts.sample_rate if opts.sample_rate is not None else min(1.0, BLOCK_BUDGET / max(_distinct(reqs), 1))
    if not 0 < rate <= 1:
        raise ValueError(f"the sample rate must be in (0, 1], got {rate}")
    per: dict[str | None, list[int]] = {}
    for r, t in zip(reqs, tenants):
        per.setdefault(t, [0, 0])
        per[t][0] += 1
        per[t][1] += r.prompt_tokens
    ids = {t: i for i, t in enumerate(per)}
    samples = [Sample()] if rate >= 1 else Sample.shards(rate, SHARDS)
    passes = [_run_pass(reqs, tenants, ids, block_size, s, opts.pinned) for s in samples]
    top = sorted(per, key=lambda t: -per[t][1])[:TOP_TENANTS]
    curve = Curve(block_size, len(reqs), sum(r.prompt_tokens for r in reqs), duration_s,
                  Hits.mean([p.histogram() for p in passes]),
                  tuple(Tenant(t, *per[t], Hits.mean([p.histogram(ids[t]) for p in passes])) for t in top),
                  passes[0].largest, round(sum(p.moved for p in passes) / len(passes)), rate if rate < 1 else 1.0)
    if len(passes) > 1:
        curve = _with_error(curve, passes)
    curve = _with_checks(curve, reqs, opts)
    return _with_host(curve, reqs, opts) if opts.host_blocks else curve


def _distinct(reqs: Sequence[SimRequest]) -> int:
    """Distinct block hashes (counted only when there could be more than the budget)."""
    known = sum(len(r.hashes) for r in reqs)
    return known if known <= BLOCK_BUDGET else len(set(chain.from_iterable(r.hashes for r in reqs)))


def _run_pass(reqs: Sequence[SimRequest], tenants: Sequence[str | None], ids: dict[str | None, int],
              block_size: int, sample: Sample, pinned: frozenset[Key]) -> Pass:
    p = Pass(block_size, sample, pinned)
    for r, t in zip(reqs, tenants):
        p.feed(r, ids[t])
    return p


def _with_error(curve: Curve, passes: list[Pass]) -> Curve:
    """The 95 % interval of the shards' mean, the widest over the grid (points)."""
    sizes = np.asarray(curve.grid())
    rates = [Hits.mean([p.histogram()]).at(sizes) * curve.block_size / max(curve.prompt_tokens, 1) for p in passes]
    spread = np.std(np.asarray(rates), axis=0, ddof=1) / math.sqrt(len(passes))
    return replace(curve, sample_error=float(T95 * spread.max() * 100))


def check_sizes(curve: Curve, pools: Sequence[int], n: int) -> list[int]:
    """Where to check the pass: the pools asked about, where it reaches 95 % and half of
    that, the pool where it starts (all at least the largest request)."""
    if n <= 0 or not curve.hits.total:
        return []
    p95 = curve.pool_for(0.95) or curve.largest
    wanted = [*pools, p95, p95 // 2, p95 // 4, curve.largest]
    return sorted(list(dict.fromkeys(max(s, curve.largest, 1) for s in wanted))[:n])


def _with_checks(curve: Curve, reqs: Sequence[SimRequest], opts: Options) -> Curve:
    """Replay the engine's policy at a few sizes over the first CHECK_REQUESTS requests and
    compare with the pass over the same requests."""
    sizes = check_sizes(curve, opts.pools, opts.checks)
    if not sizes:
        return curve
    head = reqs[:CHECK_REQUESTS]
    if len(head) == len(reqs) and curve.sample_rate == 1:
        ref = curve
    else:
        ref = build(head, [None] * len(head), curve.block_size, None, Options(checks=0, sample_rate=1.0,
                                                                              pinned=opts.pinned))
    checks = []
    for s in sizes:
        sim = PolicySim(s, 0, curve.block_size, opts.pinned)
        got = sum(sim.run(r) or 0 for r in head)
        checks.append(Check(s, len(head), got / max(ref.prompt_tokens, 1), ref.rate(s)))
    return replace(curve, checks=tuple(checks))


def _with_host(curve: Curve, reqs: Sequence[SimRequest], opts: Options) -> Curve:
    """The hit rate with the host tier at the pools asked about and on a grid (sampled
    when the replays would walk more than REPLAY_BUDGET blocks)."""
    sizes = sorted({*opts.pools, *(curve.grid(opts.host_grid) if opts.host_grid else ())})
    walked = sum(len(r.hashes) for r in reqs) * len(sizes)
    sample = Sample() if walked <= REPLAY_BUDGET else Sample.shards(REPLAY_BUDGET / walked, 1)[0]
    points = []
    for s in sizes:
        sim = PolicySim(s, opts.host_blocks, curve.block_size, opts.pinned, sample)
        points.append((s, sum(sim.run(r) or 0 for r in reqs) / max(curve.prompt_tokens, 1)))
    return replace(curve, host_blocks=opts.host_blocks, host_points=tuple(points))
