"""The weights a model is built from, taken by name by the modules that use them, so
that every module is constructed complete (its tensors, its blocks) and a weight nobody
takes is an error, not a silent leftover.

Float weights come as the loader gives them (float32 or the checkpoint's dtype) and are
moved to the device in the compute dtype as they are taken; a weight the loader holds
only as GGUF blocks is a meta tensor there, and is never materialized: the module reads
its blocks (int8 mode) or the loader has already widened it (float32 mode).
"""

from __future__ import annotations

import torch

from hotprefix.model.arch import ModelLoadError
from hotprefix.model.kernels.weights import Blocks, ExpertBlocks, PackedWeight, float_blocks
from hotprefix.model.parallel import SINGLE, Parallel, ShardKind, ShardPlan, vocab_rows


class WeightSet:
    """HF name -> weight for building one model.

    tensors: float weights by HF name (meta for those held only as blocks); blocks: GGUF
    blocks in the mode's form (int8 mode: regrouped) by HF name; rows: GGUF rows as stored
    (embedding lookups); f32: products of float weights read them as F32 blocks (the C
    kernels on the CPU: one arithmetic for every batch). With `record`, nothing is loaded:
    every weight asked for is a meta tensor of its shape and is listed in `shapes` (dummy
    weights are made from it). parallel: the rank the model is built for, whose part of
    each weight `tensors` holds already (the loader's ShardPlan `plan`): shapes asked for
    are the rank's (shard_arch's, vocab_rows').
    Mutates itself: each weight is taken once."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 blocks: dict[str, PackedWeight | ExpertBlocks] | None = None,
                 rows: dict[str, PackedWeight] | None = None,
                 family: str = "", record: bool = False, f32: bool = False,
                 parallel: Parallel = SINGLE, plan: ShardPlan | None = None) -> None:
        self._tensors = dict(tensors)
        self.parallel, self.plan = parallel, plan
        self.dtype, self.device = dtype, device
        self.blocks = dict(blocks or {})
        self.rows = dict(rows or {})
        self.family = family
        self.record = record
        self.f32 = f32 and not record
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.served_bytes = 0  # float32 bytes of weights read as blocks alone, never held

    def vocab_rows(self, vocab: int) -> int:
        """The vocabulary rows of the embedding and the head this rank holds."""
        return vocab_rows(vocab, self.parallel.size)

    def reduces(self, prefix: str) -> bool:
        """Whether module `prefix`'s outputs are partial sums, to be summed over the ranks."""
        return self.plan is not None and self.plan.kind(f"{prefix}.weight") is ShardKind.ROW

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The float weight `name` of `shape` on the device in the compute dtype, or None
        for one held only as blocks (meta). Raises ModelLoadError when it is missing or of
        another shape."""
        if self.record:
            self.shapes[name] = shape
            return torch.empty(shape, device="meta")
        w = self._tensors.pop(name, None)
        if w is None:
            raise ModelLoadError(f"weights do not match the {self.family} architecture: missing [{name!r}]")
        if tuple(w.shape) != tuple(shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(w.shape)}, the config implies {tuple(shape)}")
        if w.is_meta:
            return None
        return w.to(device=self.device, dtype=self.dtype)

    def blocks_for(self, name: str, w: torch.Tensor | None) -> Blocks | ExpertBlocks | None:
        """What products of weight `name` read on the kernels: its GGUF blocks, else (f32)
        its float rows as F32 blocks (None where K is not a multiple of 32)."""
        b = self.blocks.get(name)
        if b is None and self.f32 and w is not None:
            b = float_blocks(w)
        return b

    def take_stacked(self, name: str, parts: list[str], shape: tuple[int, ...]) -> torch.Tensor | None:
        """The weight `name` of [len(parts), *shape]: as loaded under that name (a GGUF
        file's 3-D experts), else stacked from one weight per part (a HF checkpoint's
        per-expert weights, each taken). Raises ModelLoadError as take."""
        if self.record or name in self._tensors:
            return self.take(name, (len(parts), *shape))
        return torch.stack([self.take(p, shape) for p in parts])

    def optional(self, name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        """take(name) when the checkpoint has it (recording: when `present`), else None."""
        if self.record:
            return self.take(name, shape) if present else None
        return self.take(name, shape) if name in self._tensors else None

    def drop(self, name: str) -> None:
        """A weight the model does not use (a tied head's copy)."""
        self._tensors.pop(name, None)

    def add_to(self, suffix: str, value: float) -> None:
        """Add `value` (in float32) to every float weight whose name ends so: HF's Gemma stores
        RMSNorm weights as w for (1 + w). Blocks and meta weights are left alone."""
        for name, w in self._tensors.items():
            if name.endswith(suffix) and not w.is_meta:
                self._tensors[name] = w.float() + value

    def drop_suffix(self, suffix: str) -> None:
        """Every weight whose name ends so (old checkpoints' rotary tables)."""
        for name in [n for n in self._tensors if n.endswith(suffix)]:
            del self._tensors[name]

    def pop_raw(self, name: str) -> torch.Tensor | None:
        """A tensor as loaded (no device or dtype change), or None (GGUF's rope_freqs)."""
        return None if self.record else self._tensors.pop(name, None)

    def count_served(self, shape: tuple[int, ...]) -> None:
        """A float32 weight of `shape` that blocks serve alone (never held)."""
        self.served_bytes += 4 * int(torch.Size(shape).numel())

    def finish(self) -> None:
        """Raises ModelLoadError for weights no module took."""
        extra = sorted(self._tensors)
        if extra and not self.record:
            raise ModelLoadError(f"weights do not match the {self.family} architecture: unexpected {extra[:3]}")
