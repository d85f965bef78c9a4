"""Decode steps replayed from CUDA graphs (the triton backend on CUDA; --enforce-eager: off).

A decode-only step (one token per sequence) of B sequences runs the graph captured at
the smallest size >= B, as vLLM does: the graph's inputs are static buffers, the step's
rows are copied into their leading B rows and the rest is padding that writes no KV
(slot -1) and reads none (length 0, output 0). Prefill and mixed steps, and decode steps
past the largest size or a longer block table than captured, run eagerly.

All graphs share the buffers of the largest size and one memory pool (captured largest
first). A grouped pool's step (sizing.KVGroupLayout) has a block table and slots per
KV-cache group: the buffers hold one of each per group, each group's TritonMeta its
window. With capture=False (no CUDA) forward runs the same padded batch eagerly, which is
how the padding is proven on the CPU (Triton's interpreter).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from hotprefix.config import AttentionBackend as AttentionBackendKind
from hotprefix.config import ModelConfig, SchedulerConfig
from hotprefix.model.attention.base import AttentionPaths, StepBatch
from hotprefix.model.kv_cache import KVCache
from hotprefix.sizing import KVGroupLayout, blocks_for_tokens

if TYPE_CHECKING:  # importing them imports triton
    from hotprefix.model.attention.triton import TritonStep

log = logging.getLogger(__name__)


def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default capture sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs
    (which is captured too)."""
    sizes = {n for n in (1, 2, 4) if n <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


class DecodeGraphs:
    """StepRunner (see steps/__init__.py): forward(batch, meta) -> hidden [B, E] for a
    decode step it serves. Mutates the KV pool exactly as the eager step would."""

    name = "CUDA graph"

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, sizes: tuple[int, ...], max_blocks: int,
                 num_splits: int, windows: tuple[int | None, ...], device: torch.device, capture: bool = True,
                 groups: KVGroupLayout | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = tuple(sorted(set(sizes)))
        self.max_blocks = max_blocks
        self.num_splits = num_splits
        self.windows = windows  # the backend's (BackendSpec.windows): one TritonMeta each, sharing the buffers
        self.groups = groups.windows if groups is not None else None  # a grouped pool's: each group's window
        self.keys = tuple(range(len(self.groups))) if self.groups else windows  # a step's TritonStep.windows
        n, tables = self.sizes[-1], len(self.groups) if self.groups else 1
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tables, n), -1, dtype=torch.long, device=device)  # per table
        self.block_tables = torch.zeros(tables, n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _meta(self, size: int) -> TritonStep:
        from hotprefix.model.attention.triton import TritonStep
        from hotprefix.model.kernels.triton_attention import TritonMeta

        metas = [TritonMeta(table[:size], self.seq_lens[:size], self.query_start_loc[:size + 1], 1,
                            self.kv_cache.block_size, self.num_splits) for table in self.block_tables]
        if self.groups is not None:
            return TritonStep.of_groups([s[:size] for s in self.slot_mapping], metas, self.groups)
        return TritonStep.of(self.slot_mapping[0, :size], metas[0], self.windows)

    def _run(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._meta(size))

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every size, largest first, into one memory pool. The buffers hold
        padding only (slot -1, length 0): capturing writes and reads no KV."""
        t0 = time.monotonic()
        pool = None
        for size in reversed(self.sizes):
            self._run(size)  # compiles the kernels for this shape and settles the allocator
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self._run(size)
            pool = g.pool()
            self.graphs[size] = g
        torch.cuda.synchronize()
        log.info("captured CUDA graphs of decode steps at %d batch sizes (1..%d) in %.1fs", len(self.sizes),
                 self.sizes[-1], time.monotonic() - t0)

    def refusal(self, batch: StepBatch, meta: TritonStep, paths: AttentionPaths) -> str | None:
        """Serves a decode-only triton step that fits a captured size and the block table's width."""
        t = meta.triton
        if t.max_query_len != 1:
            return "not a decode-only step"
        width = max(m.block_tables.shape[1] for _, m in meta.tables())
        if batch.num_tokens > self.sizes[-1] or width > self.max_blocks:
            return "larger than the largest graph captured"
        return None if tuple(meta.windows) == self.keys else "other sliding windows"

    def forward(self, batch: StepBatch, meta: TritonStep) -> torch.Tensor:
        b = batch.num_tokens
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        for slots, table, (s, t) in zip(self.slot_mapping, self.block_tables, meta.tables()):
            slots[:b].copy_(s)
            table[:b, :t.block_tables.shape[1]].copy_(t.block_tables)  # (columns past a row's length: never read)
        self.slot_mapping[:, b:size].fill_(-1)
        self.seq_lens[:b].copy_(meta.triton.seq_lens)
        self.seq_lens[b:size].zero_()
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:b]
        return self._run(size)[:b]


def decode_graphs(backend: AttentionBackendKind, model: torch.nn.Module, kv_cache: KVCache, model_cfg: ModelConfig,
                  sched_cfg: SchedulerConfig, max_model_len: int, groups: KVGroupLayout | None = None
                  ) -> DecodeGraphs | None:
    """The triton backend's CUDA graphs of decode steps (over `groups`, a grouped pool's
    layout, where there is one), captured now, or None: another backend, the CPU (logged:
    the kernels are interpreted there), or --enforce-eager."""
    if backend is not AttentionBackendKind.TRITON:
        return None
    from hotprefix.model.kernels import triton_attention

    device = kv_cache.layers[0].k.device
    if device.type != "cuda":
        log.warning("--attention-backend triton on the CPU runs Triton's interpreter: correct, and very slow "
                    "(for tests)")
        return None
    if model_cfg.enforce_eager:
        log.info("--enforce-eager: decode steps run eagerly (no CUDA graphs)")
        return None
    sizes = model_cfg.cuda_graph_sizes or default_sizes(sched_cfg.max_num_seqs)
    windows = tuple(dict.fromkeys(model.arch.layer_windows))  # as BackendSpec.windows
    return DecodeGraphs(model, kv_cache, sizes, blocks_for_tokens(max_model_len, kv_cache.block_size),
                        triton_attention.decode_splits(max_model_len), windows, device, groups=groups)
