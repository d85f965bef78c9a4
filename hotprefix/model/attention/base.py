"""What every attention backend shares: the step as the runner hands it over
(StepBatch), the protocol a backend implements, and the paths a step may take.

A step is T tokens from B sequences laid end to end. Sequence b owns queries
[q_start, q_start + q_len) of the flat batch; they sit at positions start_pos ..
start_pos + q_len - 1 of its context, whose KV lives in its blocks (block_ids) once
this step's keys and values are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hotprefix.model.kv_cache import LayerKV


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's share of a step."""

    q_start: int
    q_len: int
    start_pos: int
    block_ids: list[int]

    @property
    def ctx_len(self) -> int:
        """Its context after this step: every key a query of the last position sees."""
        return self.start_pos + self.q_len


@dataclass(frozen=True)
class StepBatch:
    """A step's tokens: ids, positions and KV slots [T] (int64, on the model's device),
    and each sequence's span. Built once by the runner, read by the backend's prepare
    and by the step strategies."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seqs: list[SeqSpan]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def decode_only(self) -> bool:
        """Every sequence runs one token."""
        return all(s.q_len == 1 for s in self.seqs)


@dataclass(frozen=True)
class AttentionPaths:
    """Which paths a forward pass may take (all by default; tests and benchmarks turn
    them off to compare the paths on one step). cascade: on the cpu backend, decodes
    sharing leading blocks attend to them once for the group; fused_decode: in int8 mode,
    a step of decodes only runs every layer in one C call (model/steps/fused_decode.py)."""

    cascade: bool = True
    fused_decode: bool = True


ALL_PATHS = AttentionPaths()


class AttentionBackend(Protocol):
    """How attention reads the paged KV pool. One is chosen when the runner is built
    (model/attention/__init__.create_backend); its layers call `attend`.

    prepare: the step's metadata (the backend's own type), built once and shared by
    every layer; it may keep state for the next step (forget_step_state drops it).
    attend: writes this step's keys and values (k, v [T, KVH, D]) into the layer's pool
    at meta's slots, then attends q [T, H, D] to each sequence's context; returns
    [T, H, D]. Raises RuntimeError when a kernel fails."""

    def prepare(self, batch: StepBatch, paths: AttentionPaths) -> Any: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: Any,
               scale: float) -> torch.Tensor: ...

    def forget_step_state(self) -> None: ...


@dataclass(frozen=True)
class BackendSpec:
    """What a backend is built from: the device, the compute dtype, the model's attention
    shape and each layer's sliding window (None: every earlier key; a query at p sees
    [p - window + 1, p]), and the pool's block size and storage dtype.

    A step's metadata holds what each window needs once (`windows`), and each layer
    attends with its own window's, found by its LayerKV's index (`window_of`)."""

    num_layers: int
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]
    block_size: int
    kv_dtype: torch.dtype

    def __post_init__(self) -> None:
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} windows for {self.num_layers} layers")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows, in layer order."""
        return tuple(dict.fromkeys(self.layer_windows))

    def window_of(self, kv: LayerKV) -> int | None:
        return self.layer_windows[kv.index]
