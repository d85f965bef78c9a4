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
class FamilySpec:
    """name: ours; hf_architectures / model_types: config.json's `architectures` entries and
    `model_type`; gguf: GGUF's `general.architecture`; module: "module:Class" of its model;
    qkv_bias: q/k/v projections carry biases; qk_norm: per-head RMSNorm of q and k;
    gguf_permutes_qk: llama.cpp stores this family's q/k rows permuted (interleaved rope).
    A mixture-of-experts family says so in its shape (ModelArch.num_experts > 0), not here:
    its module builds MoE layers (layers.SparseMoe) where the shape has experts."""

    name: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf: str | None
    module: str
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_permutes_qk: bool = False


_LLAMA = "hotprefix.model.families.llama:LlamaForCausalLM"
_QWEN3_MOE = "hotprefix.model.families.qwen3_moe:Qwen3MoeForCausalLM"
FAMILIES: dict[str, FamilySpec] = {f.name: f for f in (
    FamilySpec("llama", ("LlamaForCausalLM",), ("llama",), "llama", _LLAMA, gguf_permutes_qk=True),
    FamilySpec("mistral", ("MistralForCausalLM",), ("mistral",), "mistral", _LLAMA, gguf_permutes_qk=True),
    FamilySpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", _LLAMA, qkv_bias=True),
    FamilySpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", _LLAMA, qk_norm=True),
    FamilySpec("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "qwen3moe", _QWEN3_MOE, qk_norm=True),
)}
HF_ARCHITECTURES = {a: f.name for f in FAMILIES.values() for a in f.hf_architectures}
MODEL_TYPES = {t: f.name for f in FAMILIES.values() for t in f.model_types}
GGUF_ARCHITECTURES = {f.gguf: f.name for f in FAMILIES.values() if f.gguf}


def model_class(family: str) -> Any:
    """The nn.Module class that builds `family` (imports torch)."""
    module, _, name = FAMILIES[family].module.partition(":")
    return getattr(importlib.import_module(module), name)
