"""Which attention backend a runner uses, and what the triton backend needs from it:
the choice (made once, when the runner is built), each step's TritonMeta, and the CUDA
graphs of decode steps. See config.AttentionBackend and docs/architecture.md."""

from __future__ import annotations

import importlib.util
import logging
from itertools import accumulate
from typing import Any

import torch

from hotprefix.config import AttentionBackend, ConfigError, ModelConfig, SchedulerConfig
from hotprefix.core.outputs import SchedulerOutput
from hotprefix.model.kv_cache import KVCache
from hotprefix.sizing import blocks_for_tokens

log = logging.getLogger(__name__)


def resolve_backend(choice: AttentionBackend, device: torch.device) -> AttentionBackend:
    """The attention backend for this device, AUTO resolved (see AttentionBackend).
    Raises ConfigError for a choice that cannot run here."""
    has_triton = importlib.util.find_spec("triton") is not None
    if choice is AttentionBackend.AUTO:
        if device.type == "cuda":
            return AttentionBackend.TRITON if has_triton else AttentionBackend.TORCH
        return AttentionBackend.CPU
    if choice is AttentionBackend.CPU and device.type != "cpu":
        raise ConfigError("--attention-backend cpu runs on the CPU only; use triton or torch with --device cuda")
    if choice is AttentionBackend.TRITON and not has_triton:
        raise ConfigError("--attention-backend triton: the triton package is not installed (pip install triton)")
    return choice


def triton_meta(sched: SchedulerOutput, block_size: int, sliding_window: int | None, device: torch.device) -> Any:
    """The step's triton_attention.TritonMeta: each sequence's block table (padded with
    block 0 to the widest), context length after the step, and query rows."""
    from hotprefix.model.triton_attention import TritonMeta, decode_splits

    lens = [r.start_pos + len(r.token_ids) for r in sched.requests]
    blocks = [blocks_for_tokens(n, block_size) for n in lens]
    width = max(blocks)
    table = [r.block_ids[:n] + [0] * (width - n) for r, n in zip(sched.requests, blocks)]
    q_lens = [len(r.token_ids) for r in sched.requests]
    max_q = max(q_lens)
    return TritonMeta(torch.tensor(table, dtype=torch.int32, device=device),
                      torch.tensor(lens, dtype=torch.int32, device=device),
                      torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device), max_q, block_size,
                      decode_splits(max(lens)) if max_q == 1 else 1, sliding_window or 0)


def decode_graphs(backend: AttentionBackend, model: torch.nn.Module, kv_cache: KVCache, model_cfg: ModelConfig,
                  sched_cfg: SchedulerConfig, max_model_len: int) -> Any:
    """The triton backend's CUDA graphs of decode steps (model/cuda_graphs.py), captured
    now, or None: another backend, the CPU (logged: the kernels are interpreted there),
    or --enforce-eager."""
    if backend is not AttentionBackend.TRITON:
        return None
    from hotprefix.model import triton_attention

    device = kv_cache.layers[0].k.device
    if device.type != "cuda":
        log.warning("--attention-backend triton on the CPU runs Triton's interpreter: correct, and very slow "
                    "(for tests)")
        return None
    if model_cfg.enforce_eager:
        log.info("--enforce-eager: decode steps run eagerly (no CUDA graphs)")
        return None
    from hotprefix.model.cuda_graphs import DecodeGraphs, default_sizes

    sizes = model_cfg.cuda_graph_sizes or default_sizes(sched_cfg.max_num_seqs)
    window = model.arch.sliding_window or 0
    return DecodeGraphs(model, kv_cache, sizes, blocks_for_tokens(max_model_len, kv_cache.block_size),
                        triton_attention.decode_splits(max_model_len), window, device)
