"""What every attention backend shares: the step as the runner hands it over
(StepBatch), the protocol a backend implements, and the paths a step may take.

A step is T tokens from B sequences laid end to end. Sequence b owns queries
[q_start, q_start + q_len) of the flat batch; they sit at positions start_pos ..
start_pos + q_len - 1 of its context, whose KV lives in its blocks (block_ids) once
this step's keys and values are written.

A grouped pool (core/kv_groups.py, sizing.KVGroupLayout) gives every KV-cache group its
own block table and slots: a sequence's `group_block_ids` and the batch's `group_slots`,
the full group's first (`block_ids`, `slot_mapping`); `StepBatch.for_group` is the step
as one group's layers see it. A window group's table holds the pool's null block id where
it released a block: no backend reads a key before the window of a sequence's first query.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hotprefix.model.kv_cache import LayerKV
from hotprefix.sizing import KVGroupLayout


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's share of a step."""

    q_start: int
    q_len: int
    start_pos: int
    block_ids: list[int]
    group_block_ids: tuple[list[int], ...] = ()  # a grouped pool's: every group's table

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
    group_slots: tuple[torch.Tensor, ...] = ()  # a grouped pool's: every group's slots [T]

    def for_group(self, group: int) -> StepBatch:
        """The step as the layers of KV-cache group `group` see it: that group's slots and tables."""
        return dataclasses.replace(self, slot_mapping=self.group_slots[group], group_slots=(),
                                   seqs=[dataclasses.replace(s, block_ids=s.group_block_ids[group], group_block_ids=())
                                         for s in self.seqs])

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
    a step of decodes (or of a few tokens) runs every layer in one C call (model/steps/fused_decode.py)."""

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
    [p - window + 1, p]), the pool's block size and storage dtype, and its KV-cache groups
    (None: one block table for every layer).

    A step's metadata holds what each plan key needs once (`plan_keys`: each window, or
    in a grouped pool each group, whose tables differ), and each layer attends with its
    own key's, found by its LayerKV's index (`key_of`); `views` gives each key's window
    and the step as its layers see it."""

    num_layers: int
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]
    block_size: int
    kv_dtype: torch.dtype
    kv_groups: KVGroupLayout | None = None

    def __post_init__(self) -> None:
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} windows for {self.num_layers} layers")
        group_of = {i: g for g, ls in enumerate(self.kv_groups.layers) for i in ls} if self.kv_groups else {}
        object.__setattr__(self, "_group_of", group_of)

    @property
    def plan_keys(self) -> tuple[int | None, ...]:
        """The keys of a step's plans: the windows, or a grouped pool's groups."""
        return tuple(range(len(self.kv_groups.windows))) if self.kv_groups else self.windows

    def key_of(self, kv: LayerKV) -> int | None:
        """The plan key of a layer (its group in a grouped pool, else its window)."""
        return self._group_of[kv.index] if self.kv_groups else self.window_of(kv)

    def key_window(self, key: int | None) -> int | None:
        """The window of the layers of plan key `key` (a group's, or the key itself)."""
        return self.kv_groups.windows[key] if self.kv_groups else key

    def views(self, batch: StepBatch) -> list[tuple[int | None, int | None, StepBatch]]:
        """(key, window, the step as that key's layers see it), for every plan key; the
        global plan first."""
        if self.kv_groups is None:
            return [(w, w, batch) for w in sorted(self.windows, key=lambda w: w is not None)]
        return [(g, self.key_window(g), batch.for_group(g)) for g in self.plan_keys]

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows, in layer order."""
        return tuple(dict.fromkeys(self.layer_windows))

    def window_of(self, kv: LayerKV) -> int | None:
        return self.layer_windows[kv.index]
