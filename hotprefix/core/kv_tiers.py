"""The KV tiers below the pool: host memory, and disk behind it (bookkeeping only; the
runner owns the bytes, engine/kv_disk.py the files).

Every tier is keyed by the same chained block hash as the pool (the salt included, so
tenants stay apart in every tier). A lookup walks device -> host -> disk and stops at
the first miss:

- a device eviction (a cached block whose slot is reused) copies the block to the host
  tier first (`offload`), the least recently used host block making room;
- a host hit is loaded into a fresh pool block before the step's forward pass: the
  runner copies offloads out, then loads in, so a block evicted and hit in one step is
  right, and the host slots a step reads or writes are locked until the next step;
- a disk hit is first read into a host slot by the disk tier's loader thread (a slot in
  state LOADING); the request waits in the queue, without holding the step, until its
  blocks are READY, then loads from the host as above. A block that fails to read
  (corrupt, truncated, another model's) is dropped, and the request computes it.

Newly computed blocks go to disk write-behind (the runner copies them after the step's
forward pass; engine/kv_disk.py writes them in its own thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from hotprefix.core.block_pool import IntegrityError
from hotprefix.core.cache_events import CacheEvent, Medium, Removed, Stored
from hotprefix.core.hashing import BlockHash


class Source(Enum):
    """Where a cache hit came from (the `source` label of the cached-tokens metric)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class SlotState(Enum):
    READY = "ready"
    LOADING = "loading"  # the disk loader is filling it


@dataclass
class HostEntry:
    slot: int
    state: SlotState
    source: Source  # where its bytes came from: an offload (HOST) or a disk read (DISK)


class DiskTier(Protocol):
    """What the scheduler needs of the disk tier (engine/kv_disk.DiskStore)."""

    def has(self, block_hash: BlockHash) -> bool:
        """Whether a file for this hash is indexed (its data is checked only when read)."""

    def load(self, block_hash: BlockHash, slot: int) -> None:
        """Start reading the block into host slot `slot`; `finished()` reports it."""

    def finished(self) -> list[tuple[BlockHash, bool]]:
        """Loads completed since the last call: (hash, whether the slot now holds it)."""


@dataclass
class TierStats:
    """Counters since the last read."""

    hit_blocks: dict[Source, int] = field(default_factory=lambda: {s: 0 for s in Source})  # first lookups
    offloaded_blocks: int = 0
    loaded_blocks: int = 0  # host -> device
    disk_loads_failed: int = 0


class HostTier:
    """The host tier's index: hash -> slot, least recently used first, with a fixed
    number of slots. Mutated by the engine thread only."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.entries: OrderedDict[BlockHash, HostEntry] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.locked: set[int] = set()  # slots a scheduled copy reads or writes until the step ran
        self.events: list[CacheEvent] | None = None  # READY blocks in and out, when KV events are recorded

    def get(self, h: BlockHash) -> HostEntry | None:
        e = self.entries.get(h)
        if e is not None:
            self.entries.move_to_end(h)
        return e

    def put(self, h: BlockHash, state: SlotState, source: Source) -> HostEntry | None:
        """A slot for h (the least recently used unlocked READY block gives its slot up),
        or None when every slot is locked or loading. h must not be present."""
        if h in self.entries:
            raise IntegrityError(f"host tier: {h.hex()[:8]} is already present")
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, e in self.entries.items()
                           if e.state is SlotState.READY and e.slot not in self.locked), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim).slot
            self._note(Removed(victim, Medium.HOST))
        e = self.entries[h] = HostEntry(slot, state, source)
        if state is SlotState.READY:
            self._note(Stored(h, Medium.HOST))
        return e

    def ready(self, h: BlockHash) -> None:
        """A LOADING block's bytes are in its slot now."""
        self.entries[h].state = SlotState.READY
        self._note(Stored(h, Medium.HOST))

    def _note(self, event: CacheEvent) -> None:
        if self.events is not None:
            self.events.append(event)

    def drop(self, h: BlockHash) -> None:
        e = self.entries.pop(h, None)
        if e is not None:
            self._free.append(e.slot)
            if e.state is SlotState.READY:
                self._note(Removed(h, Medium.HOST))

    def clear(self) -> int:
        """Forget every READY unlocked block. Returns how many."""
        gone = [h for h, e in self.entries.items() if e.state is SlotState.READY and e.slot not in self.locked]
        for h in gone:
            self.drop(h)
        return len(gone)

    def check_integrity(self) -> None:
        slots = [e.slot for e in self.entries.values()]
        if len(set(slots)) != len(slots) or set(slots) & set(self._free):
            raise IntegrityError("host tier: a slot is used twice")
        if len(slots) + len(self._free) != self.num_slots:
            raise IntegrityError("host tier: slots leaked")


class KVTiers:
    """Host (and optionally disk) tiers for one scheduler. The scheduler asks `extend`
    how far a request's cached run goes below the pool, and reports evictions to
    `offload`; both return the copies the runner must make this step."""

    def __init__(self, host_slots: int, disk: DiskTier | None = None) -> None:
        self.host = HostTier(host_slots)
        self.disk = disk
        self.stats = TierStats()
        self._loading: set[BlockHash] = set()

    def extend(self, hashes: Sequence[BlockHash]) -> tuple[list[HostEntry], bool]:
        """The host blocks that continue a request's device hits (`hashes`: its next block
        hashes), and whether it should wait for disk reads first (True when any block of
        the run is LOADING, or was just asked of the disk: the run is then not to be used).

        The run's slots are locked as it is walked, so neither its own disk reads nor
        this step's offloads can take them; when the host tier has no slot left for
        the next disk block, the run ends there (the request computes the rest), so a
        run longer than the tier still makes progress."""
        self._collect_loads()
        run: list[HostEntry] = []
        for h in hashes:
            e = self.find(h)
            if e is None:
                break
            run.append(e)
        return run, any(e.state is SlotState.LOADING for e in run)

    def find(self, h: BlockHash) -> HostEntry | None:
        """The host entry of one block, READY or LOADING (a disk read started now for a block
        the disk tier has and the host does not, when a slot is free), its slot locked; None
        when no tier below the pool has it."""
        e = self.host.get(h)
        if e is None and self.disk is not None and self.disk.has(h):
            e = self.host.put(h, SlotState.LOADING, Source.DISK)
            if e is not None:
                self._loading.add(h)
                self.disk.load(h, e.slot)
        if e is not None:
            self.host.locked.add(e.slot)
        return e

    def ready(self, h: BlockHash) -> HostEntry | None:
        """The READY host entry of a block, without touching its place in the LRU order or
        starting anything (what a lookup that changes nothing may count on)."""
        e = self.host.entries.get(h)
        return e if e is not None and e.state is SlotState.READY else None

    def _collect_loads(self) -> None:
        if self.disk is None:
            return
        for h, ok in self.disk.finished():
            self._loading.discard(h)
            e = self.host.entries.get(h)
            if e is None:
                continue
            if ok:
                self.host.ready(h)
            else:
                self.stats.disk_loads_failed += 1
                self.host.drop(h)

    @property
    def loading(self) -> bool:
        """Whether disk reads are in flight (a waiting request may be ready soon)."""
        return bool(self._loading)

    def use(self, run: list[HostEntry], device_blocks: list[int], count: bool) -> list[tuple[int, int]]:
        """A request takes a run from `extend`: (host slot, device block) copies for the
        runner; with `count` (a request's first lookup) its hits count by source."""
        for e in run:
            if count:
                self.stats.hit_blocks[e.source] += 1
            e.source = Source.HOST  # read from disk once: from now on it is a host block
        self.stats.loaded_blocks += len(run)
        return [(e.slot, b) for e, b in zip(run, device_blocks)]

    def offload(self, evicted: list[tuple[int, BlockHash]]) -> list[tuple[int, int]]:
        """Device blocks about to be reused, (block id, hash): (device block, host slot)
        copies for the runner. A block already in the host tier is only refreshed."""
        copies = []
        for block_id, h in evicted:
            if self.host.get(h) is not None:
                continue
            e = self.host.put(h, SlotState.READY, Source.HOST)
            if e is None:
                continue
            self.host.locked.add(e.slot)
            copies.append((block_id, e.slot))
        self.stats.offloaded_blocks += len(copies)
        return copies

    def end_step(self) -> None:
        """The runner made the step's copies: no slot is locked any more."""
        self.host.locked.clear()

    def make_stats(self) -> TierStats:
        s, self.stats = self.stats, TierStats()
        return s
