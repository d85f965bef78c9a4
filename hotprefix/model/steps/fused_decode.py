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
gate/up fused, their parts of any types), q/k norms only on rows of D in C (Gemma's;
Qwen3's run in torch), the cpu backend's float32 or fp8 pool, and a step of single-token
decodes or of at most MAX_TOKENS tokens (a warm prefix's question: its prefill chunk's
attention is plan tasks as a decode's is, and on 2 cores the layer-by-layer path's calls
were a quarter of its time); a larger step takes the layer-by-layer path, whose overhead
its work amortizes. Each of the backend's plan keys
(BackendSpec.plan_keys) is an attention kind of the C step, at most ops.KINDS of them:
with one block table, each window (Gemma's local and global layers); in a grouped pool,
each KV-cache group, whose layers write its slots and read its tables within its window,
as its layers do layer by layer. A kind's rotary tables are its window's. The family's
layers say which norms they have (`decode_norms`: Gemma's sandwich norms). Over
tensor-parallel ranks each rank runs its shard, and the C call hands o's and down's
partial products to the group's all-reduce between its stages (kernels/reduce.Reducer:
the same sums as the layer-by-layer path's RowParallelLinear, so the same bits).
"""

from __future__ import annotations

import torch

from hotprefix.model.attention.base import AttentionPaths, StepBatch
from hotprefix.model.attention.cpu import CpuAttention, CpuMeta
from hotprefix.model.kernels import ops
from hotprefix.model.kernels.reduce import Reducer
from hotprefix.model.kv_cache import KVCache

MAX_TOKENS = 64  # a step with a prefill chunk takes the fused path up to this many tokens (a product's M_CHUNK)


def unfusable(model, kv: KVCache, backend) -> str | None:
    """Why the layers of `model` over `kv` cannot run in hp_decode_layers, or None."""
    pool = kv.layers[0].k
    if not isinstance(backend, CpuAttention) or not backend.kernels:
        return "the attention backend is not the cpu one with the C kernels"
    if model.arch.num_experts:
        return "mixture-of-experts layers"
    if ops.kv_type(pool) is None:
        return "not a float32 or fp8 CPU pool"
    if len(backend.spec.plan_keys) > ops.KINDS:
        return f"more than {ops.KINDS} attention windows or KV-cache groups"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if a.q_norm is not None and not a.norms_rows:
            return "q/k norms over whole heads in torch"
        if any(p is None or not p.int8 for p in (a.qkv_blocks, a.o_proj.blocks, m.gate_up_blocks, m.down_proj.blocks)):
            return "a projection without int8 blocks"
    return None


def _layer(layer, lkv, kind: int) -> ops.DecodeLayer:
    a, m = layer.self_attn, layer.mlp
    norm1, norm2, post1, post2 = layer.decode_norms()
    return ops.DecodeLayer(norm1.weight, norm2.weight, a.qkv_blocks, a.o_proj.blocks, m.gate_up_blocks,
                           m.down_proj.blocks, a.qkv_bias, a.o_proj.bias, lkv.k, lkv.v, (lkv.k_scale, lkv.v_scale),
                           a.q_norm.weight if a.q_norm is not None else None,
                           a.k_norm.weight if a.k_norm is not None else None,
                           post1.weight if post1 is not None else None, post2.weight if post2 is not None else None,
                           m.gelu, kind)


class FusedDecode:
    """StepRunner (see steps/__init__.py) of the decoder layers of `model` over the pool
    `kv`. Holds the addresses of the model's weights and the pool's tensors: both must
    outlive it and stay where they are (the runner builds it once, after both). Raises
    ValueError when `unfusable` says why not."""

    name = "fused decode"

    def __init__(self, model, kv: KVCache, backend) -> None:
        why = unfusable(model, kv, backend)
        if why is not None:
            raise ValueError(f"this model and cache cannot take the fused decode path: {why}")
        self.model = model
        arch = model.arch
        spec = backend.spec
        self.keys = spec.plan_keys  # the attention kinds, in hp_step's order
        self.windows = [spec.key_window(k) for k in self.keys]  # each kind's rotary tables
        layers = [_layer(layer, lkv, self.keys.index(spec.key_of(lkv)))
                  for layer, lkv in zip(model.model.layers, kv.layers)]
        reducer = Reducer(model.parallel.all_reduce) if model.parallel.size > 1 else None  # (o's and down's sums)
        shape = ops.StackShape(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                               arch.intermediate_size, float(arch.rms_norm_eps), model.model.layers[0].self_attn.scale)
        self.stack = ops.DecodeStack(layers, shape, reducer)

    def refusal(self, batch: StepBatch, meta: CpuMeta, paths: AttentionPaths) -> str | None:
        """Serves a step of single-token decodes, or of at most MAX_TOKENS tokens, attended by the C kernel."""
        if not paths.fused_decode:
            return "turned off for this step"
        if batch.decode_only or batch.num_tokens <= MAX_TOKENS:
            return None
        return f"a prefill step of more than {MAX_TOKENS} tokens"

    def forward(self, batch: StepBatch, meta: CpuMeta) -> torch.Tensor:
        x = self.model.embed(batch.input_ids).contiguous()  # [T, E], updated in place below
        ropes = self.model.ropes_by_window(batch.positions, x.dtype)  # [T, 1, D] each
        kinds = [meta.windows[k] for k in self.keys]  # each key's slots and plans
        ops.decode_layers(self.stack, x, [ropes[w] for w in self.windows], [p.slot_mapping for p in kinds],
                          [(p.own, p.shared) for p in kinds])
        return self.model.model.norm(x)
