"""The scoring kernels' wrappers (csrc/score.c): per row, a target token's logprob over the
full vocabulary's log-sum-exp, its rank and the k most likely tokens, from logits
(score_rows) or from hidden states on an int8 head without making the logits (score_head).
Each checks what the C side assumes, as ops.py's wrappers do."""

from __future__ import annotations

import torch

from hotprefix.model.kernels.build import need
from hotprefix.model.kernels.ops import Lib, _f32_cpu
from hotprefix.model.kernels.weights import Blocks, PackedWeight


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int, lib: Lib = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [R, V] float32 (CPU): the target's (targets [R] int64) logprob
    over the row's log-sum-exp and its rank (1 + the logits above it), and the k largest
    logits' token ids and logprobs, largest first -> (lp [R], rank [R], top_ids [R, k],
    top_lp [R, k]). Each row's result is the same bits however many rows come with it."""
    lib = need(lib)
    _f32_cpu("score_rows", logits)
    logits, targets = logits.contiguous(), targets.to(torch.int64).contiguous()
    r, v = logits.shape
    if targets.shape != (r,) or not 0 <= k <= v or (r and not 0 <= int(targets.min()) <= int(targets.max()) < v):
        raise ValueError(f"score_rows: {r} rows of {v} logits, targets {tuple(targets.shape)}, k={k}")
    lp, rank = torch.empty(r, dtype=torch.float32), torch.empty(r, dtype=torch.int64)
    top_ids, top_lp = torch.empty(r, k, dtype=torch.int64), torch.empty(r, k, dtype=torch.float32)
    lib.hp_score_rows(logits.data_ptr(), r, v, targets.data_ptr(), k, lp.data_ptr(), rank.data_ptr(),
                      top_ids.data_ptr(), top_lp.data_ptr(), torch.get_num_threads())
    return lp, rank, top_ids, top_lp


def scores_on_head(w: Blocks) -> bool:
    """Whether score_head reads this head: one part of the int8 (regrouped) layout."""
    return isinstance(w, PackedWeight) and w.int8


def score_head(x: torch.Tensor, w: Blocks, targets: torch.Tensor, k: int, lib: Lib = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """score_rows of the logits x [M, K] float32 (CPU) @ W^T (W [V, K], one int8 part:
    scores_on_head) without making them: segments of them are made by the head's own
    kernels and scored while in cache -> (lp [M], rank [M], top_ids [M, k], top_lp [M, k]).
    Each row's result is the same bits however many rows come with it. Raises ValueError
    for a head it does not read or targets / k out of range; RuntimeError without the
    library or out of memory."""
    lib = need(lib)
    _f32_cpu("score_head", x)
    x, targets = x.contiguous(), targets.to(torch.int64).contiguous()
    m, v = x.shape[0], w.n
    if (not scores_on_head(w) or x.shape != (m, w.k) or targets.shape != (m,) or not 0 <= k <= v
            or (m and not 0 <= int(targets.min()) <= int(targets.max()) < v)):
        raise ValueError(f"score_head: {tuple(x.shape)} rows on a [{v}, {w.k}] head, targets "
                         f"{tuple(targets.shape)}, k={k}")
    lp, rank = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.int64)
    top_ids, top_lp = torch.empty(m, k, dtype=torch.int64), torch.empty(m, k, dtype=torch.float32)
    rc = lib.hp_score_head(w.part_table, x.data_ptr(), m, w.k, targets.data_ptr(), k, lp.data_ptr(),
                           rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"score_head failed ({rc})")
    return lp, rank, top_ids, top_lp
