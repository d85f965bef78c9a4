"""What the cache tiers record when a block enters or leaves them (for KV events).

The pool, the host tier and the disk tier each append to one ordered list, in the order
things happen on the engine thread, when recording is on (`KVCacheManager.record_events`;
off, nothing is recorded and nothing is paid). engine/kv_events.py turns the list into
vLLM's wire events after each step. A block entering the pool carries what a router
needs to key it (its tokens, its parent's hash, its extra keys); a block entering a tier
below is named by its hash alone (its content is the pool block it was copied from, or
a disk file the engine never saw the tokens of).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hotprefix.core.hashing import BlockHash


class Medium(str, Enum):
    """The tier a block is in, named as vLLM's events name them (its consumers map these
    names to their tiers): the pool is "GPU" whatever the device, the host tier "CPU",
    the disk tier vLLM's storage medium."""

    DEVICE = "GPU"
    HOST = "CPU"
    DISK = "STORAGE"


@dataclass(frozen=True, slots=True)
class Stored:
    """A block entered a tier. In the pool: with its token ids, the hash of the block
    before it in its chain (None for a chain's first) and its extra keys (CacheScope's)."""

    block_hash: BlockHash
    medium: Medium
    parent: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    extra_keys: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Removed:
    """A block left a tier (evicted, dropped, rolled back or reset)."""

    block_hash: BlockHash
    medium: Medium


CacheEvent = Stored | Removed
