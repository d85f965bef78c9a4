"""Decode steps through every decoder layer in one C call (csrc/decode.c's
hp_decode_layers), in int8 mode on the CPU.

A step in which every sequence decodes one token spends a large share of its time
between kernels on 2 cores: about ten ctypes calls per layer, each opening its own
OpenMP region, and torch's small ops between them (docs/benchmarks.md measures it).
FusedDecode hands the whole stack of layers to one call that keeps its threads in one
parallel region. Each stage runs the same C code as the layer-by-layer path, so the
hidden states are the same bits (tests/model/test_fused_decode.py compares them);
the embedding, the final norm and the logits stay in Python.

It serves only what it was built for: int8 blocks for every projection (q/k/v and
gate/up fused, their parts of any types), no q/k norms, a float32 KV pool on the CPU, and a step of single-token
decodes (any other step takes the layer-by-layer path). A cascade's shared prefix is
attended once for its group and merged into each member's rows by log-sum-exp, as the
layer-by-layer path does; that merge is the one stage not computed in the same order
(C's expf/log1pf against torch's logaddexp), so such steps agree to float rounding.
"""

from __future__ import annotations

import ctypes

import torch

from hotprefix.model.attention import AttentionMetadata, paged_plan_own, paged_plan_shared
from hotprefix.model.kernel_abi import HpLayer, HpStack, HpStep
from hotprefix.model.kv_cache import KVCache
from hotprefix.model.llama import LlamaForCausalLM
from hotprefix.model.qlinear import Blocks


def fusable(model: LlamaForCausalLM, kv: KVCache, lib: ctypes.CDLL | None) -> bool:
    """Whether every layer of `model` over `kv` can run in hp_decode_layers."""
    pool = kv.layers[0].k
    if lib is None or model.arch.qk_norm or pool.dtype != torch.float32 or pool.device.type != "cpu":
        return False
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        packs = (a.qkv_packed, a.o_proj.packed, m.gate_up_packed, m.down_proj.packed)
        if any(p is None or not p.int8 for p in packs):
            return False
    return True


class FusedDecode:
    """The decoder layers of `model` over the pool `kv`, for hp_decode_layers. Holds the
    addresses of the model's weights and the pool's tensors: both must outlive it and
    stay where they are (the runner builds it once, after both). Raises ValueError
    unless `fusable`."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, lib: ctypes.CDLL) -> None:
        if not fusable(model, kv, lib):
            raise ValueError("this model and cache cannot take the fused decode path")
        self.model, self.kv, self.lib = model, kv, lib
        arch = model.arch
        self.h, self.kvh = arch.num_heads, arch.num_kv_heads
        self.layers = (HpLayer * arch.num_layers)()
        for spec, layer, lkv in zip(self.layers, model.model.layers, kv.layers):
            a, m = layer.self_attn, layer.mlp
            spec.norm1, spec.norm2 = layer.input_layernorm.weight.data_ptr(), \
                layer.post_attention_layernorm.weight.data_ptr()
            spec.nqkv = _set_parts(spec.qkv, a.qkv_packed)
            spec.ngu = _set_parts(spec.gu, m.gate_up_packed)
            _set_parts((spec.o,), a.o_proj.packed)
            _set_parts((spec.down,), m.down_proj.packed)
            spec.b_qkv = a.qkv_bias.data_ptr() if a.qkv_bias is not None else None
            spec.b_o = a.o_proj.bias.data_ptr() if a.o_proj.bias is not None else None
            spec.kpool, spec.vpool = lkv.k.data_ptr(), lkv.v.data_ptr()
        self.stack = HpStack(self.layers, arch.num_layers, arch.hidden_size, self.h, self.kvh, arch.head_dim,
                             arch.intermediate_size, float(model.model.norm.eps),
                             model.model.layers[0].self_attn.scale, kv.layers[0].k.shape[1] * arch.head_dim)

    @staticmethod
    def serves(meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step's batch is single-token decodes only, attended by the kernel."""
        d = meta.decode
        return d is not None and d.kernel is not None and len(d.members) == len(meta.seqs) == num_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [T, E] of a step that `serves` accepts; writes the
        step's keys and values into the pool. Raises RuntimeError if the kernel fails."""
        x = self.model.model.embed_tokens(input_ids).contiguous()  # [T, E], updated in place below
        cos, sin = self.model.rope(positions, x.dtype)  # [T, 1, D] each
        plan = paged_plan_own(meta, self.h, self.kvh)
        shared = paged_plan_shared(meta, self.h, self.kvh)
        slots = meta.slot_mapping.contiguous()
        step = HpStep(x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), wslots=slots.data_ptr(),
                      rows=plan.rows.data_ptr(), task=plan.task.data_ptr(), aslots=plan.slots.data_ptr(),
                      M=x.shape[0], ntasks=plan.task.shape[0])
        if shared is not None:
            step.srows, step.stask = shared.rows.data_ptr(), shared.task.data_ptr()
            step.sslots = shared.slots.data_ptr()
            step.nsrows, step.nstasks = shared.rows.numel(), shared.task.shape[0]
        rc = self.lib.hp_decode_layers(ctypes.byref(self.stack), ctypes.byref(step), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"hp_decode_layers failed ({rc})")
        return self.model.model.norm(x)


def _set_parts(slots, w: Blocks) -> int:
    """Write w's parts (regrouped weights) into the HpPart slots; returns how many."""
    parts = w.parts
    if len(parts) > len(slots):
        raise ValueError(f"{len(parts)} parts, room for {len(slots)}")
    for slot, p in zip(slots, parts):
        slot.w, slot.qtype, slot.n = p.raw.data_ptr(), p.qtype, p.n
    return len(parts)
