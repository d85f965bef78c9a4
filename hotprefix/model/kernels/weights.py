"""Weights as the C kernels read them: a weight's GGUF blocks as stored in the file
(PackedWeight), the same blocks regrouped by 16 rows for int8 products, float32 rows
(type F32, a view of the float weight), and several weights over one input multiplied as
one product (FusedWeight: q, k and v; gate and up), and a mixture's experts (ExpertBlocks:
[X, N, K], one expert's blocks after another).

Types (GGML ids): F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 values a block) and the K-quants
Q4_K, Q5_K, Q6_K (256). On the CPU every product of every batch size reads them: float32
mode with float32 activations, int8 mode on the regrouped blocks.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

import torch

from hotprefix.model.kernels.abi import HpPart
from hotprefix.model.kernels.build import need

F32 = 0  # GGML's id of float32 rows
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # GGML ids
BLOCK_BYTES = {F32: 128, 2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}
BLOCK_VALUES = {t: 256 if t >= 12 else 32 for t in BLOCK_BYTES}  # values per block
TYPE_NAMES = {v: k for k, v in QTYPES.items()} | {F32: "F32"}


def split_blocks(raw: torch.Tensor, type_name: str, block: tuple[int, int], dim: int, start: int, stop: int,
                 rows: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of GGUF block rows raw [N, bytes a row] (dim 0; padded with zero
    blocks, which are zeros in every type, to `rows`) or columns [start, stop) (dim 1, on
    the boundaries of blocks of block = (values, bytes)): a copy owning only those bytes.
    Raises ValueError for columns off block boundaries."""
    if dim == 0:
        part = raw[start:stop].clone()
        if rows is not None and rows > part.shape[0]:
            part = torch.cat([part, part.new_zeros((rows - part.shape[0], part.shape[1]))])
        return part
    values, nbytes = block
    if start % values or stop % values:
        raise ValueError(f"{type_name} blocks of {values} values do not split columns {start}..{stop}")
    return raw[:, start // values * nbytes:stop // values * nbytes].contiguous()


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight kept as its GGUF blocks: `raw` is uint8 [N, K / block values *
    block bytes] (the file's rows, often a view of the mapped file), or with `int8`, the
    same blocks regrouped by 16 rows (csrc/repack.c) for the int8-activation product."""

    qtype: int
    raw: torch.Tensor
    n: int
    k: int
    int8: bool = False

    @property
    def parts(self) -> tuple[PackedWeight, ...]:
        return (self,)

    @cached_property
    def part_table(self) -> ctypes.Array:
        """The kernel's HpPart table for this weight, built once (it points into `raw`)."""
        return part_table(self.parts)

    def regrouped_bytes(self, lib: ctypes.CDLL | None = None) -> int:
        """Bytes of the int8 form of these rows."""
        return int(need(lib).hp_repacked_bytes(self.qtype, self.n, self.k))

    def regrouped(self, lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> PackedWeight:
        """The int8-activation form of these GGUF rows (a new weight; self is unchanged),
        written into `out` (uint8, regrouped_bytes long: e.g. a view of a mapped cache
        file) or a new tensor. Raises RuntimeError without the library, ValueError for a
        wrong `out`."""
        if self.int8:
            return self
        lib = need(lib)
        size = self.regrouped_bytes(lib)
        out = torch.empty(size, dtype=torch.uint8) if out is None else out
        if out.numel() != size or out.dtype != torch.uint8 or not out.is_contiguous() or not self.raw.is_contiguous():
            raise ValueError(f"regrouped: out must be {size} contiguous bytes, and the rows contiguous")
        if lib.hp_repack(self.qtype, self.raw.data_ptr(), self.n, self.k, out.data_ptr()):
            raise RuntimeError(f"hp_repack failed for type {self.qtype}, K={self.k}")
        return PackedWeight(self.qtype, out, self.n, self.k, int8=True)

    @classmethod
    def from_gguf(cls, type_name: str, raw: torch.Tensor, n: int, k: int) -> PackedWeight | None:
        """The rows of a GGUF tensor of `type_name` ([N, K] in HF's order), or None for a
        type the kernels do not read or a K its blocks do not divide."""
        qtype = QTYPES.get(type_name)
        if qtype is None or k <= 0 or k % BLOCK_VALUES[qtype]:
            return None
        raw = raw.reshape(n, k // BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype])
        return cls(qtype, raw if raw.is_contiguous() else raw.contiguous(), n, k)

    def part(self, dim: int, start: int, stop: int, rows: int | None = None) -> PackedWeight:
        """Rows [start, stop) (dim 0; padded with zero blocks, which are zeros, to `rows`) or
        columns [start, stop) (dim 1, on block boundaries) of these GGUF rows, a copy owning
        only those bytes. Raises ValueError for columns off block boundaries or regrouped rows."""
        if self.int8:
            raise ValueError("regrouped rows are not split")
        raw = split_blocks(self.raw, self.type_name, (BLOCK_VALUES[self.qtype], BLOCK_BYTES[self.qtype]), dim, start,
                           stop, rows)
        return PackedWeight(self.qtype, raw, raw.shape[0], self.k if dim == 0 else stop - start)

    def rows(self, ids: torch.Tensor) -> PackedWeight:
        """Rows `ids` ([T]) of these GGUF rows, as a weight of T rows (an embedding lookup)."""
        picked = self.raw.index_select(0, ids)
        return PackedWeight(self.qtype, picked, picked.shape[0], self.k)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> PackedWeight | None:
        """Float32 rows w [N, K] as F32 blocks (a view: w must outlive them), or None when K
        is not a multiple of 32 or w is not a contiguous float32 CPU tensor."""
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] % BLOCK_VALUES[F32] \
                or not w.is_contiguous():
            return None
        return cls(F32, w.view(torch.uint8), w.shape[0], w.shape[1])

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


@dataclass(frozen=True)
class FusedWeight:
    """Weights over one input multiplied as one product whose outputs are their columns
    side by side (q, k and v; gate and up). The parts may differ in type: a Q4_K_M layer's
    q and k are Q4_K and its v Q6_K. In int8 mode the kernel runs every part's groups in
    one work-sharing loop; in float32 mode each part is its own product."""

    parts: tuple[PackedWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({p.k for p in self.parts}) != 1 or len({p.int8 for p in self.parts}) != 1:
            raise ValueError("fused weights need one K and one form")

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def int8(self) -> bool:
        return self.parts[0].int8

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @cached_property
    def part_table(self) -> ctypes.Array:
        """The kernel's HpPart table for these parts, built once (it points into their `raw`)."""
        return part_table(self.parts)

    def regrouped(self, lib: ctypes.CDLL | None = None) -> FusedWeight:
        return FusedWeight(tuple(p.regrouped(lib) for p in self.parts))


Blocks = PackedWeight | FusedWeight


@dataclass(frozen=True)
class ExpertBlocks:
    """A mixture's [X, N, K] expert weights (X experts of [N, K]) kept as blocks: `raw` is
    uint8 [X, bytes of one expert], each expert's N rows as GGUF stores them (a view of the
    mapped file) or, with `int8`, regrouped by 16 rows as PackedWeight's are, expert by
    expert; F32 rows for float32 weights. A product reads only the experts it is given."""

    qtype: int
    raw: torch.Tensor
    experts: int
    n: int
    k: int
    int8: bool = False

    @property
    def expert_bytes(self) -> int:
        return self.raw.shape[1]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    def expert(self, e: int) -> PackedWeight:
        """Expert e's [N, K] rows (a view)."""
        return PackedWeight(self.qtype, self.raw[e].view(self.n, -1) if not self.int8 else self.raw[e],
                            self.n, self.k, self.int8)

    def regrouped_bytes(self, lib: ctypes.CDLL | None = None) -> int:
        return self.experts * self.expert(0).regrouped_bytes(lib)

    def regrouped(self, lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> ExpertBlocks:
        """The int8-activation form, expert by expert (a new weight), written into `out`
        (uint8, regrouped_bytes long) or a new tensor. Raises as PackedWeight.regrouped."""
        if self.int8:
            return self
        size = self.regrouped_bytes(lib)
        out = torch.empty(size, dtype=torch.uint8) if out is None else out
        if out.numel() != size:
            raise ValueError(f"regrouped: out must be {size} bytes")
        per = out.view(self.experts, size // self.experts)
        for e in range(self.experts):
            self.expert(e).regrouped(lib, out=per[e])
        return ExpertBlocks(self.qtype, per, self.experts, self.n, self.k, int8=True)

    @classmethod
    def from_gguf(cls, type_name: str, raw: torch.Tensor, experts: int, n: int, k: int) -> ExpertBlocks | None:
        """The blocks of a GGUF [X, N, K] tensor (raw: its X * N rows), or None as
        PackedWeight.from_gguf."""
        p = PackedWeight.from_gguf(type_name, raw, experts * n, k)
        return None if p is None else cls(p.qtype, p.raw.view(experts, -1), experts, n, k)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> ExpertBlocks | None:
        """Float32 [X, N, K] as F32 blocks (a view), or None as PackedWeight.from_float."""
        if w.dim() != 3 or not w.is_contiguous() or PackedWeight.from_float(w.view(-1, w.shape[2])) is None:
            return None
        return cls(F32, w.view(torch.uint8).view(w.shape[0], -1), *w.shape)


def float_blocks(w: torch.Tensor) -> PackedWeight | ExpertBlocks | None:
    """A float32 CPU weight's rows as F32 blocks (2-D: PackedWeight, 3-D: ExpertBlocks), or None."""
    return ExpertBlocks.from_float(w) if w.dim() == 3 else PackedWeight.from_float(w)


def part_table(parts: tuple[PackedWeight, ...]) -> ctypes.Array:
    """The kernel's HpPart table of `parts` (it points into their `raw`, which must outlive it)."""
    return (HpPart * len(parts))(*(HpPart(p.raw.data_ptr(), p.qtype, p.n) for p in parts))


def fuse(ws: list[PackedWeight | None]) -> FusedWeight | None:
    """One product for several projections of the same input, or None unless all are
    given with one K, as GGUF rows or all regrouped."""
    if not ws or any(w is None for w in ws) or len({(w.k, w.int8) for w in ws}) != 1:
        return None
    return FusedWeight(tuple(ws))
