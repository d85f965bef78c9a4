"""The cpu backend: the C kernels over a float32 pool on the CPU (the default there).

Every query of a step, prefill chunk or decode, attends through csrc/attention.c's
hp_attend straight from the pool, in tiles aligned to absolute positions
(cpu_plan.py builds the step's plans): a query's logits are the same bits whether its
context came from the pool, a tier or this step, whatever the chunking and whoever shares
its step or its cascade. Keys and values are written in C first.

Each layer attends within its own window (BackendSpec.layer_windows): a step holds one
set of plans per window (a window's plans skip cascades; a query's range starts at its
window), and a window no query of the step reaches past shares the global plans. In a
grouped pool, one set per KV-cache group (BackendSpec.plan_keys), each over its group's
tables and writing its group's slots.

The pool may be float32 or fp8 (e4m3, e5m2: read in place, value * scale; written in C,
rounded as torch's cast rounds). Without the C library, or for a pool of another dtype
(fp16, bf16), it attends as the torch backend does (per sequence, SDPA): correct, not
batch-invariant (logged at start).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hotprefix.model.attention.base import AttentionPaths, BackendSpec, StepBatch
from hotprefix.model.attention.cpu_plan import Cascade, Shape, step_plans
from hotprefix.model.attention.sdpa import SeqAttn, attend_seqs, build_seq_attn
from hotprefix.model.kernels import ops
from hotprefix.model.kernels.build import library
from hotprefix.model.kernels.ops import AttPlan, AttState
from hotprefix.model.kv_cache import LayerKV

log = logging.getLogger(__name__)


@dataclass
class CpuPlans:
    """One plan key's share of a step (a window's, or a KV-cache group's): the slots its
    layers write [T]; with the kernels, its plans (own, and the cascades' shared
    prefixes); without, each sequence's slots and mask."""

    slot_mapping: torch.Tensor
    own: AttPlan | None = None
    shared: AttPlan | None = None
    cascades: list[Cascade] = field(default_factory=list)
    seqs: list[SeqAttn] = field(default_factory=list)


@dataclass
class CpuMeta:
    """A step for the cpu backend: where each token's K/V goes [T] (the full group's, in a
    grouped pool), each plan key's plans (BackendSpec.plan_keys; every layer of a key
    reads the same), and the rows' state between a cascade's two passes (one buffer:
    layers run one at a time)."""

    slot_mapping: torch.Tensor
    windows: dict[int | None, CpuPlans] = field(default_factory=dict)
    state: AttState | None = None


class CpuAttention:
    """AttentionBackend (see base.py) on the C kernels; nothing is kept between steps."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.kernels = spec.kv_dtype in ops.KV_TYPES and spec.dtype == torch.float32 and \
            spec.device.type == "cpu" and library() is not None
        if not self.kernels:
            log.warning("attention: %s KV without the C kernels runs in torch, whose results may differ in the "
                        "last bits with what else is in a step (batch invariance needs a float32 pool and the C "
                        "library)", spec.kv_dtype)

    def _plans(self, batch: StepBatch, window: int | None, paths: AttentionPaths, full: CpuPlans | None
               ) -> CpuPlans:
        s = self.spec
        if not self.kernels:
            return CpuPlans(batch.slot_mapping,
                            seqs=[build_seq_attn(span, batch.block_size, window, s.device) for span in batch.seqs])
        if full is not None and not full.cascades and all(span.ctx_len <= window for span in batch.seqs):
            return full  # no query reaches past the window: the same rows, ranges and slots
        shape = Shape(s.num_heads, s.num_kv_heads, window, torch.get_num_threads())
        own, shared, groups = step_plans(batch, shape, paths.cascade)
        return CpuPlans(batch.slot_mapping, own, shared, groups)

    def prepare(self, batch: StepBatch, paths: AttentionPaths) -> CpuMeta:
        meta = CpuMeta(batch.slot_mapping)
        full = None
        grouped = self.spec.kv_groups is not None  # (each group's tables are its own: no plans shared)
        for key, w, view in self.spec.views(batch):  # the global plan first
            meta.windows[key] = self._plans(view, w, paths, None if grouped else full)
            full = meta.windows[key] if w is None else full
        if any(p.shared is not None for p in meta.windows.values()):
            meta.state = AttState.empty(batch.num_tokens * self.spec.num_heads, self.spec.head_dim)
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: CpuMeta,
               scale: float) -> torch.Tensor:
        plans = meta.windows[self.spec.key_of(kv)]
        if not self.kernels:
            kv.write(plans.slot_mapping, k, v)
            out = torch.empty_like(q)
            attend_seqs(q, k, v, kv, plans.seqs, scale, out, set())
            return out
        scales = (kv.k_scale, kv.v_scale)
        if ops.rows_dense(k, v):
            ops.kv_write(kv.k, kv.v, plans.slot_mapping, k, v, scales=scales)
        else:
            kv.write(plans.slot_mapping, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if plans.shared is not None:
            ops.attend(q, kv.k, kv.v, plans.shared, scale, out, meta.state, scales=scales)
        ops.attend(q, kv.k, kv.v, plans.own, scale, out, meta.state, scales=scales)
        return out

    def forget_step_state(self) -> None:
        """Nothing is kept between steps."""
