"""A KV-event subscriber as a precise router runs one, for the tests.

It decodes the stream with vLLM's own struct definitions (msgspec, as
vllm/distributed/kv_events.py declares them: the batch an array, each event a map
tagged "type"; or the earlier positional form, every struct an array), follows the
sequence numbers (a gap is filled from the replay socket, sequence 0 after others is a
restart), and keeps the index llm-d's kv-cache indexer keeps: its own key for every
block, recomputed from the event's token ids down the chain (whole blocks only), by
engine hash and tier. Every broken promise is recorded in `violations`.
"""


import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import msgspec
import zmq

END_SEQ = b"\xff" * 8


def _structs(positional: bool) -> type:
    """vLLM's KVEventBatch and its events; positional: every struct array_like (vLLM
    before mid-2026), else only the batch (the events are maps tagged "type")."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=positional, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch


KV_EVENT_BATCH = _structs(positional=False)
LEGACY_KV_EVENT_BATCH = _structs(positional=True)


def router_key(parent: bytes, token_ids: Iterable[int], extra: Any) -> bytes:
    """A router's own block key (llm-d hashes parent, tokens and extra keys, CBOR and FNV;
    any chained hash shows the same thing)."""
    return hashlib.sha256(repr((parent, tuple(token_ids), extra)).encode()).digest()[:8]


ROOT_KEY = b"router-root"


def vllm_wire_hashes(token_ids: Sequence[int], block_size: int, extra: Sequence[Any]) -> list[int]:
    """The ExternalBlockHash ints vLLM publishes for these tokens' full blocks, as vLLM
    computes them (sha256 of cbor2's canonical encoding, the chain seeded by
    sha256_cbor("vllm-none-hash"); extra: each block's extra keys or None)."""
    def sha256_cbor(x: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    parent, out = sha256_cbor("vllm-none-hash"), []
    for i in range(len(token_ids) // block_size):
        parent = sha256_cbor((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra[i]))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


@dataclass
class RouterIndex:
    """llm-d's view of one pod: engine hash -> (its router key, the tiers holding it)."""

    block_size: int
    keys: dict[int, bytes] = field(default_factory=dict)
    tiers: dict[int, set[str]] = field(default_factory=dict)
    stores: int = 0  # block stores applied (one per block and tier)
    removes: int = 0
    clears: int = 0
    cleared: int = 0  # (block, tier) pairs an AllBlocksCleared dropped
    violations: list[str] = field(default_factory=list)

    def apply(self, batch: Any) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.cleared += sum(len(w) for w in self.tiers.values())
                self.keys.clear()
                self.tiers.clear()
                self.clears += 1
            elif kind == "BlockStored":
                self._stored(ev)
            else:
                self._removed(ev)

    def _stored(self, ev: Any) -> None:
        if ev.block_size != self.block_size or ev.group_idx != 0 or ev.kv_cache_spec_kind != "full_attention":
            self.violations.append(f"a store of another shape: {ev}")
        if ev.parent_block_hash is None:
            parent = ROOT_KEY
        elif ev.parent_block_hash in self.tiers:
            parent = self.keys[ev.parent_block_hash]
        else:
            self.violations.append(f"unknown parent {ev.parent_block_hash}")
            return
        extra = ev.extra_keys or [None] * len(ev.block_hashes)
        whole = len(ev.token_ids) // self.block_size  # (whole blocks only, as llm-d chunks them)
        if whole != len(ev.block_hashes) or len(extra) != whole:
            self.violations.append(f"{len(ev.token_ids)} tokens for {len(ev.block_hashes)} blocks")
        for i, h in enumerate(ev.block_hashes[:whole]):
            if h == 0:
                self.violations.append("a block hash of 0")
            parent = router_key(parent, ev.token_ids[i * self.block_size:(i + 1) * self.block_size], extra[i])
            if ev.medium in self.tiers.get(h, ()):
                self.violations.append(f"{h} stored twice in {ev.medium}")
            self.keys[h] = parent
            self.tiers.setdefault(h, set()).add(ev.medium)
            self.stores += 1

    def _removed(self, ev: Any) -> None:
        for h in ev.block_hashes:
            where = self.tiers.get(h)
            if where is None or ev.medium not in where:
                self.violations.append(f"a remove of {h} from {ev.medium}, where it is not")
                continue
            where.discard(ev.medium)
            self.removes += 1
            if not where:
                del self.tiers[h]
                del self.keys[h]

    def in_tier(self, medium: str) -> set[int]:
        return {h for h, where in self.tiers.items() if medium in where}


class Subscriber:
    """SUB on the events endpoint, DEALER on the replay endpoint; batches in sequence
    order into a RouterIndex (`legacy`: decoded with the positional structs)."""

    def __init__(self, endpoint: str, replay: str, topic: str, block_size: int, legacy: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_socket = self.ctx.socket(zmq.DEALER)
        self.replay_socket.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(LEGACY_KV_EVENT_BATCH if legacy else KV_EVENT_BATCH)
        self.index = RouterIndex(block_size)
        self.topic = topic.encode()
        self.next_seq = 0
        self.replays = 0
        self.restarts = 0
        self.batches: list[Any] = []

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay_socket.close(linger=0)
        self.ctx.term()

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        self.batches.append(batch)
        self.index.apply(batch)
        self.next_seq = seq + 1

    def replay(self, start: int, timeout_ms: int = 30_000) -> None:
        """Apply every buffered batch from `start` on (the replay socket's answer)."""
        self.replays += 1
        self.replay_socket.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not self.replay_socket.poll(timeout_ms):
                raise TimeoutError("no answer from the replay socket")
            _, seq, payload = self.replay_socket.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                return
            if int.from_bytes(seq, "big") >= self.next_seq:
                self._apply(int.from_bytes(seq, "big"), payload)

    def pump(self, last_seq: int, timeout_ms: int = 30_000, skip: set[int] = frozenset()) -> None:
        """Receive until batch `last_seq` is applied; `skip`: sequences to drop as if lost
        (their gap is then filled from the replay socket)."""
        while self.next_seq <= last_seq:
            if not self.sub.poll(timeout_ms):
                raise TimeoutError(f"batch {self.next_seq} never came (waiting for {last_seq})")
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq in skip:
                skip = skip - {seq}
                continue
            if seq == 0 and self.next_seq > 0:  # the publisher restarted
                self.restarts += 1
                self.next_seq = 0
            if seq > self.next_seq:
                self.replay(self.next_seq)
            if seq == self.next_seq:
                self._apply(seq, payload)
