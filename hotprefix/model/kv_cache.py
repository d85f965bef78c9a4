"""The KV tensors: per layer, K and V for every slot of every block.

Slot s = block_id * block_size + offset. Tensors are head-major, [kv_heads,
slots, head_dim], so gathering a sequence's slots along dim 1 gives the
contiguous [kv_heads, ctx, head_dim] that attention wants. fp8 caches store value / scale with
one scale per layer for K and one for V (1.0 unless given), so a block takes
exactly half the bytes of fp16.

A grouped pool (sizing.KVGroupLayout: KV-cache groups of equal page size, core/kv_groups.py)
has page_layers tensor pairs, each shared by one layer of every group: a block id is a
page that one group's layers hold at a time. Its last block (`null_block`) is the pool's
null block, which window groups' tables name where they released a block: nothing is
written there, and no kernel reads it (tests fill it with NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotprefix.sizing import KVGroupLayout

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_PLAIN = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype for a --kv-cache-dtype name ("auto" = the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name in _FP8:
        return _FP8[name]
    return _PLAIN[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The sizing.py name of a storage dtype."""
    for table in (_PLAIN, _FP8):
        for k, v in table.items():
            if v == dtype:
                return k
    raise ValueError(f"not a KV dtype: {dtype}")


@dataclass
class LayerKV:
    """One layer's cache. k, v: [kv_heads, num_slots, head_dim] in storage dtype."""

    index: int  # the layer's number (keys what is kept per layer, e.g. a cascade's gathered K/V)
    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) at slots ([T]), in torch (the cpu backend
        writes float32 pools in C)."""
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, T, head_dim]
        if self.is_fp8:  # CPU has no fp8 index_copy: move the bytes through uint8 views
            k8 = (k / self.k_scale).to(self.k.dtype).view(torch.uint8)
            v8 = (v / self.v_scale).to(self.v.dtype).view(torch.uint8)
            self.k.view(torch.uint8).index_copy_(1, slots, k8)
            self.v.view(torch.uint8).index_copy_(1, slots, v8)
            return
        self.k.index_copy_(1, slots, k.to(self.k.dtype))
        self.v.index_copy_(1, slots, v.to(self.v.dtype))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at slots, as contiguous [kv_heads, len(slots), head_dim] in the compute dtype."""
        if self.is_fp8:
            k = self.k.view(torch.uint8).index_select(1, slots).view(self.k.dtype).to(dtype) * self.k_scale
            v = self.v.view(torch.uint8).index_select(1, slots).view(self.v.dtype).to(dtype) * self.v_scale
            return k, v
        return self.k.index_select(1, slots).to(dtype), self.v.index_select(1, slots).to(dtype)


class KVCache:
    """All layers' KV tensors for a pool of num_blocks blocks (groups: a grouped pool's
    layout, None for a tensor pair per layer). `pages`: the distinct tensor pairs."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 scales: tuple[float, float] = (1.0, 1.0), groups: KVGroupLayout | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.grouped = groups is not None
        self.null_block = num_blocks if groups is not None else None
        slots = (num_blocks + self.grouped) * block_size
        self.pages = [
            # Uninitialised: attention reads only slots written for that sequence, and
            # skipping the fill saves a pass over the whole pool at start-up.
            LayerKV(i, torch.empty(num_kv_heads, slots, head_dim, dtype=dtype, device=device),
                    torch.empty(num_kv_heads, slots, head_dim, dtype=dtype, device=device), *scales)
            for i in range(groups.page_layers if groups is not None else num_layers)
        ]
        if groups is None:
            self.layers = self.pages
            return
        page_of = {layer: j for ls in groups.layers for j, layer in enumerate(ls)}
        self.layers = [LayerKV(i, self.pages[page_of[i]].k, self.pages[page_of[i]].v, *scales)
                       for i in range(num_layers)]

    def make_host_copy(self, num_host_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host (CPU) tensors with room for num_host_blocks blocks per layer, for swapping."""
        pin = self.layers[0].k.is_cuda
        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((t.shape[0], num_host_blocks * self.block_size, t.shape[2]), dtype=t.dtype,
                               pin_memory=pin)
        return [(host(layer.k), host(layer.v)) for layer in self.pages]

    def _slots(self, blocks: list[int], device: torch.device) -> torch.Tensor:
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        return (b[:, None] * self.block_size + torch.arange(self.block_size, device=device)).reshape(-1)

    def swap(self, host: list[tuple[torch.Tensor, torch.Tensor]], swap_out: list[tuple[int, int]],
             swap_in: list[tuple[int, int]]) -> None:
        """Copy (device block -> host block) pairs out, then (host -> device) pairs in."""
        dev = self.layers[0].k.device
        if swap_out:
            src = self._slots([d for d, _ in swap_out], dev)
            dst = self._slots([h for _, h in swap_out], torch.device("cpu"))
            for layer, (hk, hv) in zip(self.pages, host):
                hk.view(torch.uint8).index_copy_(1, dst, layer.k.view(torch.uint8).index_select(1, src).cpu())
                hv.view(torch.uint8).index_copy_(1, dst, layer.v.view(torch.uint8).index_select(1, src).cpu())
        if swap_in:
            src = self._slots([h for h, _ in swap_in], torch.device("cpu"))
            dst = self._slots([d for _, d in swap_in], dev)
            for layer, (hk, hv) in zip(self.pages, host):
                layer.k.view(torch.uint8).index_copy_(1, dst, hk.view(torch.uint8).index_select(1, src).to(dev))
                layer.v.view(torch.uint8).index_copy_(1, dst, hv.view(torch.uint8).index_select(1, src).to(dev))

    def bytes_per_block(self) -> int:
        """Bytes of K and V of one block over all layers (a grouped pool's: over one page), as stored."""
        layer = self.pages[0]
        per_slot = layer.k.shape[0] * layer.k.shape[2] * layer.k.element_size() * 2
        return per_slot * self.block_size * len(self.pages)
