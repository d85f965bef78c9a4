"""The torch backend: every sequence's context gathered from the block table, then
SDPA (torch's CPU flash kernel where SDPA would not pick it). The reference the other
backends are tested against; on any device and dtype, fp8 KV included."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotprefix.model.attention.base import AttentionPaths, BackendSpec, StepBatch
from hotprefix.model.attention.sdpa import SeqAttn, attend_seqs, build_seq_attn
from hotprefix.model.kv_cache import LayerKV


@dataclass
class TorchMeta:
    """A step for the torch backend: for each plan key (BackendSpec.plan_keys: a window,
    or a grouped pool's group), where each token's K/V goes [T] and each sequence's slots
    and mask."""

    slots: dict[int | None, torch.Tensor]
    windows: dict[int | None, list[SeqAttn]]


class TorchAttention:
    """AttentionBackend (see base.py) in torch alone."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    def prepare(self, batch: StepBatch, paths: AttentionPaths) -> TorchMeta:
        s = self.spec
        views = s.views(batch)
        return TorchMeta({key: view.slot_mapping for key, _, view in views},
                         {key: [build_seq_attn(span, batch.block_size, w, s.device) for span in view.seqs]
                          for key, w, view in views})

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: TorchMeta,
               scale: float) -> torch.Tensor:
        key = self.spec.key_of(kv)
        kv.write(meta.slots[key], k, v)
        out = torch.empty_like(q)
        attend_seqs(q, k, v, kv, meta.windows[key], scale, out, set())
        return out

    def forget_step_state(self) -> None:
        """Nothing is kept between steps."""
