"""KV blocks, the free queue, the hash -> block map, and the pool that hands them out.

Eviction order (documented here, where it is implemented): the free queue is a
doubly linked list threaded through the blocks themselves, holding every block
with no holder. A block whose holders all let go is appended at the tail, and
keeps its hash: it stays a cache hit until its slot is needed. Allocation pops
from the head, so the least recently released block is evicted first (LRU); only
then does it lose its hash. A request releases its blocks in reverse (tail
first), so its last blocks are evicted before its first ones, which are the
ones most likely to be shared by later requests. A hit on a queued block
removes it from the middle of the queue in O(1).

Pinned blocks hold an extra reference from their pin, so they never enter the
free queue and are never evicted.

A grouped pool (core/kv_groups.py) puts a sliding-window group's out-of-window blocks
that no retention boundary keeps in a second queue instead (`free(..., front=True)`):
allocation takes a block that holds nothing from the head of the free queue first, then
those, oldest first, and only then evicts the free queue's least recently released block.
Blocks of every group share the queues and the map; a window group's blocks are cached
under their group's key (kv_groups.group_key). An evicted block of any group goes to the
tiers below (under that key); only the full group's (group 0) hashes are KV events.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from hotprefix.core.cache_events import CacheEvent, Medium, Removed
from hotprefix.core.hashing import BlockHash


class IntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


@dataclass(eq=False)
class Block:
    """One KV block: its id (row in the KV tensors), how many holders it has
    (requests and pins), its hash while it is cached (None otherwise) and the KV-cache
    group whose key that is, how many pins hold it, and its links in the free queue
    (None while not queued)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    pin_cnt: int = 0
    group: int = 0
    first_out: bool = False  # queued in BlockPool.first_out, not the free queue
    prev_free: Block | None = None
    next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}{', cached' if self.block_hash else ''})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: never handed out
        self._tail = Block(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> Block:
        """Remove and return the first block. Raises IndexError when empty."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def peek(self) -> Block | None:
        """The first block, or None when empty."""
        first = self._head.next_free
        return None if first is self._tail else first

    def remove(self, block: Block) -> None:
        """Unlink a queued block. Raises IntegrityError if it is not queued."""
        if block.prev_free is None or block.next_free is None:
            raise IntegrityError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        """Put a block at the tail (last to be reused)."""
        if block.prev_free is not None or block.next_free is not None:
            raise IntegrityError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        if last is None:
            raise IntegrityError("the free queue lost its tail")
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[Block]:
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks of one engine, and the map from block hash to cached block.

    Allocation is one call that either returns all the blocks asked for or
    returns None and changes nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.first_out = FreeBlockQueue(())  # released window blocks no retention boundary keeps
        self.cached: dict[BlockHash, Block] = {}
        self.num_evicted = 0  # cached blocks whose slot was reused (monotonic)
        # (block id, hash) of each eviction since the last `take_evictions`, when a
        # tier below keeps evicted blocks (None: not recorded)
        self.evictions: list[tuple[int, BlockHash]] | None = None
        # every hash that leaves the map, in order, when KV events are recorded (None: not recorded;
        # KVCacheManager records the hashes that enter it, with their tokens)
        self.events: list[CacheEvent] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.first_out.num_free

    def _pop(self) -> Block:
        """The next block to reuse: one holding nothing at the free queue's head, else the
        oldest of first_out, else the free queue's head (least recently released)."""
        head = self.free_queue.peek()
        if self.first_out.num_free and (head is None or head.block_hash is not None):
            b = self.first_out.popleft()
            b.first_out = False
            return b
        return self.free_queue.popleft()

    def _unqueue(self, b: Block) -> None:
        if b.first_out:
            self.first_out.remove(b)
            b.first_out = False
        else:
            self.free_queue.remove(b)

    def usage(self) -> float:
        """Share of blocks held by at least one request (0.0 to 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block] | None:
        """Take n free blocks (ref_cnt becomes 1), or return None and change nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            return None
        out = [self._pop() for _ in range(n)]
        for b in out:
            self._evict(b)
            b.ref_cnt = 1
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
                if self.evictions is not None:
                    self.evictions.append((b.block_id, b.block_hash))
                self._left(b)
            b.block_hash = None
            b.group = 0
            self.num_evicted += 1

    def _left(self, b: Block) -> None:
        if self.events is not None and b.group == 0 and b.block_hash is not None:
            self.events.append(Removed(b.block_hash, Medium.DEVICE))

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """The evictions recorded since the last call (the slots are about to be
        overwritten: a tier below must copy them first)."""
        if self.evictions is None:
            return []
        out, self.evictions = self.evictions, []
        return out

    def lookup(self, block_hash: BlockHash) -> Block | None:
        """The cached block with this hash, if its KV is still in the pool."""
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on cached blocks (a hit); a queued one leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._unqueue(b)
            b.ref_cnt += 1

    def cache_block(self, block: Block, block_hash: BlockHash, group: int = 0) -> bool:
        """Record that a held block holds the KV of block_hash (a key of KV-cache group
        `group`); True if it is now the cached block for it. If another block already
        caches that hash (two requests computed the same block at once), the first stays
        the cached one and this block stays uncached (False)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.group = group
        self.cached[block_hash] = block
        return True

    def uncache(self, block: Block) -> None:
        """Forget a block's hash (its KV was never written): later lookups miss it.
        A block that is not cached is left as it is."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self._left(block)
        block.block_hash = None
        block.group = 0

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block (referenced ones stay cached).
        Returns how many were dropped."""
        n = 0
        for b in [*self.free_queue, *self.first_out]:
            if b.block_hash is not None:
                del self.cached[b.block_hash]
                self._left(b)
                b.block_hash = None
                b.group = 0
                n += 1
        return n

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def free(self, blocks: Iterable[Block], front: bool = False) -> None:
        """Drop one reference from each block, in the order given; a block whose
        count reaches zero goes to the tail of the free queue (front: of first_out,
        reused before the free queue's cached blocks)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise IntegrityError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if front:
                    b.first_out = True
                    self.first_out.append(b)
                else:
                    self.free_queue.append(b)

    def check_integrity(self, held: dict[int, int] | None = None) -> None:
        """Raise IntegrityError unless the pool is consistent.

        held: block_id -> number of references that owners (requests) hold;
        when given, every block's ref_cnt must equal it exactly.
        """
        queued = self.free_queue.block_ids() + self.first_out.block_ids()
        if len(queued) != self.num_free_blocks:
            raise IntegrityError(f"free count {self.num_free_blocks} != queue length {len(queued)}")
        if any(not b.first_out for b in self.first_out) or any(b.first_out for b in self.free_queue):
            raise IntegrityError("a block's first_out mark does not match its queue")
        if len(set(queued)) != len(queued):
            raise IntegrityError("a block is queued twice")
        queued_set = set(queued)
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise IntegrityError(f"{b} has a negative ref count")
            if (b.ref_cnt == 0) != (b.block_id in queued_set):
                raise IntegrityError(f"{b}: free-queue membership does not match its ref count")
            if held is not None and b.ref_cnt != held.get(b.block_id, 0):
                raise IntegrityError(f"{b}: owners hold {held.get(b.block_id, 0)} references")
            if b.pin_cnt > b.ref_cnt:
                raise IntegrityError(f"{b}: {b.pin_cnt} pins but {b.ref_cnt} references")
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                raise IntegrityError(f"{b}: has a hash but is not the cached block for it")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise IntegrityError(f"the map entry for {h.hex()[:8]} points to {b}, which has another hash")
