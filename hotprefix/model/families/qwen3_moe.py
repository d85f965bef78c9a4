"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B and their successors): Qwen3's
decoder (GQA attention with per-head RMSNorm of q and k, RoPE) whose MLPs are mixtures of
experts: a router (`mlp.gate`, [X, E]) picks each token's top k of X SwiGLU experts by a
softmax over all of them, their weights renormalised over the chosen (norm_topk_prob), no
shared expert. Layers the shape keeps dense (mlp_only_layers, decoder_sparse_step) have
Llama's MLP. Everything but the MLP is families/llama.py's; the mixture is
layers.SparseMoe (experts read from their blocks on the CPU, kernels/triton_moe on CUDA).

HF names: `model.layers.{i}.mlp.gate.weight` and `...mlp.experts.{j}.{gate,up,down}_proj.weight`
(a GGUF file's 3-D `ffn_*_exps` become `...mlp.experts.{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

from torch import nn

from hotprefix.model.families.llama import MLP, LlamaForCausalLM
from hotprefix.model.layers import SparseMoe


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM (forward, compute_logits, built complete from a WeightSet) with a
    SparseMoe in each layer the shape routes (ModelArch.moe_layer)."""

    def mlp_class(self, layer: int) -> type[nn.Module]:
        return SparseMoe if self.arch.moe_layer(layer) else MLP
