"""The block-hash chain.

A full block's hash is H(parent hash, the block's token ids, extra keys). The
first block's parent is a fixed seed, so two servers compute the same hashes for
the same tokens (the gateway routes on them). SHA-256 is the default: a
collision would let one request read another's KV, which is a security issue.
`xxhash` (xxh3-128) is faster; it is seeded randomly per process, so its hashes
are never comparable across processes.

Extra keys carry anything that changes the KV for the same tokens; today the
cache salt, placed on the first salted block and reaching every later block
through the chain.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
HASH_ALGOS = ("sha256", "xxhash")
ROOT_SEED = b"hotprefix/block-hash/v1"


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

    Blocks before `salt_block` (cache_salt_offset // block_size) carry no salt;
    the block at `salt_block` carries it, and so, through the chain, does every
    later one.
    """

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.algo = algo
        self.fn = make_hash_fn(algo)
        self.root = root_hash(algo)

    def extend(self, hashes: list[BlockHash], token_at: Callable[[int], int], num_tokens: int,
               cache_salt: str | None, cache_salt_offset: int) -> None:
        """Append the hashes of blocks that are full in the first num_tokens tokens. Mutates hashes."""
        bs = self.block_size
        salt_block = cache_salt_offset // bs
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else self.root
            extra = ("salt", cache_salt) if cache_salt is not None and i == salt_block else ()
            hashes.append(self.fn(parent, [token_at(j) for j in range(i * bs, (i + 1) * bs)], extra))

    def hashes_of(self, token_ids: Sequence[int], cache_salt: str | None = None,
                  cache_salt_offset: int = 0) -> list[BlockHash]:
        """The hashes of every full block of token_ids (what a request would get)."""
        out: list[BlockHash] = []
        self.extend(out, token_ids.__getitem__, len(token_ids), cache_salt, cache_salt_offset)
        return out
