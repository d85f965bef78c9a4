"""The cpu backend: the C kernels over a float32 pool on the CPU (the default there).

Every query of a step, prefill chunk or decode, attends through csrc/attention.c's
hp_attend straight from the pool, in tiles aligned to absolute positions
(cpu_plan.py builds the step's plans): a query's logits are the same bits whether its
context came from the pool, a tier or this step, whatever the chunking and whoever shares
its step or its cascade. Keys and values are written in C first.

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
class CpuMeta:
    """A step for the cpu backend: where each token's K/V goes [T]; with the kernels, the
    plans (own, and the cascades' shared prefixes with the rows' state between the two
    passes); without, each sequence's slots and mask."""

    slot_mapping: torch.Tensor
    own: AttPlan | None = None
    shared: AttPlan | None = None
    state: AttState | None = None
    cascades: list[Cascade] = field(default_factory=list)
    seqs: list[SeqAttn] = field(default_factory=list)


class CpuAttention:
    """AttentionBackend (see base.py) on the C kernels; nothing is kept between steps."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.kernels = spec.kv_dtype in ops.KV_TYPES and spec.dtype == torch.float32 and \
            spec.device.type == "cpu" and library() is not None
        self.shape = Shape(spec.num_heads, spec.num_kv_heads, spec.sliding_window)
        if not self.kernels:
            log.warning("attention: %s KV without the C kernels runs in torch, whose results may differ in the "
                        "last bits with what else is in a step (batch invariance needs a float32 pool and the C "
                        "library)", spec.kv_dtype)

    def prepare(self, batch: StepBatch, paths: AttentionPaths) -> CpuMeta:
        meta = CpuMeta(batch.slot_mapping)
        if not self.kernels:
            s = self.spec
            meta.seqs = [build_seq_attn(span, batch.block_size, s.sliding_window, s.device) for span in batch.seqs]
            return meta
        meta.own, meta.shared, meta.cascades = step_plans(batch, self.shape, paths.cascade)
        if meta.shared is not None:
            meta.state = AttState.empty(batch.num_tokens * self.spec.num_heads, self.spec.head_dim)
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: CpuMeta,
               scale: float) -> torch.Tensor:
        if not self.kernels:
            kv.write(meta.slot_mapping, k, v)
            out = torch.empty_like(q)
            attend_seqs(q, k, v, kv, meta.seqs, scale, out, set())
            return out
        scales = (kv.k_scale, kv.v_scale)
        if ops.rows_dense(k, v):
            ops.kv_write(kv.k, kv.v, meta.slot_mapping, k, v, scales=scales)
        else:
            kv.write(meta.slot_mapping, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if meta.shared is not None:
            ops.attend(q, kv.k, kv.v, meta.shared, scale, out, meta.state, scales=scales)
        ops.attend(q, kv.k, kv.v, meta.own, scale, out, meta.state, scales=scales)
        return out

    def forget_step_state(self) -> None:
        """Nothing is kept between steps."""
