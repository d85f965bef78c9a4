"""Model families: one registry entry each (this file, torch-free: `hotprefix size` and the
loaders read it) naming the checkpoint names it answers to, its traits, and the module
that builds it (a family module over the shared layers of model/layers.py).

Adding a family is its module and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sharding:
    """How a family's weights split over tensor-parallel ranks (Megatron's scheme), by the
    module a weight belongs to (the name's part before `.weight` / `.bias`): column-parallel
    modules keep a rank's output rows (and bias), so each rank has its own heads or MLP
    columns; row-parallel ones a rank's input columns, their outputs summed over the ranks
    (one all-reduce each); vocabulary-parallel ones a rank's rows of the vocabulary (the
    embedding, the output head). Every other weight is whole on every rank."""

    column: tuple[str, ...]
    row: tuple[str, ...]
    vocab: tuple[str, ...]


# q/k/v and gate/up by columns, o and down by rows, the embedding and head by vocabulary rows
MEGATRON = Sharding(column=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), row=("o_proj", "down_proj"),
                    vocab=("embed_tokens", "lm_head"))


@dataclass(frozen=True)
class FamilySpec:
    """name: ours; hf_architectures / model_types: config.json's `architectures` entries and
    `model_type`; gguf: GGUF's `general.architecture`; module: "module:Class" of its model;
    qkv_bias: q/k/v projections carry biases; qk_norm: per-head RMSNorm of q and k;
    gguf_permutes_qk: llama.cpp stores this family's q/k rows permuted (interleaved rope);
    activations: the MLP activations its module runs (config.json's names, the first the
    default); window_pattern: layers of local (sliding-window) attention come in runs of
    window_pattern - 1 before a global one (0: none); norm_adds_one: HF checkpoints store
    RMSNorm weights as w for (1 + w); hf_defaults: config.json values its HF config class
    fills in when a file omits them; gguf_names: GGUF layer tensor names that map to other
    HF names than the Llama family's (model/gguf_loader.py); sharding: how its weights split
    over tensor-parallel ranks (None: it runs on one device only). A mixture-of-experts family
    says so in its shape (ModelArch.num_experts > 0), not here: its module builds MoE layers
    (layers.SparseMoe) where the shape has experts."""

    name: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf: str | None
    module: str
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_permutes_qk: bool = False
    activations: tuple[str, ...] = ("silu", "swish")
    window_pattern: int = 0
    norm_adds_one: bool = False
    hf_defaults: tuple[tuple[str, Any], ...] = ()
    gguf_names: tuple[tuple[str, str], ...] = ()
    sharding: Sharding | None = MEGATRON


_LLAMA = "hotprefix.model.families.llama:LlamaForCausalLM"
# Gemma3TextConfig's defaults (transformers), for config.json files that leave them out
_GEMMA3_DEFAULTS = (("head_dim", 256), ("query_pre_attn_scalar", 256), ("rope_theta", 1_000_000.0),
                    ("rope_local_base_freq", 10_000.0), ("sliding_window", 4096), ("tie_word_embeddings", True),
                    ("rms_norm_eps", 1e-6), ("max_position_embeddings", 131_072), ("bos_token_id", 2),
                    ("eos_token_id", 1), ("hidden_activation", "gelu_pytorch_tanh"), ("vocab_size", 262_208),
                    ("num_attention_heads", 8), ("num_key_value_heads", 4))
# llama.cpp's Gemma 3 names (gguf-py's TENSOR_NAMES: blk.N.post_attention_norm, ffn_norm,
# post_ffw_norm): four norms a layer (after attention and around the MLP)
_GEMMA3_GGUF = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))
_QWEN3_MOE = "hotprefix.model.families.qwen3_moe:Qwen3MoeForCausalLM"
FAMILIES: dict[str, FamilySpec] = {f.name: f for f in (
    FamilySpec("llama", ("LlamaForCausalLM",), ("llama",), "llama", _LLAMA, gguf_permutes_qk=True),
    FamilySpec("mistral", ("MistralForCausalLM",), ("mistral",), "mistral", _LLAMA, gguf_permutes_qk=True),
    FamilySpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", _LLAMA, qkv_bias=True),
    FamilySpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", _LLAMA, qk_norm=True),
    FamilySpec("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), "gemma3",
               "hotprefix.model.families.gemma3:Gemma3ForCausalLM", qk_norm=True,
               activations=("gelu_pytorch_tanh",), window_pattern=6, norm_adds_one=True,
               hf_defaults=_GEMMA3_DEFAULTS, gguf_names=_GEMMA3_GGUF),
    FamilySpec("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "qwen3moe", _QWEN3_MOE, qk_norm=True,
               sharding=None),  # (its experts are not split yet)
)}
HF_ARCHITECTURES = {a: f.name for f in FAMILIES.values() for a in f.hf_architectures}
MODEL_TYPES = {t: f.name for f in FAMILIES.values() for t in f.model_types}
GGUF_ARCHITECTURES = {f.gguf: f.name for f in FAMILIES.values() if f.gguf}


def model_class(family: str) -> Any:
    """The nn.Module class that builds `family` (imports torch)."""
    module, _, name = FAMILIES[family].module.partition(":")
    return getattr(importlib.import_module(module), name)
