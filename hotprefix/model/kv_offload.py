"""The host tier's bytes: a block-major arena in host memory, and the copies between it
and the pool (core/kv_tiers.py decides which; the runner makes them before a forward pass).

A host slot holds one whole block, every layer's K then V, contiguous:
[layers, 2, kv_heads, block_size, head_dim] in the pool's storage dtype (fp8 as raw
bytes); in a grouped pool a block is a page (model/kv_cache.py): its page_layers tensor
pairs, whichever group's block it holds. The same bytes are a disk tier file's payload (engine/kv_disk.py), so a block
moves between the tiers without reshaping. On CUDA the arena is pinned memory.
"""

from __future__ import annotations

import numpy as np
import torch

from hotprefix.model.kv_cache import KVCache
from hotprefix.model.parallel import SINGLE, Parallel


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as bytes (CPU index ops do not take fp8); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


class HostArena:
    """num_slots blocks of host memory shaped for `kv`. Allocated lazily by the OS
    (torch.empty): resident memory grows with the blocks written.

    Over tensor-parallel ranks (`parallel`) each rank's arena holds its KV heads of each
    block, while the disk tier, on rank 0, reads and writes whole blocks (file_shape:
    every rank's heads, in rank order, as one rank's arena would hold them): a block
    written to disk is gathered from the ranks (`copied_out`, every rank in step), and a
    block read from disk waits whole on rank 0 (`staged`, by slot) until the step that
    loads its slot into the pool scatters each rank its heads first (`unstage`)."""

    def __init__(self, kv: KVCache, num_slots: int, parallel: Parallel = SINGLE) -> None:
        layer = kv.layers[0]
        self.kv = kv
        self.parallel = parallel
        self.num_slots = num_slots
        self.block_size = kv.block_size
        kvh, _, hd = layer.k.shape
        dtype = _raw(layer.k).dtype
        self.block_shape = (len(kv.pages), 2, kvh, kv.block_size, hd)
        self.file_shape = (len(kv.pages), 2, kvh * parallel.size, kv.block_size, hd)
        self.data = torch.empty((num_slots, *self.block_shape), dtype=dtype, pin_memory=layer.k.is_cuda)
        self.block_bytes = self.data[0].numel() * self.data.element_size() if num_slots else 0
        self.file_bytes = self.block_bytes * parallel.size
        self.staged: dict[int, np.ndarray] = {}  # rank 0 over several ranks: whole blocks read from disk

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """A layer's K or V as [kv_heads, num_blocks, block_size, head_dim] (a view)."""
        kvh, bs, hd = self.block_shape[2:]
        return _raw(t).view(kvh, -1, bs, hd)

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """Pool blocks as host blocks: [n, layers, 2, kv_heads, block_size, head_dim] (a new tensor)."""
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.data.dtype)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.layers[0].k.device)
        for i, layer in enumerate(self.kv.pages):
            for j, t in enumerate((layer.k, layer.v)):
                out[:, i, j] = self._blocks(t)[:, ids].permute(1, 0, 2, 3).cpu()
        return out

    def save(self, copies: list[tuple[int, int]]) -> None:
        """(pool block, host slot): copy each block out (one gather and one scatter a layer)."""
        if not copies:
            return
        for _, s in copies:
            self.staged.pop(s, None)  # (a slot written again: what was read into it is gone)
        ids = torch.tensor([b for b, _ in copies], dtype=torch.long, device=self.kv.layers[0].k.device)
        slots = torch.tensor([s for _, s in copies], dtype=torch.long)
        for i, layer in enumerate(self.kv.pages):
            for j, t in enumerate((layer.k, layer.v)):
                self.data[slots, i, j] = self._blocks(t)[:, ids].permute(1, 0, 2, 3).cpu()

    def restore(self, copies: list[tuple[int, int]]) -> None:
        """(host slot, pool block): copy each host block into the pool."""
        if not copies:
            return
        dev = self.kv.layers[0].k.device
        slots = torch.tensor([s for s, _ in copies], dtype=torch.long)
        ids = torch.tensor([b for _, b in copies], dtype=torch.long, device=dev)
        for i, layer in enumerate(self.kv.pages):
            for j, t in enumerate((layer.k, layer.v)):
                self._blocks(t)[:, ids] = self.data[slots, i, j].permute(1, 0, 2, 3).to(dev, non_blocking=True)

    def copied_out(self, blocks: list[tuple[int, bytes]]) -> list[tuple[bytes, memoryview]]:
        """(pool block, hash) -> (hash, a copy of the whole block's bytes): what the disk
        tier writes (copied, because the pool block may be reused before the write). Over
        several ranks every rank calls it in step, and rank 0 gets the blocks joined from
        every rank's heads (the others: []). Raises PeerLostError."""
        data = self.parallel.gather(self.gather([b for b, _ in blocks]), 3)
        return [(h, block_bytes(data, i)) for i, (_, h) in enumerate(blocks)] if self.parallel.rank == 0 else []

    def slot_bytes(self, slot: int) -> np.ndarray:
        """A writable uint8 array of one slot's whole block (the disk loader fills it): a
        view of the slot alone, else the block staged for it."""
        if self.parallel.size == 1:
            return self.data[slot].view(torch.uint8).reshape(-1).numpy()
        self.staged[slot] = np.empty(self.file_bytes, dtype=np.uint8)
        return self.staged[slot]

    def staged_among(self, loads: list[tuple[int, int]]) -> list[int]:
        """Rank 0: the slots of these (host slot, pool block) loads that hold a whole block
        read from disk, not yet scattered."""
        return [s for s, _ in loads if s in self.staged]

    def unstage(self, slots: list[int]) -> None:
        """Every rank, in step (`slots`: rank 0's staged_among): each staged block's heads
        of this rank into its slot. Raises PeerLostError."""
        if not slots:
            return
        whole = None
        if self.parallel.rank == 0:
            raw = torch.from_numpy(np.stack([self.staged.pop(s) for s in slots]))
            whole = raw.view(self.data.dtype).view(len(slots), *self.file_shape)
        like = self.data[:len(slots)]
        self.data[torch.tensor(slots, dtype=torch.long)] = self.parallel.scatter(whole, like, 3)


def block_bytes(blocks: torch.Tensor, i: int) -> memoryview:
    """The bytes of block i of a `gather` result (what a disk file holds)."""
    return memoryview(blocks[i].view(torch.uint8).reshape(-1).numpy())
