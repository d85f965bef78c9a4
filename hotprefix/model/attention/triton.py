"""The triton backend: the Triton kernels (model/kernels/triton_attention.py) read the
pool in place through a block table; compiled on CUDA, interpreted on the CPU (tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import torch

from hotprefix.model.attention.base import AttentionPaths, BackendSpec, StepBatch
from hotprefix.model.kernels import triton_attention
from hotprefix.model.kernels.triton_attention import TritonMeta, decode_splits
from hotprefix.model.kv_cache import LayerKV
from hotprefix.sizing import blocks_for_tokens


@dataclass
class TritonStep:
    """A step for the triton backend: where each token's K/V goes [T] (-1: nowhere, graph
    padding), the kernels' block tables, lengths and query rows (`triton`), and the same
    for each window of BackendSpec.windows (its sliding_window set; the tensors shared).
    A grouped pool's step (`grouped`) has each group's own slots and TritonMeta instead,
    by group."""

    slot_mapping: torch.Tensor
    triton: TritonMeta
    windows: dict[int | None, TritonMeta]
    group_slots: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, meta: TritonMeta, windows: tuple[int | None, ...]) -> TritonStep:
        return cls(slot_mapping, meta, {w: dataclasses.replace(meta, sliding_window=w or 0) for w in windows})

    @classmethod
    def grouped(cls, spec: BackendSpec, batch: StepBatch) -> TritonStep:
        views = spec.views(batch)
        return cls.of_groups([v.slot_mapping for _, _, v in views], [triton_meta(v, spec.device) for _, _, v in views],
                             tuple(w for _, w, _ in views))

    @classmethod
    def of_groups(cls, slots: list[torch.Tensor], metas: list[TritonMeta], windows: tuple[int | None, ...]
                  ) -> TritonStep:
        """A grouped pool's step from each group's slots, TritonMeta (no window set) and window."""
        m = {g: dataclasses.replace(t, sliding_window=w or 0) for g, (t, w) in enumerate(zip(metas, windows))}
        return cls(slots[0], m[0], m, dict(enumerate(slots)))

    def tables(self) -> list[tuple[torch.Tensor, TritonMeta]]:
        """(slots, TritonMeta) of each distinct block table: one, or a grouped pool's per group."""
        if self.group_slots:
            return [(self.group_slots[g], self.windows[g]) for g in self.group_slots]
        return [(self.slot_mapping, self.triton)]


def triton_meta(batch: StepBatch, device: torch.device) -> TritonMeta:
    """The step's TritonMeta (no window): each sequence's block table (padded with block 0
    to the widest), context length after the step, and query rows."""
    lens = [s.ctx_len for s in batch.seqs]
    blocks = [blocks_for_tokens(n, batch.block_size) for n in lens]
    width = max(blocks)
    table = [s.block_ids[:n] + [0] * (width - n) for s, n in zip(batch.seqs, blocks)]
    q_lens = [s.q_len for s in batch.seqs]
    max_q = max(q_lens)
    return TritonMeta(torch.tensor(table, dtype=torch.int32, device=device),
                      torch.tensor(lens, dtype=torch.int32, device=device),
                      torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device), max_q,
                      batch.block_size, decode_splits(max(lens)) if max_q == 1 else 1)


class TritonAttention:
    """AttentionBackend (see base.py) on the Triton kernels."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    def prepare(self, batch: StepBatch, paths: AttentionPaths) -> TritonStep:
        if self.spec.kv_groups is not None:
            return TritonStep.grouped(self.spec, batch)
        return TritonStep.of(batch.slot_mapping, triton_meta(batch, self.spec.device), self.spec.windows)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: TritonStep,
               scale: float) -> torch.Tensor:
        key = self.spec.key_of(kv)
        return triton_attention.paged_attention(q, k, v, kv, meta.group_slots.get(key, meta.slot_mapping),
                                                meta.windows[key], scale)

    def forget_step_state(self) -> None:
        """Nothing is kept between steps."""
