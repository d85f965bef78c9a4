"""The block-hash chain.

A full block's hash is H(parent hash, the block's token ids, extra keys). The
first block's parent is a fixed seed, so two servers compute the same hashes for
the same tokens (the gateway routes on them). SHA-256 is the default: a
collision would let one request read another's KV, which is a security issue.
`xxhash` (xxh3-128) is faster; it is seeded randomly per process, so its hashes
are never comparable across processes.

Extra keys carry anything that changes the KV for the same tokens; today the
cache salt of a request's CacheScope, placed on the first salted block and reaching
every later block through the chain.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import INT64_MAX

BlockHash = NewType("BlockHash", bytes)
HASH_ALGOS = ("sha256", "xxhash")
ROOT_SEED = b"hotprefix/block-hash/v1"
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class CacheScope:
    """Which cached blocks a request may share: requests with different salts never
    share a block; the salt applies from token `offset` (rounded down to a block) on, so
    the blocks before it (a public system prompt) are shared with everyone. The default
    scope has no salt: every block is shared.

    The one owner of the salt's rules: it is checked here, when the scope is made (from a
    client's request), and never again. Raises InvalidRequestError (param cache_salt or
    cache_salt_offset) for a salt that is not UTF-8 text of at most MAX_CACHE_SALT_CHARS
    characters (it is hashed with a block), or an offset outside [0, 2**63)."""

    salt: str | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        if self.salt is not None:
            if not isinstance(self.salt, str) or len(self.salt) > MAX_CACHE_SALT_CHARS:
                raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} "
                                          "characters", "cache_salt")
            try:
                self.salt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError("cache_salt must be valid Unicode text (it holds a lone surrogate)",
                                          "cache_salt") from None
        if not (isinstance(self.offset, int) and 0 <= self.offset <= INT64_MAX):
            raise InvalidRequestError("cache_salt_offset must be >= 0", "cache_salt_offset")

    def extra_keys(self, block_index: int, block_size: int) -> tuple[str, ...]:
        """The extra keys of the block at block_index: the salt on the first salted block
        (the chain carries it to every later one), nothing elsewhere."""
        if self.salt is not None and block_index == self.offset // block_size:
            return ("salt", self.salt)
        return ()


UNSALTED = CacheScope()  # the default scope: no salt, every block shared


def _encode(parent: bytes, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> bytes:
    toks = struct.pack(f"<{len(token_ids)}q", *token_ids)
    out = [parent, struct.pack("<I", len(token_ids)), toks, struct.pack("<I", len(extra_keys))]
    for k in extra_keys:
        b = k.encode()
        out += [struct.pack("<I", len(b)), b]
    return b"".join(out)


def make_hash_fn(algo: str) -> Callable[[bytes, Sequence[int], tuple[str, ...]], BlockHash]:
    """A block-hash function (parent, token_ids, extra_keys) -> BlockHash.
    Raises ValueError for an unknown algorithm."""
    if algo == "sha256":
        def sha(parent: bytes, token_ids: Sequence[int], extra: tuple[str, ...]) -> BlockHash:
            return BlockHash(hashlib.sha256(_encode(parent, token_ids, extra)).digest())
        return sha
    if algo == "xxhash":
        import xxhash

        seed = int.from_bytes(os.urandom(8), "little")

        def xx(parent: bytes, token_ids: Sequence[int], extra: tuple[str, ...]) -> BlockHash:
            return BlockHash(xxhash.xxh3_128_digest(_encode(parent, token_ids, extra), seed=seed))
        return xx
    raise ValueError(f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")


def root_hash(algo: str) -> BlockHash:
    """The fixed parent of every chain's first block."""
    return BlockHash(hashlib.sha256(ROOT_SEED + algo.encode()).digest())


class BlockHasher:
    """Extends a request's list of block hashes as its blocks fill.

    Blocks before the scope's salted block (CacheScope.offset // block_size) carry
    no salt; that block carries it, and so, through the chain, does every later one.
    """

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.algo = algo
        self.fn = make_hash_fn(algo)
        self.root = root_hash(algo)

    def extend(self, hashes: list[BlockHash], token_at: Callable[[int], int], num_tokens: int,
               scope: CacheScope) -> None:
        """Append the hashes of blocks that are full in the first num_tokens tokens. Mutates hashes."""
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else self.root
            hashes.append(self.fn(parent, [token_at(j) for j in range(i * bs, (i + 1) * bs)], scope.extra_keys(i, bs)))

    def hashes_of(self, token_ids: Sequence[int], scope: CacheScope = UNSALTED) -> list[BlockHash]:
        """The hashes of every full block of token_ids (what a request of this scope would get)."""
        out: list[BlockHash] = []
        self.extend(out, token_ids.__getitem__, len(token_ids), scope)
        return out
