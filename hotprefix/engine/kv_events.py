"""KV events in vLLM's wire format: what the cache tiers recorded, as the batches a
KV-aware router (llm-d's kv-cache indexer, vllm-router's kv_aware policy, Dynamo's KV
router) reads.

After each engine step the engine thread hands this module the step's cache events
(core/cache_events.py, in the order they happened) and gets one batch back, or none when
nothing changed: `[ts, [event, ...], data_parallel_rank]`, each event a BlockStored,
BlockRemoved or AllBlocksCleared as vLLM's msgspec structs encode them (EventEncoding:
a map tagged "type", or vLLM's earlier positional array).

Block hashes go out as the ones vLLM would publish for the same tokens: vLLM's sha256_cbor
chain (sha256 of the canonical CBOR of (parent hash, token ids, extra keys), the first
block's parent derived from vLLM's fixed seed), as ExternalBlockHash ints (the low 64
bits; never 0). So a router that recomputes vLLM's hashes from a prompt's tokens
(vllm-router) finds hotprefix's blocks, and one that keys blocks itself from the events'
token ids (llm-d) does too. The engine's own hashes (hashing.py: another encoding, and
sha256 or xxhash) stay inside.

What subscribers know is kept here (`Announced`), and every batch keeps three promises:
a block is stored once per tier it enters and removed once per time it leaves; a
BlockStored's parent is a block announced before and not yet removed from every tier;
and a BlockStored carries the block's token ids. A block the engine holds but cannot yet
describe so (a disk file from before a restart, whose tokens it never saw; a block
copied down a tier after its parent left every tier, which no lookup can reach) is held
back, and announced the moment it can be: when a request's tokens name it, or its
parent is announced again.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hotprefix.config import EventEncoding, KVEventsConfig
from hotprefix.core.cache_events import CacheEvent, Medium, Removed, Stored
from hotprefix.core.hashing import BlockHash

KV_CACHE_SPEC_KIND = "full_attention"  # vLLM's KVCacheSpecKind of a full-attention layer group
GROUP_IDX = 0  # one KV cache group: every layer attends to the whole context
VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED (cryptographic hashes, no PYTHONHASHSEED)


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit CBOR's 64 bits")


def cbor(value: Any) -> bytes:
    """Canonical CBOR of what vLLM's block hashes take: bytes, text, non-negative ints,
    tuples, None (cbor2.dumps(value, canonical=True) for these)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, int) and value >= 0:
        return _cbor_head(0, value)
    if isinstance(value, tuple):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR here for {value!r}")


def vllm_block_hash(parent: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple[Any, ...] | None) -> bytes:
    """vLLM's hash_block_tokens with sha256_cbor: parent None is the chain's seed."""
    return hashlib.sha256(cbor((VLLM_NONE_HASH if parent is None else parent, token_ids, extra_keys))).digest()


VLLM_NONE_HASH = hashlib.sha256(cbor(VLLM_NONE_HASH_SEED)).digest()


def wire_hash(vllm_hash: bytes) -> int:
    """vLLM's ExternalBlockHash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the low 64 bits;
    0, which consumers read as "no parent", becomes 1."""
    return int.from_bytes(vllm_hash[-8:], "big") or 1


def vllm_extra_keys(keys: tuple[str, ...]) -> tuple[Any, ...] | None:
    """A block's extra keys as vLLM hashes and publishes them: the cache salt alone on
    the first salted block (vLLM's generate_block_hash_extra_keys), None elsewhere."""
    if not keys:
        return None
    return tuple(v for k, v in zip(keys[::2], keys[1::2]) if k == "salt") or None


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What a BlockStored says of one block: its parent (the engine's hash, and on the
    wire; None: a chain's first), its token ids, its vLLM extra keys, and its vLLM hash
    (whole, for its children's; its low 64 bits on the wire)."""

    parent: BlockHash | None
    parent_wire: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None
    vllm: bytes

    @property
    def wire(self) -> int:
        return wire_hash(self.vllm)


Item = tuple[str, Medium, BlockHash]  # an announcement: ("stored" | "removed", its tier, the block)


class Announced:
    """What the subscribers were told, and what is held back (see the module's docstring).
    Mutated by the engine thread only. `keep`: records of blocks no tier holds stay this
    many, so that a block written to disk after it left the pool is still described."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        # by the engine's block hash:
        self.records: OrderedDict[BlockHash, BlockRecord] = OrderedDict()  # least recently used first
        self.tiers: dict[BlockHash, set[Medium]] = {}  # announced: the tiers each block is in
        self.held: dict[BlockHash, set[Medium]] = {}  # in those tiers, not announced yet
        self._children: dict[BlockHash, set[BlockHash]] = {}  # parent -> held blocks waiting for it
        self.out: list[Item] = []  # this batch
        self._ready: list[BlockHash] = []  # announced for the first time: release what waits for them

    def apply(self, events: list[CacheEvent]) -> list[Item]:
        """The announcements the events make, in order (the records they name are kept
        until the next call). Mutates the state."""
        self._forget_unheld()
        self.out = []
        for ev in events:
            h = ev.block_hash
            if isinstance(ev, Stored):
                if ev.token_ids is not None:
                    self._describe(h, ev)
                self._stored(h, ev.medium)
            elif isinstance(ev, Removed):
                self._removed(h, ev.medium)
            self._release()
        return self.out

    def resync(self) -> list[Item]:
        """Every block a tier holds, announced again from nothing (after AllBlocksCleared):
        stores only, parents first."""
        present = [(h, m) for where in (self.tiers, self.held) for h, ms in where.items() for m in ms]
        self.tiers, self.held, self._children, self.out = {}, {}, {}, []
        for h, m in present:
            self._stored(h, m)
            self._release()
        return self.out

    def _describe(self, h: BlockHash, ev: Stored) -> None:
        """Learn a pool block's record (its parent's is known: the parent is in the pool)."""
        parent = self.records.get(ev.parent) if ev.parent is not None else None
        if ev.parent is not None and parent is None:
            return  # (cannot happen: a block enters the pool after its parent; held if it did)
        extra = vllm_extra_keys(ev.extra_keys)
        self._learn(h, BlockRecord(ev.parent, parent.wire if parent else None, ev.token_ids, extra,
                                   vllm_block_hash(parent.vllm if parent else None, ev.token_ids, extra)))

    def _learn(self, h: BlockHash, record: BlockRecord) -> None:
        self.records[h] = record
        self.records.move_to_end(h)
        for medium in self.held.pop(h, set()):  # now it can be described
            self._unwait(h)
            self._stored(h, medium)

    def _stored(self, h: BlockHash, medium: Medium) -> None:
        if medium in self.tiers.get(h, ()) or medium in self.held.get(h, ()):
            return  # (already there: a tier never stores a block twice)
        rec = self.records.get(h)
        if rec is None or (rec.parent is not None and rec.parent not in self.tiers):
            self.held.setdefault(h, set()).add(medium)
            if rec is not None:
                self._children.setdefault(rec.parent, set()).add(h)
            return
        if h not in self.tiers:
            self._ready.append(h)
        self.tiers.setdefault(h, set()).add(medium)
        self.out.append(("stored", medium, h))

    def _release(self) -> None:
        """Announce the held blocks waiting for a block just announced (down their chains)."""
        while self._ready:
            for child in self._children.pop(self._ready.pop(), ()):
                for medium in self.held.pop(child, set()):
                    self._stored(child, medium)

    def _unwait(self, h: BlockHash) -> None:
        rec = self.records.get(h)
        if rec is not None and rec.parent is not None:
            waiting = self._children.get(rec.parent)
            if waiting is not None:
                waiting.discard(h)
                if not waiting:
                    del self._children[rec.parent]

    def _removed(self, h: BlockHash, medium: Medium) -> None:
        where = self.tiers.get(h)
        if where is not None and medium in where:
            where.discard(medium)
            if not where:
                del self.tiers[h]
            self.out.append(("removed", medium, h))
            return
        held = self.held.get(h)
        if held is not None and medium in held:
            held.discard(medium)
            if not held:
                del self.held[h]
                self._unwait(h)

    def _forget_unheld(self) -> None:
        """Keep the records of blocks some tier holds, and `keep` more (the latest used)."""
        spare = len(self.records) - len(self.tiers) - len(self.held) - self.keep
        if spare <= 0:  # (most steps: nothing to scan or copy)
            return
        gone = []
        for h in self.records:  # oldest first
            if h not in self.tiers and h not in self.held:
                gone.append(h)
                if len(gone) == spare:
                    break
        for h in gone:
            del self.records[h]


class WireBatch:
    """Announcements as one batch of vLLM events: runs of stores of one chain in one tier
    become one BlockStored (as vLLM stores a request's new blocks), runs of removals from
    one tier one BlockRemoved."""

    def __init__(self, block_size: int, encoding: EventEncoding, rank: int = 0) -> None:
        self.block_size = block_size
        self.encoding = encoding
        self.rank = rank

    def build(self, items: list[Item], records: dict[BlockHash, BlockRecord],
              cleared: bool = False) -> list[Any]:
        """The batch: [ts, events, data_parallel_rank]."""
        events: list[Any] = [self._tag("AllBlocksCleared", {})] if cleared else []
        run: list[Item] = []
        for item in items:
            if run and not self._continues(run[-1], item, records):
                events.append(self._event(run, records))
                run = []
            run.append(item)
        if run:
            events.append(self._event(run, records))
        return [time.time(), events, self.rank]

    @staticmethod
    def _continues(last: Item, item: Item,
                   records: dict[BlockHash, BlockRecord]) -> bool:
        if last[:2] != item[:2]:
            return False
        return item[0] == "removed" or records[item[2]].parent == last[2]

    def _event(self, run: list[Item], records: dict[BlockHash, BlockRecord]) -> Any:
        kind, medium, _ = run[0]
        recs = [records[h] for _, _, h in run]
        hashes = [r.wire for r in recs]
        if kind == "removed":
            return self._tag("BlockRemoved", {"block_hashes": hashes, "medium": medium.value,
                                              "group_idx": GROUP_IDX})
        extra = [r.extra_keys for r in recs]
        return self._tag("BlockStored", {
            "block_hashes": hashes, "parent_block_hash": recs[0].parent_wire,
            "token_ids": [t for r in recs for t in r.token_ids], "block_size": self.block_size,
            "lora_id": None, "medium": medium.value, "lora_name": None,
            "extra_keys": extra if any(e is not None for e in extra) else None, "group_idx": GROUP_IDX,
            "kv_cache_spec_kind": KV_CACHE_SPEC_KIND, "kv_cache_spec_sliding_window": None})

    def _tag(self, name: str, fields: dict[str, Any]) -> Any:
        """An event as msgspec writes a tagged struct with omit_defaults: a map with "type"
        first and the fields without a default always; or positional: the tag, then the
        fields in order, trailing defaulted ones left out."""
        if self.encoding is EventEncoding.TAGGED:
            return {"type": name, **{k: v for k, v in fields.items() if v is not None or k in _REQUIRED}}
        values = [name, *fields.values()]
        while len(values) > 1 and values[-1] is None and list(fields)[len(values) - 2] not in _REQUIRED:
            values.pop()
        return values


# the fields vLLM's structs declare without a default: always written, None included
_REQUIRED = frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name"})


class KVEventStream:
    """The engine's KV events end to end: the cache's events in, batches out on ZMQ
    (engine/kv_publisher.py). `publish` is called by the thread that steps the engine,
    after each step (and after anything else that changes the cache); the first batch
    it sends is AllBlocksCleared, so a restarted server's subscribers drop what the
    previous process had announced."""

    def __init__(self, cfg: KVEventsConfig, block_size: int, keep: int) -> None:
        from hotprefix.engine.kv_publisher import ZmqPublisher  # (pyzmq only where events are on)

        self.announced = Announced(keep)
        self.wire = WireBatch(block_size, cfg.encoding)
        self.zmq = ZmqPublisher(cfg)
        self._resync = True

    def publish(self, events: list[CacheEvent]) -> None:
        """Announce what the events change (nothing is sent when nothing changes)."""
        items = self.announced.apply(events)
        cleared = self._resync
        if cleared:
            items = self.announced.resync()
        if items or cleared:
            sent = self.zmq.publish(self.wire.build(items, self.announced.records, cleared))
            self._resync = not sent

    def close(self) -> None:
        self.zmq.close()
