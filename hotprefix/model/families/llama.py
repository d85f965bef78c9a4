"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Module and weight names follow Hugging Face's, so a HF state dict's names are the
WeightSet's. Qwen2 adds q/k/v biases, Qwen3 per-head RMSNorm of q and k.
Shapes: T = tokens in the flat batch, H = query heads, KVH = KV heads, D = head dim,
E = hidden size, I = MLP size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hotprefix.model.arch import ModelArch
from hotprefix.model.attention.base import AttentionBackend
from hotprefix.model.families import FAMILIES
from hotprefix.model.kernels import ops
from hotprefix.model.kernels.weights import fuse
from hotprefix.model.kv_cache import KVCache
from hotprefix.model.layers import (
    Embedding,
    LayerOps,
    Linear,
    RMSNorm,
    Rotary,
    block_logits,
    check_served,
    rope_inv_freq,
    take_embedding,
    take_linear,
)
from hotprefix.model.weight_set import WeightSet


def _fused(linears: list[Linear]):
    """One block product for projections of one input (q/k/v, gate/up), or None; the
    parts' own blocks are then not used."""
    blocks = fuse([lin.blocks for lin in linears])
    if blocks is not None:
        for lin in linears:
            lin.blocks = None
    return blocks


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str, backend: AttentionBackend,
                 ops_: LayerOps) -> None:
        super().__init__()
        self.h, self.kvh, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        e, hd, kvd = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        bias = FAMILIES[arch.family].qkv_bias
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        self.q_proj, self.k_proj, self.v_proj = (take_linear(ws, n, size, e, bias)
                                                 for n, size in zip(names, (hd, kvd, kvd)))
        self.qkv_blocks = _fused([self.q_proj, self.k_proj, self.v_proj])  # q, k and v as one product
        self.qkv_bias = None if self.q_proj.bias is None else \
            torch.cat([p.bias.detach() for p in (self.q_proj, self.k_proj, self.v_proj)])
        self.o_proj = take_linear(ws, f"{prefix}.o_proj", e, hd, bias=False)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(ws.take(f"{prefix}.q_norm.weight", (self.d,)), arch.rms_norm_eps, ops_)
            self.k_norm = RMSNorm(ws.take(f"{prefix}.k_norm.weight", (self.d,)), arch.rms_norm_eps, ops_)
        self.scale = self.d ** -0.5
        self.backend, self.ops = backend, ops_
        self.norms_rows = False  # q/k norms over [T, H, D] in torch (Gemma's run on rows of D in C)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D]: one block product when the fused blocks serve."""
        t = x.shape[0]
        if self.qkv_blocks is not None:
            qkv = ops.qmatmul(x, self.qkv_blocks)  # [T, (H + 2 KVH) D]
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            q, k, v = qkv.split((self.h * self.d, self.kvh * self.d, self.kvh * self.d), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(t, self.h, self.d), k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, meta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)  # cos, sin: [T, 1, D]
        o = self.backend.attend(q, k, v, kv, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu), or GeGLU (gelu_pytorch_tanh: Gemma)."""

    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str, ops_: LayerOps) -> None:
        super().__init__()
        e, i = arch.hidden_size, arch.intermediate_size
        names = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_proj, self.up_proj = (take_linear(ws, n, i, e) for n in names)
        self.down_proj = take_linear(ws, f"{prefix}.down_proj", e, i)
        self.gate_up_blocks = _fused([self.gate_proj, self.up_proj])  # gate and up as one product
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"
        self.act_mul = ops_.gelu_tanh_mul if self.gelu else ops_.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.gate_up_blocks
        if blocks is not None:
            return self.down_proj(self.act_mul(ops.qmatmul(x, blocks)))  # [T, 2I] -> [T, I]
        gate = self.gate_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention, then the MLP (`mlp`: a class built as MLP is, e.g. layers.SparseMoe),
    each after its RMSNorm, each added to the residual."""

    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str, backend: AttentionBackend,
                 ops_: LayerOps, mlp: type[nn.Module] = MLP) -> None:
        super().__init__()
        e, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(ws.take(f"{prefix}.input_layernorm.weight", (e,)), eps, ops_)
        self.self_attn = Attention(arch, ws, f"{prefix}.self_attn", backend, ops_)
        self.post_attention_layernorm = RMSNorm(ws.take(f"{prefix}.post_attention_layernorm.weight", (e,)), eps,
                                                ops_)
        self.mlp = mlp(arch, ws, f"{prefix}.mlp", ops_)

    def forward(self, x, cos, sin, kv, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """For the fused decode step: the norms before attention and before the MLP, and of
        their outputs (none here)."""
        return self.input_layernorm, self.post_attention_layernorm, None, None


class _Inner(nn.Module):
    def __init__(self, arch: ModelArch, ws: WeightSet, backend: AttentionBackend, ops_: LayerOps,
                 embed: Embedding, mlp: Callable[[int], type[nn.Module]]) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(DecoderLayer(arch, ws, f"model.layers.{i}", backend, ops_, mlp(i))
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(ws.take("model.norm.weight", (arch.hidden_size,)), arch.rms_norm_eps, ops_)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv, meta) -> hidden [T, E];
    compute_logits(hidden [N, E]) -> [N, V] float32. Built complete from a WeightSet
    (every weight taken, shapes checked: ModelLoadError otherwise)."""

    def __init__(self, arch: ModelArch, ws: WeightSet, backend: AttentionBackend, ops_: LayerOps) -> None:
        super().__init__()
        if arch.tie_word_embeddings:
            ws.drop("lm_head.weight")  # some checkpoints store the tied copy
        ws.drop_suffix("rotary_emb.inv_freq")
        self.arch = arch
        v, e = ws.vocab_rows(arch.vocab_size), arch.hidden_size  # (of the rank's vocabulary rows)
        self.parallel = ws.parallel
        embed = "model.embed_tokens.weight"
        table = ws.take(embed, (v, e))  # None with GGUF rows on the CPU: lookups dequantize the rows they need
        if arch.tie_word_embeddings:
            self.logits_blocks = ws.blocks_for(embed, table)
            check_served(embed, table, self.logits_blocks, ws, (v, e))
        elif table is None:
            ws.count_served((v, e))
        self.model = _Inner(arch, ws, backend, ops_, take_embedding(ws, embed, table), self.mlp_class)
        if not arch.tie_word_embeddings:
            self.lm_head = take_linear(ws, "lm_head", v, e)
            self.logits_blocks = self.lm_head.blocks
        self.rotary = Rotary(rope_inv_freq(arch, ws.pop_raw("rope_freqs")).to(ws.device))
        ws.finish()

    def mlp_class(self, layer: int) -> type[nn.Module]:
        """The MLP of decoder layer `layer` (a family whose layers differ overrides it)."""
        return MLP

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: Any
                ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_cache.layers):
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, E] of input_ids."""
        return self.model.embed_tokens(input_ids)

    def ropes_by_window(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[int | None, tuple]:
        """cos, sin [T, 1, D] of the positions (computed in float32) for the layers of each
        window (one table: every layer rotates alike)."""
        rope = self.rotary(positions, dtype)
        return {w: rope for w in set(self.arch.layer_windows)}

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] float32 of hidden [N, E]: on the head's blocks where there are, into
        `out` where it fits (layers.block_logits); over several ranks each rank's vocabulary
        rows, gathered on rank 0 (the others get theirs)."""
        logits = block_logits(hidden, self.logits_blocks, out)  # [N, V]
        if logits is None:
            w = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
            logits = (hidden @ w.t()).float()  # [N, V]
        return self.parallel.gather_vocab(logits, self.arch.vocab_size)
