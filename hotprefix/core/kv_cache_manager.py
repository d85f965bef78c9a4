"""Per-request block tables on top of the block pool."""

from __future__ import annotations

from collections import Counter

from hotprefix.core.block_pool import Block, BlockPool, IntegrityError
from hotprefix.core.request import Request
from hotprefix.sizing import blocks_for_tokens


class KVCacheManager:
    """Maps each request to the blocks that hold its KV.

    Mutates the pool: `allocate_slots` takes blocks, `free` returns them.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[Block]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks the request needs to hold num_new_tokens more computed tokens."""
        have = len(self.req_to_blocks.get(request.request_id, ()))
        total = blocks_for_tokens(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - have)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[Block] | None:
        """Make room for num_new_tokens after the request's computed tokens.

        Returns the newly allocated blocks (possibly none), or None when the
        pool has too few free blocks, in which case nothing changed.
        """
        new = self.pool.allocate(self.blocks_needed(request, num_new_tokens))
        if new is None:
            return None
        self.req_to_blocks.setdefault(request.request_id, []).extend(new)
        return new

    def free(self, request: Request) -> None:
        """Return all of the request's blocks, tail first (see block_pool's eviction order).
        A request without blocks is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        """Raise IntegrityError if ref counts differ from what requests hold."""
        held: Counter[int] = Counter()
        for rid, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                raise IntegrityError(f"request {rid} holds a block twice")
            held.update(ids)
        self.pool.check_integrity(dict(held))
