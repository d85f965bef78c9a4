"""Attention backends: how a layer's attention reads the paged KV pool. One file per
backend behind base.AttentionBackend, created from the registry below:

- cpu (cpu.py, cpu_decode.py): the C kernels over a float32 pool; the default on the CPU;
- torch (torch_ref.py): gather + SDPA, the reference the others are tested against;
- triton (triton.py): the Triton kernels, the default on CUDA where triton is installed.

A new backend (or a window/sink variant) joins by a file and a registry entry.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from hotprefix.config import AttentionBackend as BackendKind
from hotprefix.config import ConfigError
from hotprefix.model.attention.base import ALL_PATHS, AttentionBackend, AttentionPaths, BackendSpec, StepBatch

__all__ = ["ALL_PATHS", "AttentionBackend", "AttentionPaths", "BackendSpec", "StepBatch", "create_backend",
           "resolve_backend"]

log = logging.getLogger(__name__)
# kind -> "module:class" (imported when chosen: the triton backend imports triton)
REGISTRY: dict[BackendKind, str] = {
    BackendKind.CPU: "hotprefix.model.attention.cpu:CpuAttention",
    BackendKind.TORCH: "hotprefix.model.attention.torch_ref:TorchAttention",
    BackendKind.TRITON: "hotprefix.model.attention.triton:TritonAttention",
}


def resolve_backend(choice: BackendKind, device: torch.device) -> BackendKind:
    """The attention backend for this device, AUTO resolved (see config.AttentionBackend).
    Raises ConfigError for a choice that cannot run here."""
    has_triton = importlib.util.find_spec("triton") is not None
    if choice is BackendKind.AUTO:
        if device.type == "cuda":
            return BackendKind.TRITON if has_triton else BackendKind.TORCH
        return BackendKind.CPU
    if choice is BackendKind.CPU and device.type != "cpu":
        raise ConfigError("--attention-backend cpu runs on the CPU only; use triton or torch with --device cuda")
    if choice is BackendKind.TRITON and not has_triton:
        raise ConfigError("--attention-backend triton: the triton package is not installed (pip install triton)")
    return choice


def create_backend(kind: BackendKind, spec: BackendSpec) -> AttentionBackend:
    """The registered backend of `kind` (resolved: not AUTO)."""
    module, _, name = REGISTRY[kind].partition(":")
    if kind is not BackendKind.CPU:  # said at start, never silently (docs/engine.md, "Batch invariance")
        log.warning("--attention-backend %s: a token's logits may differ in the last bits with the other requests "
                    "of its step, its cached prefix and its chunking (batch invariance is the cpu backend's)",
                    kind.value)
    return getattr(importlib.import_module(module), name)(spec)
