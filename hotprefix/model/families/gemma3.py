"""The Gemma 3 family (text): Llama's attention and MLP shapes with Gemma's differences.

- Five local (sliding-window) layers to one global (ModelArch.layer_types); the attention
  backend gives each layer its own window (BackendSpec.layer_windows), and local layers
  rotate with their own RoPE base (rope_local_theta, no scaling), global ones with
  rope_theta and rope_scaling (linear x8 from 4B on).
- Per-head RMSNorm of q and k before RoPE; query scale query_pre_attn_scalar^-1/2.
- Sandwich norms: after attention and after the MLP, each before its residual add.
- Embeddings times sqrt(hidden) (rounded to float32 first, as HF does); GeGLU with
  tanh-GELU; tied embeddings.
- RMSNorm weights used as (1 + w): HF checkpoints store w (ModelArch.norm_adds_one: 1 is
  added once, in float32, when the model is built), llama.cpp's GGUF files w + 1.

Module and weight names follow Hugging Face's (Gemma3ForCausalLM). Shapes as in llama.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from hotprefix.model.arch import ModelArch, ModelLoadError
from hotprefix.model.attention.base import AttentionBackend
from hotprefix.model.families.llama import MLP, Attention
from hotprefix.model.kv_cache import KVCache
from hotprefix.model.layers import (
    Embedding,
    LayerOps,
    RMSNorm,
    Rotary,
    block_logits,
    check_served,
    rope_inv_freq,
    take_embedding,
)
from hotprefix.model.weight_set import WeightSet

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, D]


class GemmaAttention(Attention):
    """Llama's attention with q/k norms on every head (as rows of D: the C kernels' norm in
    int8 mode, so that the fused decode step gives the same bits) and Gemma's query scale."""

    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str, backend: AttentionBackend,
                 ops_: LayerOps) -> None:
        super().__init__(arch, ws, prefix, backend, ops_)
        if self.q_norm is None:
            raise ModelLoadError("Gemma 3 needs q/k norms (FamilySpec.qk_norm)")
        self.scale = float(arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.norms_rows = True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, meta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x)
        q = self.q_norm(q.reshape(t * self.h, self.d)).view(t, self.h, self.d)
        k = self.k_norm(k.reshape(t * self.kvh, self.d)).view(t, self.kvh, self.d)
        q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        o = self.backend.attend(q, k, v, kv, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))


class Gemma3Layer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffn_norm(mlp(pre_ffn_norm(x)))."""

    def __init__(self, arch: ModelArch, ws: WeightSet, index: int, backend: AttentionBackend,
                 ops_: LayerOps) -> None:
        super().__init__()
        prefix, e, eps = f"model.layers.{index}", arch.hidden_size, arch.rms_norm_eps

        def norm(name: str) -> RMSNorm:
            return RMSNorm(ws.take(f"{prefix}.{name}.weight", (e,)), eps, ops_)

        self.input_layernorm = norm("input_layernorm")
        self.self_attn = GemmaAttention(arch, ws, f"{prefix}.self_attn", backend, ops_)
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.mlp = MLP(arch, ws, f"{prefix}.mlp", ops_)
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self.window = arch.window_of(index)  # None: global (rope_theta, scaled), else local (its own base)

    def forward(self, x: torch.Tensor, ropes: dict[int | None, Rope], kv, meta) -> torch.Tensor:
        cos, sin = ropes[self.window]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def decode_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """For the fused decode step: the norms before attention and before the MLP, and of
        their outputs."""
        return (self.input_layernorm, self.pre_feedforward_layernorm, self.post_attention_layernorm,
                self.post_feedforward_layernorm)


class _Inner(nn.Module):
    def __init__(self, arch: ModelArch, ws: WeightSet, backend: AttentionBackend, ops_: LayerOps,
                 embed: Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(Gemma3Layer(arch, ws, i, backend, ops_) for i in range(arch.num_layers))
        self.norm = RMSNorm(ws.take("model.norm.weight", (arch.hidden_size,)), arch.rms_norm_eps, ops_)


class Gemma3ForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv, meta) -> hidden [T, E];
    compute_logits(hidden [N, E]) -> [N, V] float32 (the tied embedding). Built complete
    from a WeightSet (ModelLoadError otherwise)."""

    def __init__(self, arch: ModelArch, ws: WeightSet, backend: AttentionBackend, ops_: LayerOps) -> None:
        super().__init__()
        if not arch.tie_word_embeddings:
            raise ModelLoadError("Gemma 3 ties its output to the embedding (tie_word_embeddings)")
        ws.drop("lm_head.weight")  # some checkpoints store the tied copy
        if arch.norm_adds_one:
            ws.add_to("norm.weight", 1.0)
        self.arch = arch
        v, e = ws.vocab_rows(arch.vocab_size), arch.hidden_size  # (of the rank's vocabulary rows)
        self.parallel = ws.parallel
        embed = "model.embed_tokens.weight"
        table = ws.take(embed, (v, e))  # None with GGUF rows on the CPU: lookups dequantize the rows they need
        self.logits_blocks = ws.blocks_for(embed, table)
        check_served(embed, table, self.logits_blocks, ws, (v, e))
        self.model = _Inner(arch, ws, backend, ops_, take_embedding(ws, embed, table))
        self.normalizer = float(torch.tensor(e ** 0.5, dtype=torch.float32))  # HF's embed_scale, as float32
        local = dataclasses.replace(arch, rope_theta=arch.rope_local_theta or arch.rope_theta, rope_scaling={})
        self.rotary = Rotary(rope_inv_freq(arch).to(ws.device))
        self.rotary_local = Rotary(rope_inv_freq(local).to(ws.device))
        ws.finish()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings [T, E] (a new tensor)."""
        return self.model.embed_tokens(input_ids) * self.normalizer

    def ropes_by_window(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[int | None, Rope]:
        """cos, sin [T, 1, D] of the positions for the layers of each window: the global
        layers' (None) and the local ones'."""
        return {w: self.rotary(positions, dtype) if w is None else self.rotary_local(positions, dtype)
                for w in set(self.arch.layer_windows)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: Any
                ) -> torch.Tensor:
        x = self.embed(input_ids)
        ropes = self.ropes_by_window(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_cache.layers):
            x = layer(x, ropes, kv, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] float32 of hidden [N, E]: on the embedding's blocks where there are,
        into `out` where it fits (over several ranks: gathered on rank 0, as LlamaForCausalLM's)."""
        logits = block_logits(hidden, self.logits_blocks, out)  # [N, V]
        if logits is None:
            logits = (hidden @ self.model.embed_tokens.weight.t()).float()  # [N, V]
        return self.parallel.gather_vocab(logits, self.arch.vocab_size)
