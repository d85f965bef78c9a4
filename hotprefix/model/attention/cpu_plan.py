"""The cpu backend's attention plans (csrc/attention.c's hp_plan), built once a step and
read by every layer.

Every query row of the step is in a task with the other query heads of its KV head and
the positions of its tile of 16 (prefill chunks), of its share of a short chunk (at most
SHORT_CHUNK queries: each KV head's rows in as many equal tasks as the plan has threads,
so that the threads finish together), or alone with them (decodes); each row sees
positions [lo, pos + 1) of its sequence (lo: 0, the window's start, or a cascade's
shared length). Decodes that share at least CASCADE_MIN_BLOCKS leading blocks form a
cascade: the shared prefix (rounded down to whole tiles) is attended once for all members
(a shared plan whose tasks save the rows' state), and each member's own plan continues
from that state over its own keys: the same arithmetic as attending its whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from hotprefix.model.attention.base import SeqSpan, StepBatch
from hotprefix.model.kernels.ops import ATT_FINAL, ATT_INIT, MAX_TASK_ROWS, TILE, AttPlan

CASCADE_MIN_BLOCKS = 2  # shared full blocks before a group of decodes attends to them once
SHARED_ROWS_PER_TASK = 12  # a cascade's query rows per task: the threads share a group's prefix
SHORT_CHUNK = 64  # a chunk of at most this many queries: its tasks split evenly, not by tile


@dataclass(frozen=True)
class Cascade:
    """Decoding sequences (indices into the step's seqs) whose first `shared` positions
    (a multiple of the tile) are the same blocks."""

    members: tuple[int, ...]
    shared: int


@dataclass(frozen=True)
class Shape:
    """The attention shape the plans are for, and the threads that run them (a short
    chunk's tasks: see the module's docstring)."""

    heads: int
    kv_heads: int
    window: int | None
    threads: int = 1


def slots_of(span: SeqSpan, block_size: int, start: int) -> np.ndarray:
    """Pool slots of positions [start, ctx_len) of a sequence, in position order."""
    p = np.arange(start, span.ctx_len)
    return np.asarray(span.block_ids, dtype=np.int64)[p // block_size] * block_size + p % block_size


def decode_slots(spans: list[SeqSpan], block_size: int, bases: list[int]) -> tuple[np.ndarray, list[int]]:
    """Pool slots of positions [bases[i], ctx_len) of each sequence, laid end to end, and
    where each sequence's slots start: slots_of for a whole step in a few array operations
    (every slot of the blocks covering those positions, then each sequence's run of them)."""
    bs = block_size
    firsts = [b // bs for b in bases]
    lasts = [(s.ctx_len + bs - 1) // bs for s in spans]
    table = np.fromiter(chain.from_iterable(s.block_ids[f:e] for s, f, e in zip(spans, firsts, lasts)), np.int64)
    every = (table[:, None] * bs + np.arange(bs)).reshape(-1)  # [blocks * bs]
    runs, starts, done, total = [], [], 0, 0
    for s, b, f, e in zip(spans, bases, firsts, lasts):
        runs.append(every[done + b - f * bs:done + s.ctx_len - f * bs])
        starts.append(total)
        done += (e - f) * bs
        total += s.ctx_len - b
    return (runs[0] if len(runs) == 1 else np.concatenate(runs)), starts


def cascades(batch: StepBatch, min_blocks: int = CASCADE_MIN_BLOCKS) -> list[Cascade]:
    """Groups of two or more decodes that share at least min_blocks leading blocks, all
    before each member's query (prefix caching makes those the same block ids)."""
    groups: dict[int, list[int]] = {}
    for i, span in enumerate(batch.seqs):
        if span.q_len == 1 and span.block_ids:
            groups.setdefault(span.block_ids[0], []).append(i)
    out = []
    for members in groups.values():
        spans = [batch.seqs[i] for i in members]
        limit = min(s.start_pos // batch.block_size for s in spans)
        n = 0
        if len(members) > 1 and limit > 0:  # the leading blocks all members hold
            differ = (np.array([s.block_ids[:limit] for s in spans]) != spans[0].block_ids[:limit]).any(0)
            n = int(np.argmax(differ)) if differ.any() else limit
        shared = n * batch.block_size // TILE * TILE
        if n >= min_blocks and shared > 0:
            out.append(Cascade(tuple(members), shared))
    return out


class _Builder:
    """Accumulates tasks, rows, key ranges and slots of one plan."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.tasks: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.lims: list[np.ndarray] = []
        self.slots: list[np.ndarray] = []
        self.n_rows = self.n_slots = 0

    def add_slots(self, slots: np.ndarray) -> int:
        self.slots.append(slots)
        self.n_slots += len(slots)
        return self.n_slots - len(slots)

    def add_sequence(self, span: SeqSpan, slots: np.ndarray, base: int, flags: int) -> None:
        """Every query row of `span` over positions [base, its own + 1) (within the window)."""
        h, kvh, g = self.shape.heads, self.shape.kv_heads, self.shape.heads // self.shape.kv_heads
        slot0 = self.add_slots(slots)
        pos = np.arange(span.start_pos, span.ctx_len)
        lo = np.full(span.q_len, base) if not self.shape.window else np.maximum(base, pos - self.shape.window + 1)
        rows = ((span.q_start + np.arange(span.q_len)) * h)[None, :, None] + \
            (np.arange(kvh)[:, None, None] * g + np.arange(g)[None, None, :])  # [KVH, q_len, G]
        self.rows.append(rows.reshape(-1))
        self.lims.append(np.broadcast_to(np.stack([lo, pos + 1], 1)[None, :, None, :],
                                          (kvh, span.q_len, g, 2)).reshape(-1, 2))
        most = max(1, MAX_TASK_ROWS // g)
        seg = _segments(pos, most) if span.q_len > SHORT_CHUNK else _shares(span.q_len, self.shape.threads, most)
        row0 = self.n_rows + np.arange(kvh)[:, None] * (span.q_len * g) + seg[None, :, 0] * g  # [KVH, S]
        n = np.broadcast_to((seg[:, 1] - seg[:, 0]) * g, row0.shape)
        head = np.broadcast_to(np.arange(kvh)[:, None], row0.shape)
        self.tasks.append(np.stack([row0, n, np.full_like(row0, slot0), np.full_like(row0, base), head,
                                    np.full_like(row0, flags)], -1).reshape(-1, 6))
        self.n_rows += kvh * span.q_len * g

    def add_decodes(self, spans: list[SeqSpan], block_size: int, bases: list[int], flags: list[int]) -> None:
        """Sequences of one query each over positions [bases[i], their own + 1) (within the
        window): what add_sequence adds for each, built for all at once."""
        h, kvh, g, w = self.shape.heads, self.shape.kv_heads, self.shape.heads // self.shape.kv_heads, self.shape.window
        slots, starts = decode_slots(spans, block_size, bases)
        slot0 = self.add_slots(slots)
        pos = [s.start_pos for s in spans]
        lims = np.array([(max(b, p - w + 1) if w else b, p + 1) for b, p in zip(bases, pos)], np.int64)  # [B, 2]
        qs = np.array([s.q_start * h for s in spans], np.int64)
        self.rows.append((qs[:, None] + np.arange(h)).reshape(-1))  # kv head j: its g query heads
        self.lims.append(np.repeat(lims, h, axis=0))
        # each sequence's task fields for KV head 0, plus each head's offsets: [B, KVH, 6]
        first = np.array([(self.n_rows + i * h, g, slot0 + st, b, 0, f)
                          for i, (st, b, f) in enumerate(zip(starts, bases, flags))], np.int64)
        self.tasks.append((first[:, None, :] + _head_offsets(kvh, g)).reshape(-1, 6))
        self.n_rows += len(spans) * h

    def add_shared(self, c: Cascade, batch: StepBatch) -> None:
        """A cascade's shared prefix, attended once for every member's query heads (state saved)."""
        h, kvh, g = self.shape.heads, self.shape.kv_heads, self.shape.heads // self.shape.kv_heads
        slot0 = self.add_slots(slots_of(batch.seqs[c.members[0]], batch.block_size, 0)[:c.shared])
        starts = np.array([batch.seqs[i].q_start for i in c.members])
        rows = (starts[None, :, None] * h + np.arange(kvh)[:, None, None] * g + np.arange(g)).reshape(kvh, -1)
        per_head = rows.shape[1]  # each KV head's rows, in tasks of up to SHARED_ROWS_PER_TASK
        r0 = np.arange(0, per_head, SHARED_ROWS_PER_TASK)
        first = self.n_rows + np.arange(kvh)[:, None] * per_head + r0[None, :]  # [KVH, tasks a head]
        head = np.broadcast_to(np.arange(kvh)[:, None], first.shape)
        n = np.broadcast_to(np.minimum(SHARED_ROWS_PER_TASK, per_head - r0), first.shape)
        zero = np.zeros_like(first)
        self.tasks.append(np.stack([first, n, zero + slot0, zero, head, zero], -1).reshape(-1, 6))
        self.rows.append(rows.reshape(-1))
        self.lims.append(np.tile([0, c.shared], (rows.size, 1)))
        self.n_rows += rows.size

    def plan(self) -> AttPlan:
        def cat(parts: list[np.ndarray], shape: tuple[int, ...]) -> torch.Tensor:
            if not parts:
                return torch.zeros(shape, dtype=torch.int64)
            if len(parts) == 1 and parts[0].flags.writeable:  # (a read-only broadcast view is copied)
                return torch.from_numpy(parts[0])
            return torch.from_numpy(np.concatenate(parts))
        return AttPlan(cat(self.tasks, (0, 6)), cat(self.rows, (0,)), cat(self.lims, (0, 2)), cat(self.slots, (0,)))


def _head_offsets(kvh: int, g: int) -> np.ndarray:
    """[KVH, 6]: what each KV head adds to a decode's task fields (its first row, its head)."""
    out = np.zeros((kvh, 6), np.int64)
    out[:, 0] = np.arange(kvh) * g
    out[:, 4] = np.arange(kvh)
    return out


def _segments(pos: np.ndarray, max_len: int) -> np.ndarray:
    """[S, 2]: ranges of query indices whose positions share a tile (at most max_len each)."""
    cuts = np.flatnonzero(np.diff(pos // TILE)) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(pos)]
    out = [(s, min(s + max_len, e)) for s0, e in zip(starts, ends) for s in range(s0, e, max_len)]
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _shares(n: int, parts: int, max_len: int) -> np.ndarray:
    """[S, 2]: queries 0..n-1 in `parts` ranges (fewer when n is smaller, more when a range
    would pass max_len) whose lengths differ by at most one."""
    s = min(n, max(parts, -(-n // max_len)))
    cuts = np.arange(s + 1) * n // s
    return np.stack([cuts[:-1], cuts[1:]], 1).astype(np.int64)


def window_start(span: SeqSpan, window: int | None) -> int:
    """The first position any query of `span` sees (0 without a window): its slots from
    there on are all a plan reads (a sliding-window group may have freed the blocks before)."""
    return max(0, span.start_pos - window + 1) if window else 0


def step_plans(batch: StepBatch, shape: Shape, with_cascades: bool) -> tuple[AttPlan, AttPlan | None, list[Cascade]]:
    """The step's own plan, its cascades' shared plan (None without cascades) and the
    cascades (none with a window: each row's keys start at its own place)."""
    groups = cascades(batch) if with_cascades and not shape.window else []
    base = {i: c.shared for c in groups for i in c.members}
    own = _Builder(shape)
    decodes = []
    for i, span in enumerate(batch.seqs):
        b = base.get(i, 0) or window_start(span, shape.window)
        flags = ATT_FINAL | (ATT_INIT if i in base else 0)
        if span.q_len == 1:
            decodes.append((span, b, flags))
        else:
            own.add_sequence(span, slots_of(span, batch.block_size, b), b, flags)
    if decodes:
        spans, bases, flags = zip(*decodes)
        own.add_decodes(list(spans), batch.block_size, list(bases), list(flags))
    if not groups:
        return own.plan(), None, []
    shared = _Builder(shape)
    for c in groups:
        shared.add_shared(c, batch)
    return own.plan(), shared.plan(), groups
