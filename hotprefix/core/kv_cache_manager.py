"""Per-request block tables on top of the block pool, with automatic prefix caching.

A new (or resumed) request first looks up the longest run of its full blocks
whose hashes are cached, capped so that its last token is always computed (its
logits give the next token). It shares those blocks (reference counted), and
gets fresh blocks for the rest. A block is entered in the cache as soon as the
tokens that fill it are scheduled, so a request scheduled later in the same step
already hits it: each layer writes the whole batch's new KV before any sequence
attends. Until that step has run, the entry is provisional: `commit()` (the step
succeeded) keeps it, `rollback()` (the step failed, its KV may not be written)
forgets it, so a later request never hits a block whose KV was never computed.
Only requests of the same step can hold a provisional block.

A model with sliding-window layers has a grouped pool (`group_windows`, core/kv_groups.py):
`req_to_blocks` is the full group's table (every block), the window groups' tables keep
only the blocks their windows meet, a hit is the longest prefix every group has cached,
and released window blocks follow the retention rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hotprefix.core.block_pool import Block, BlockPool, IntegrityError
from hotprefix.core.cache_events import CacheEvent, Medium, Stored
from hotprefix.core.hashing import BlockHash, BlockHasher
from hotprefix.core.kv_groups import Retention, WindowGroups, WindowPlan, group_key
from hotprefix.core.kv_tiers import HostEntry, KVTiers, SlotState
from hotprefix.core.logprob_cache import PromptLogprobCache
from hotprefix.core.request import Request
from hotprefix.errors import PinError
from hotprefix.sizing import blocks_for_tokens, max_cached_blocks


@dataclass
class PrefixCacheStats:
    """Counters since the last read (queries and hits count tokens) and gauges now."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0
    cached_blocks: int = 0
    pinned_blocks: int = 0
    usage: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps each request to the blocks that hold its KV; finds and records cached prefixes; pins.

    Mutates the pool: `allocate_slots` takes blocks (shared hits and new ones),
    `free` returns them, `pin`/`unpin` hold and release extra references.

    group_windows: the window of each KV-cache group (sizing.KVGroupLayout.windows; the
    first None, the full group); (None,) for one group. retain_every: the retention
    rule's interval in tokens (core/kv_groups.Retention; 0: none). The tiers below a
    grouped pool keep blocks of every group, each under its group's key (kv_groups.group_key).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_algo: str = "sha256",
                 max_pinned_fraction: float = 0.2, tiers: KVTiers | None = None,
                 persist_reused_only: bool = False, group_windows: Sequence[int | None] = (None,),
                 retain_every: int = 0) -> None:
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"--max-pinned-fraction must be in [0, 1], got {max_pinned_fraction}")
        if group_windows[0] is not None or any(w is None for w in group_windows[1:]):
            raise ValueError(f"a grouped pool is one full group, then window groups; got {tuple(group_windows)}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.hasher = BlockHasher(block_size, hash_algo)
        self.req_to_blocks: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # per request: leading blocks already entered in the cache
        self._provisional: list[Block] = []  # entered in the cache by the step being scheduled and run
        self.pins: dict[BlockHash, list[Block]] = {}
        self.num_pinned_blocks = 0
        self.max_pinned_blocks = int(max_pinned_fraction * num_blocks)
        self._stats = PrefixCacheStats()
        self._evicted_seen = 0
        self.tiers = tiers if enable_caching else None  # host (and disk) below the pool
        self.logprobs = PromptLogprobCache(block_size) if enable_caching else None  # a scoring request's hits
        self.persist_reused_only = persist_reused_only  # disk: only blocks hit again (see step_copies)
        self._reused: list[Block] = []  # blocks hit (pool or tier) by the step being scheduled
        self._window_loads: list[tuple[HostEntry, Block]] = []  # window blocks the last allocation loads
        if self.tiers is not None:
            self.pool.evictions = []
        self.events: list[CacheEvent] | None = None  # see record_events
        windows = [w for w in group_windows[1:] if w is not None]
        # the window groups' tables (None: one group); the null block id is one past the pool's last
        self.windows = WindowGroups(self.pool, windows, Retention(block_size, retain_every)) if windows else None
        self.null_block_id = num_blocks

    def record_events(self) -> None:
        """From now on record every block that enters or leaves the pool or the host tier,
        in order (core/cache_events.py); `take_events` hands them over."""
        self.events = self.pool.events = []
        if self.tiers is not None:
            self.tiers.host.events = self.events

    def take_events(self) -> list[CacheEvent]:
        """The events recorded since the last call (none when not recording)."""
        if not self.events:
            return []
        out = list(self.events)
        self.events.clear()  # (the same list the pool and the tiers append to)
        return out

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # -- hashes and lookup ---------------------------------------------------
    def update_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over every full block of its known tokens."""
        if self.enable_caching:
            self.hasher.extend(request.block_hashes, request.token_at, request.num_tokens, request.cache_scope)

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The longest cached run of the request's leading full blocks, leaving at
        least its last token to compute. Changes nothing (see allocate_slots)."""
        if not self.enable_caching:
            return []
        self.update_hashes(request)
        max_blocks = self.max_hit_blocks(request)
        hits: list[Block] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        if self.windows is not None and hits:  # (window tails in the host tier count: tier_run loads them)
            below = self.tiers.ready if self.tiers is not None else None
            del hits[self.windows.hit(request.block_hashes, len(hits), below):]
        return hits

    def _full_run(self, request: Request) -> int:
        """The longest run of the request's leading blocks the full group has cached (the end of
        a prompt it shares: a retention boundary of a grouped pool)."""
        n = 0
        for h in request.block_hashes[:self.max_hit_blocks(request)]:
            if self.pool.lookup(h) is None:
                break
            n += 1
        return n

    def tier_run(self, request: Request, num_device_hits: int) -> tuple[list[HostEntry], bool]:
        """The blocks below the pool that continue the request's device hits (see
        KVTiers.extend), within the same cap; ([], False) without tiers. A grouped pool's
        run ends where every window group finds its tail in the pool or a tier below
        (their disk reads started: then ([], True), the request waits for them)."""
        if self.tiers is None:
            return [], False
        run, loading = self.tiers.extend(request.block_hashes[num_device_hits:self.max_hit_blocks(request)])
        found: list[HostEntry] = []
        def below(key: BlockHash) -> HostEntry | None:
            if (e := self.tiers.find(key)) is not None:
                found.append(e)
            return e

        n = num_device_hits + len(run)  # (the window tails' reads start with the run's)
        if self.windows is not None and n:
            n = self.windows.hit(request.block_hashes, n, below)
        if loading or any(e.state is SlotState.LOADING for e in found):
            return [], True
        if n < num_device_hits:  # (get_computed_blocks counted window tails the tiers do not have)
            raise IntegrityError(f"{request.request_id}: {num_device_hits} device hits, but a hit of {n} blocks")
        return run[:n - num_device_hits], False

    def max_hit_blocks(self, request: Request) -> int:
        """The most leading blocks a request may take from the cache (its hashes made):
        its last token is always computed, and a request asking for its prompt's logprobs
        takes a block only where the logprobs its positions give are known
        (PromptLogprobCache.reach)."""
        n = max_cached_blocks(request.num_tokens, self.block_size)
        return self.logprobs.reach(request, n) if self.logprobs is not None else n

    def step_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, BlockHash]]]:
        """After scheduling a step: (pool block, host slot) copies for the blocks it
        evicted, and (pool block, hash) of the blocks the disk tier should keep: those
        it enters in the cache (their KV is computed by the step), or with
        persist_reused_only, those requests hit (the disk tier skips ones it has)."""
        if self.tiers is None:
            return [], []
        offload = self.tiers.offload(self.pool.take_evictions())
        chosen, self._reused = (self._reused if self.persist_reused_only else self._provisional), []
        seen: set[int] = set()
        persist = []
        for b in chosen:
            if b.block_hash is not None and b.block_id not in seen:
                seen.add(b.block_id)
                persist.append((b.block_id, b.block_hash))
        return offload, persist

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's first lookup in the stats."""
        self._stats.requests += 1
        self._stats.queries += num_query_tokens
        self._stats.hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks the request needs to hold num_new_tokens more computed tokens."""
        have = len(self.req_to_blocks.get(request.request_id, ()))
        total = blocks_for_tokens(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - have)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Block] = (), num_loaded: int = 0) -> list[Block] | None:
        """Make room for num_new_tokens after the request's computed tokens.

        computed_blocks (from get_computed_blocks, for a request holding no
        blocks yet) are shared and count as computed, and so do the next
        num_loaded blocks (a tier run, which the runner loads into the first
        num_loaded new blocks): the caller then sets num_computed_tokens to
        (len(computed_blocks) + num_loaded) * block_size. Returns the newly
        allocated blocks (a grouped pool's full group's first, then its window
        groups'), or None when the pool is too small, in which case nothing
        changed. Newly full blocks are entered in the cache. A grouped pool's
        window groups first release the blocks before the window of the request's
        first token to compute, and take their hits' window tails.
        """
        rid = request.request_id
        held = self.req_to_blocks.get(rid, [])
        if (computed_blocks or num_loaded) and held:
            raise ValueError(f"request {rid} already holds blocks; cache hits apply only to a fresh start")
        computed = ((len(computed_blocks) + num_loaded) * self.block_size if computed_blocks or num_loaded
                    else request.num_computed_tokens)
        total = computed + num_new_tokens
        need = max(0, blocks_for_tokens(total, self.block_size) - len(held) - len(computed_blocks))
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # hits that leave the free queue
        plan = None
        if self.windows is not None:
            self.update_hashes(request)
            plan = self.windows.plan(rid, computed, total, request.block_hashes, len(computed_blocks) + num_loaded,
                                     self.tiers.ready if self.tiers is not None else None)
        if need + reclaimed + (plan.num_new + plan.reclaimed - plan.freed if plan else 0) > self.pool.num_free_blocks:
            return None
        if plan is not None:
            fresh = rid not in self.windows.tables
            self.windows.apply(rid, plan, computed, self._boundaries(request) if fresh else None)
        self.pool.touch(computed_blocks)
        new = self.pool.allocate(need + (plan.num_new if plan else 0))
        if new is None:
            raise IntegrityError(f"{need} blocks were counted free but could not be allocated")
        if plan is not None:
            self._loaded_windows(request, plan, self.windows.extend(rid, plan, new[need:]))
        blocks = self.req_to_blocks.setdefault(rid, held)
        blocks.extend(computed_blocks)
        blocks.extend(new[:need])
        if self.tiers is not None:  # hits, from the pool or loaded from a tier: reused blocks
            self._reused.extend(computed_blocks)
            self._reused.extend(new[:num_loaded])
        if computed_blocks:
            self._num_cached[rid] = len(computed_blocks)
        self._cache_full_blocks(request, blocks, total)
        return new

    def _loaded_windows(self, request: Request, plan: WindowPlan, loaded: list[tuple[int, int, Block]]) -> None:
        """With tiers: the window blocks an allocation hits are reused ones, and those it
        loads from a tier are entered in the cache under their group's key (provisional:
        their KV is copied in before the step's forward pass) and kept for load_copies."""
        if self.tiers is None:
            return
        self._reused.extend(b for hits in plan.hits for _, b in hits)
        entries = iter(e for loads in plan.loads for _, e in loads)
        for g, i, b in loaded:
            self._window_loads.append((next(entries), b))
            if self.pool.cache_block(b, group_key(request.block_hashes[i], g), g):
                self._provisional.append(b)
            self._reused.append(b)

    def load_copies(self, run: list[HostEntry], new: list[Block], count: bool) -> list[tuple[int, int]]:
        """The (host slot, pool block) copies of the last allocation's tier loads: its run
        into its first new blocks, and a grouped pool's window blocks (KVTiers.use; `count`:
        a request's first lookup counts its full group's loads as hits by source)."""
        windows, self._window_loads = self._window_loads, []
        return (self.tiers.use(run, [b.block_id for b in new[:len(run)]], count)
                + self.tiers.use([e for e, _ in windows], [b.block_id for _, b in windows], False))

    def _boundaries(self, request: Request) -> tuple[int, ...]:
        """A fresh request's retention boundaries, in blocks (core/kv_groups.py): the end of its
        prompt and of its longest full-group hit."""
        return (request.num_prompt_tokens // self.block_size, self._full_run(request) if self.enable_caching else 0)

    def advance(self, request: Request) -> None:
        """After a step: release the window blocks the request's next position no longer reads
        (a grouped pool; nothing otherwise)."""
        if self.windows is not None:
            self.windows.advance(request.request_id, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.update_hashes(request)
        rid = request.request_id
        full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached.get(rid, 0)
        if 0 < start < full:
            self._refill_chain(request, blocks, start)
        for i in range(start, full):
            if self.pool.cache_block(blocks[i], request.block_hashes[i]):
                self._provisional.append(blocks[i])
                self._stored(request, i)
        if self.windows is not None:
            self._provisional.extend(self.windows.cache_full(rid, request.block_hashes, start, full))
        self._num_cached[rid] = max(full, start)

    def _refill_chain(self, request: Request, blocks: list[Block], start: int) -> None:
        """Before blocks from `start` on enter the cache, make sure the chain before them
        is in it: a block this request computed while another block held its hash (the
        same tokens computed at once) stayed uncached, and that other block may have been
        evicted since. The request's own copy (its KV, computed in an earlier step) is
        entered in its place, so every cached block's parent is cached too."""
        j = start
        while j > 0 and request.block_hashes[j - 1] not in self.pool.cached:
            j -= 1
        for i in range(j, start):
            if self.pool.cache_block(blocks[i], request.block_hashes[i]):
                self._stored(request, i)

    def _stored(self, request: Request, i: int) -> None:
        """Record that the request's block i entered the pool (when recording)."""
        if self.events is None:
            return
        bs = self.block_size
        self.events.append(Stored(request.block_hashes[i], Medium.DEVICE, request.block_hashes[i - 1] if i else None,
                                  tuple(map(request.token_at, range(i * bs, (i + 1) * bs))),
                                  request.cache_scope.extra_keys(i, bs)))

    def commit(self) -> None:
        """The step that computed the provisional entries succeeded: they stay cached."""
        self._provisional = []

    def rollback(self) -> list[Block]:
        """The step failed: forget every provisional entry (their KV may be unwritten).
        Returns the blocks that were uncached. Their holders belong to the failed
        step; the caller finishes them."""
        undone, self._provisional, self._reused, self._window_loads = self._provisional, [], [], []
        for b in undone:
            self.pool.uncache(b)
        return undone

    def free(self, request: Request) -> None:
        """Return all of the request's blocks, tail first (see block_pool's
        eviction order). A request without blocks is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        if self.windows is None:
            self.pool.free(reversed(blocks))
            return
        tables = self.windows.pop(request.request_id)
        for i in range(len(blocks) - 1, -1, -1):  # position by position, every group's block at once
            self.pool.free([b for b in [blocks[i]] + [t[i] for t in tables if i < len(t)] if b is not None])

    def trim(self, request: Request) -> None:
        """Return the blocks past those the request's computed tokens need: a speculative
        step's rejected tail (its positions are past every full block of known tokens, so
        none of these blocks is cached or shared)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = blocks_for_tokens(request.num_computed_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        if self.windows is not None:
            tail += self.windows.trim(request.request_id, keep)
        if any(b.block_hash is not None or b.ref_cnt != 1 for b in tail):
            raise IntegrityError(f"{request.request_id}: a draft's block is cached or shared: {tail}")
        del blocks[keep:]
        self.pool.free(reversed(tail))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's full-group block table (every group's table in a one-group pool)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def held_block_ids(self, request_id: str, upto: int) -> list[int]:
        """The ids of the blocks the request holds at indexes below `upto`, every group's (the
        full group's table first, then each window group's held blocks, in order): what a swap
        copies out, and, after the same allocation, what it copies back into."""
        ids = self.block_ids(request_id)[:upto]
        if self.windows is not None:
            ids += [b for t in self.windows.block_ids(request_id, -1) for b in t[:upto] if b != -1]
        return ids

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block table, the full group's first, null_block_id where a window
        group released a block; () for a one-group pool (block_ids is the table of every layer)."""
        if self.windows is None:
            return ()
        return (self.block_ids(request_id), *self.windows.block_ids(request_id, self.null_block_id))

    # -- pins ------------------------------------------------------------------
    def pin(self, hashes: Sequence[BlockHash]) -> int:
        """Pin the cached blocks of a prefix (given by its block hashes) so they
        are never evicted. Idempotent for the same prefix. Returns the number of
        blocks newly pinned. Raises PinError if a block is not cached or the pins
        would exceed max_pinned_fraction of the pool."""
        if not hashes:
            raise PinError("nothing to pin: the prefix is shorter than one block")
        key = hashes[-1]
        if key in self.pins:
            return 0
        blocks = []
        for i, h in enumerate(hashes):
            b = self.pool.lookup(h)
            if b is None:
                raise PinError(f"block {i} of the prefix is not in the cache; run the prefix first")
            blocks.append(b)
        if self.windows is not None:  # and the window tail at its end, so that a hit there stays whole
            tails = self.windows.tails(hashes)
            if any(b is None for b in tails):
                raise PinError("the window layers' blocks at the end of the prefix are not in the cache; "
                               "run the prefix first")
            blocks.extend(b for b in tails if b is not None)
        new = sum(1 for b in blocks if b.pin_cnt == 0)
        if self.num_pinned_blocks + new > self.max_pinned_blocks:
            raise PinError(f"pinning {new} more blocks would exceed the limit of {self.max_pinned_blocks} "
                           f"pinned blocks (--max-pinned-fraction of {self.num_blocks}); "
                           f"{self.num_pinned_blocks} are pinned")
        self.pool.touch(blocks)
        for b in blocks:
            b.pin_cnt += 1
        self.num_pinned_blocks += new
        self.pins[key] = blocks
        return new

    def unpin(self, hashes: Sequence[BlockHash]) -> int:
        """Release the pin of the prefix ending in hashes[-1]. Returns the number
        of blocks no longer pinned by anything (0 for an unknown prefix)."""
        blocks = self.pins.pop(hashes[-1], None) if hashes else None
        if blocks is None:
            return 0
        released = 0
        for b in blocks:
            b.pin_cnt -= 1
            released += b.pin_cnt == 0
        self.num_pinned_blocks -= released
        self.pool.free(reversed(blocks))
        return released

    # -- control and stats -------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block, and the host tier's (the disk tier
        stays: it is what survives restarts), and the kept prompt logprobs. Returns how
        many blocks were dropped."""
        if self.logprobs is not None:
            self.logprobs.clear()
        return self.pool.reset_cache() + (self.tiers.host.clear() if self.tiers is not None else 0)

    def make_stats(self) -> PrefixCacheStats:
        """Counters since the last call (then reset) and current gauges."""
        s = self._stats
        s.evicted_blocks = self.pool.num_evicted - self._evicted_seen
        self._evicted_seen = self.pool.num_evicted
        s.cached_blocks = self.pool.num_cached_blocks
        s.pinned_blocks = self.num_pinned_blocks
        s.usage = self.usage()
        self._stats = PrefixCacheStats()
        return s

    def check_integrity(self) -> None:
        """Raise IntegrityError if ref counts differ from what requests and pins
        hold, or the hash map, pins and free queue disagree."""
        held: Counter[int] = Counter()
        if self.windows is not None and set(self.windows.tables) != set(self.req_to_blocks):
            raise IntegrityError("the window groups' tables and the full group's belong to different requests")
        for rid, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            if self.windows is not None:
                ids += self.windows.check(rid, len(blocks))
            if len(set(ids)) != len(ids):
                raise IntegrityError(f"request {rid} holds a block twice")
            held.update(ids)
        pin_counts: Counter[int] = Counter()
        for blocks in self.pins.values():
            pin_counts.update(b.block_id for b in blocks)
        held.update(pin_counts)
        self.pool.check_integrity(dict(held))
        for b in self.pool.blocks:
            if b.pin_cnt != pin_counts.get(b.block_id, 0):
                raise IntegrityError(f"{b}: pin count {b.pin_cnt}, pins hold {pin_counts.get(b.block_id, 0)}")
        if self.num_pinned_blocks != len(pin_counts):
            raise IntegrityError(f"{self.num_pinned_blocks} pinned blocks counted, {len(pin_counts)} held")
        if self.tiers is not None:
            self.tiers.host.check_integrity()
