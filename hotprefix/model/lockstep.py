"""What rank 0 tells the other tensor-parallel ranks, so that every rank runs the same
collectives in the same order (model/parallel.Parallel.send / receive; docs/parallel.md).

Rank 0 alone schedules (the scheduler, the KV-cache manager, prefix caching, tiers) and
samples; each step it sends the step's plain-data SchedulerOutput (RunCopies when the
step copies blocks; RunStep: the forward pass, each rank over its heads of the same block
tables), then, for each set of rows whose logits it needs (sampling, drafts, prompt
logprobs), RunLogits: every rank computes its vocabulary part of those rows, gathered on
rank 0; RunPersist after a step whose blocks the disk tier writes. Stop ends a rank's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.core.outputs import SchedulerOutput
from hotprefix.model.attention import AttentionPaths


@dataclass(frozen=True)
class RunCopies:
    """The step's block copies (tier offloads, swaps, tier loads), each rank its part of a
    block; `staged`: the loaded host slots whose whole blocks rank 0 read from disk, whose
    heads it scatters first (kv_offload.HostArena.unstage)."""

    sched: SchedulerOutput
    staged: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RunPersist:
    """(pool block, hash) pairs the disk tier writes: every rank's heads gathered on rank 0."""

    blocks: list[tuple[int, bytes]]


@dataclass(frozen=True)
class RunStep:
    """The step's forward pass over `paths`."""

    sched: SchedulerOutput
    paths: AttentionPaths


@dataclass(frozen=True)
class RunLogits:
    """The logits of these rows of the last RunStep's hidden states [T, E]."""

    rows: slice | list[int]


@dataclass(frozen=True)
class Stop:
    """The engine is closing: leave the loop."""
