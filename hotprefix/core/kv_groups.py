"""KV-cache groups by attention kind: what a sliding-window group keeps, where a prefix
hit may land, and which out-of-window blocks stay in line for reuse (the retention rule).

A model whose layers attend in more than one way (Gemma 3: five local layers of a
window to one global) splits its layers into groups (sizing.KVGroupLayout: vLLM's
hybrid allocator's groups of equal page size). Group 0 is the full-attention group: it
keeps every block of a sequence. A window group of window w keeps, per running
sequence, only the blocks that meet [next - w + 1, end): `next` is the first position
the sequence will compute, whose query sees the w - 1 keys before it. Every earlier block
is released as the sequence advances (its table holds None there: the model reads the
pool's null block id, which no kernel touches). Released blocks stay content-addressed
(cached under `group_key`), so they can be hit and shared.

A prefix hit of p blocks needs the full group's blocks [0, p) and each window group's
blocks [window_start(p * block_size), p) (`longest_tail`: vLLM's right-to-left scan);
the hit is the shortest of them.

The retention rule (`Retention`): a window group's released block goes to the tail of
the free queue, in line with every other cached block (least recently released reused
first), when it is in the window tail of one of its sequence's boundaries: the end of
its prompt, the end of its longest full-group hit (where its prompt left a cached one:
a shared system prompt or document ends there), every `every` tokens; and, when the
sequence ends, its last blocks (the next chat turn's hit). Every other released window
block goes to the head of the free queue: it is the first reused, before anything
another request could hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hotprefix.core.block_pool import Block, BlockPool, IntegrityError
from hotprefix.core.hashing import BlockHash


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The key a block of KV-cache group `group` is cached under, in the pool and the tiers
    below it: the chain's hash for the full group (0), so the KV events and every one-group
    pool see what they saw, and for the others a digest of the hash and the group's number,
    as long as the hash (a disk tier file names its block by a hash of that length)."""
    if group == 0:
        return block_hash
    return BlockHash(hashlib.blake2b(block_hash + b"/g" + group.to_bytes(2, "little"),
                                     digest_size=len(block_hash)).digest())


def window_start(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `position` (or any later one) reads: 0 without a window."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def longest_tail(n: int, cached: Callable[[int], bool], window: int, block_size: int) -> int:
    """The most leading blocks p <= n whose window tail is cached: every block of
    [window_start(p * block_size), p) is (cached(i): block i is in the cache; asked only
    for the blocks the scan reaches)."""
    p = n
    while p > 0:
        lo = window_start(p * block_size, window, block_size)
        miss = next((i for i in range(p - 1, lo - 1, -1) if not cached(i)), None)
        if miss is None:
            return p
        p = miss  # a longer p' > miss would need block `miss` too (window starts never fall as p grows)
    return 0


@dataclass(frozen=True)
class Retention:
    """Which released window blocks keep their place in the free queue (see the module's
    docstring). every: a boundary every this many tokens (rounded down to a block when
    made; 0: none)."""

    block_size: int
    every: int = 0

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"the window retention interval must be >= 0, got {self.every}")
        object.__setattr__(self, "every", self.every // self.block_size * self.block_size)

    def keeps(self, block: int, window: int, boundaries: Sequence[int]) -> bool:
        """Whether block `block` of a window group is in the window tail of a boundary:
        one of `boundaries` (in blocks) or a multiple of `every`."""
        bs = self.block_size
        if any(window_start(b * bs, window, bs) <= block < b for b in boundaries):
            return True
        if not self.every:
            return False
        k = self.every // bs
        nxt = (block // k + 1) * k  # the first interval boundary past the block
        return window_start(nxt * bs, window, bs) <= block


@dataclass
class WindowPlan:
    """What one allocation does to a request's window groups (see WindowGroups.plan):
    per group, the (index, block) pairs it releases, the (index, cached block) pairs it
    hits, the (index, tier entry) pairs loaded from a tier below the pool into new blocks,
    and how many new blocks it takes (the loads' first); `freed`: released blocks that
    become free, `reclaimed`: hits that leave the free queue."""

    drops: list[list[tuple[int, Block]]]
    hits: list[list[tuple[int, Block]]]
    loads: list[list[tuple[int, object]]]
    new: list[int]
    freed: int
    reclaimed: int

    @property
    def num_new(self) -> int:
        return sum(self.new)


class WindowGroups:
    """Each request's block tables in the window groups of a grouped pool (group g >= 1;
    the full group's table is KVCacheManager.req_to_blocks). Mutates the pool's reference
    counts and free queue; raises IntegrityError where the bookkeeping disagrees."""

    def __init__(self, pool: BlockPool, windows: Sequence[int], retention: Retention) -> None:
        self.pool = pool
        self.windows = tuple(windows)  # of groups 1, 2, ...
        self.retention = retention
        self.block_size = retention.block_size
        self.tables: dict[str, list[list[Block | None]]] = {}
        self.horizon: dict[str, int] = {}  # the first position each request will compute
        self.boundaries: dict[str, tuple[int, ...]] = {}  # its retention boundaries, in blocks

    def hit(self, hashes: Sequence[BlockHash], n: int, below: Callable[[BlockHash], object] | None = None) -> int:
        """The longest hit of at most n blocks (the full group's) that every window group's
        cached blocks allow: in the pool, or where `below(key)` is truthy (a tier below it)."""
        def cached(key: BlockHash) -> bool:
            return self.pool.lookup(key) is not None or (below is not None and bool(below(key)))

        for g, w in enumerate(self.windows, 1):
            if n == 0:
                break
            n = min(n, longest_tail(n, lambda i, g=g: cached(group_key(hashes[i], g)), w, self.block_size))
        return n

    def plan(self, rid: str, computed: int, total: int, hashes: Sequence[BlockHash], num_hits: int,
             below: Callable[[BlockHash], object | None] | None = None) -> WindowPlan:
        """The window groups' share of an allocation making room for tokens [computed, total)
        (num_hits: leading blocks taken from the cache or loaded from a tier, for a request
        holding none; a window block not in the pool is loaded from `below(key)`'s tier entry).
        Changes nothing. Raises IntegrityError when a hit's window block is in neither."""
        bs = self.block_size
        tables = self.tables.get(rid)
        out = WindowPlan([], [], [], [], 0, 0)
        length = -(-total // bs)
        for g, w in enumerate(self.windows, 1):
            lo = window_start(computed, w, bs)
            table = tables[g - 1] if tables is not None else []
            drops = [(i, b) for i, b in enumerate(table[:lo]) if b is not None]
            hits, loads = [], []
            for i in range(lo, num_hits):
                key = group_key(hashes[i], g)
                if (b := self.pool.lookup(key)) is not None:
                    hits.append((i, b))
                elif below is not None and (e := below(key)) is not None:
                    loads.append((i, e))
                else:
                    raise IntegrityError(f"{rid}: block {i} of window group {g} was counted cached but is not")
            out.drops.append(drops)
            out.hits.append(hits)
            out.loads.append(loads)
            out.new.append(len(loads) + max(0, length - max(len(table), lo, num_hits)))
            out.freed += sum(1 for _, b in drops if b.ref_cnt == 1)
            out.reclaimed += sum(1 for _, b in hits if b.ref_cnt == 0)
        return out

    def apply(self, rid: str, plan: WindowPlan, computed: int, boundaries: tuple[int, ...] | None) -> None:
        """Carry out a plan's releases and hits (before the pool allocates, so that no hit is
        evicted and the released blocks count as free); `extend` then adds its new blocks.
        boundaries: a fresh request's retention boundaries (in blocks)."""
        if boundaries is not None:
            self.boundaries[rid] = boundaries
        tables = self.tables.setdefault(rid, [[] for _ in self.windows])
        self.horizon[rid] = computed
        for g in range(len(self.windows)):
            self._release(rid, g, plan.drops[g])
            table = tables[g]
            for i, b in sorted([*plan.hits[g], *((i, None) for i, _ in plan.loads[g])], key=lambda ib: ib[0]):
                table.extend([None] * (i - len(table)))
                if b is not None:
                    self.pool.touch([b])
                table.append(b)  # (a load's place: extend fills it)
            table.extend([None] * (window_start(computed, self.windows[g], self.block_size) - len(table)))

    def extend(self, rid: str, plan: WindowPlan, new: Sequence[Block]) -> list[tuple[int, int, Block]]:
        """Put a plan's new blocks (plan.num_new of them, in group order) in the tables: each
        group's loads' places first, then appended. Returns the loads' (group, index, block)."""
        if len(new) != plan.num_new:
            raise IntegrityError(f"{rid}: {len(new)} new window blocks for {plan.num_new}")
        fresh = iter(new)
        loaded = []
        for g, (table, n, loads) in enumerate(zip(self.tables[rid], plan.new, plan.loads), 1):
            for i, _ in loads:
                table[i] = next(fresh)
                loaded.append((g, i, table[i]))
            table.extend(next(fresh) for _ in range(n - len(loads)))
        return loaded

    def _release(self, rid: str, g: int, drops: Sequence[tuple[int, Block]]) -> None:
        table, w = self.tables[rid][g], self.windows[g]
        bounds = self.boundaries.get(rid, ())
        for i, b in drops:
            table[i] = None
            self.pool.free([b], front=not self.retention.keeps(i, w, bounds))

    def advance(self, rid: str, position: int) -> None:
        """The request's next position to compute is `position`: release every window block
        before its window."""
        tables = self.tables.get(rid)
        if tables is None:
            return
        self.horizon[rid] = position
        for g, w in enumerate(self.windows):
            lo = window_start(position, w, self.block_size)
            self._release(rid, g, [(i, b) for i, b in enumerate(tables[g][:lo]) if b is not None])

    def pop(self, rid: str) -> list[list[Block | None]]:
        """Forget the request; its tables (the caller releases the blocks)."""
        self.horizon.pop(rid, None)
        self.boundaries.pop(rid, None)
        return self.tables.pop(rid, [])

    def trim(self, rid: str, keep: int) -> list[Block]:
        """Cut each table to `keep` blocks; the blocks cut (the caller checks and releases them)."""
        out: list[Block] = []
        for table in self.tables.get(rid, ()):
            out.extend(b for b in table[keep:] if b is not None)
            del table[keep:]
        return out

    def cache_full(self, rid: str, hashes: Sequence[BlockHash], start: int, full: int) -> list[Block]:
        """Enter the request's held window blocks [start, full) in the cache under their
        groups' keys; the blocks newly cached."""
        out = []
        for g, table in enumerate(self.tables.get(rid, ()), 1):
            for i in range(start, min(full, len(table))):
                b = table[i]
                if b is not None and self.pool.cache_block(b, group_key(hashes[i], g), g):
                    out.append(b)
        return out

    def tails(self, hashes: Sequence[BlockHash]) -> list[Block | None]:
        """Each window group's cached blocks of the window tail at the end of `hashes` (a pin's;
        None where one is not cached)."""
        n = len(hashes)
        return [self.pool.lookup(group_key(hashes[i], g)) for g, w in enumerate(self.windows, 1)
                for i in range(window_start(n * self.block_size, w, self.block_size), n)]

    def block_ids(self, rid: str, null_id: int) -> list[list[int]]:
        """Each window group's table as block ids, null_id where a block was released."""
        return [[null_id if b is None else b.block_id for b in t] for t in self.tables.get(rid, ())]

    def check(self, rid: str, length: int) -> list[int]:
        """Raise IntegrityError unless each of the request's tables is `length` long and holds
        blocks exactly from its window's start at the request's horizon; the block ids held."""
        held = []
        for g, table in enumerate(self.tables.get(rid, ())):
            lo = min(window_start(self.horizon[rid], self.windows[g], self.block_size), length)
            if len(table) != length:
                raise IntegrityError(f"{rid}: window group {g + 1} has {len(table)} blocks, the full group {length}")
            if any(b is not None for b in table[:lo]) or any(b is None for b in table[lo:]):
                raise IntegrityError(f"{rid}: window group {g + 1} does not hold exactly blocks {lo}..{length - 1}")
            held.extend(b.block_id for b in table[lo:] if b is not None)
        return held
