"""Prompt logprobs (`prompt_logprobs`, `echo` with `logprobs`): position p's logits score
prompt token p + 1 (raw logprobs, as vLLM reports them): the target's logprob and rank over
the full vocabulary's log-sum-exp, and the top k where k > 0. On an int8 head on the CPU
(one rank) they are scored on the head's blocks without making the logits
(layers.block_scores); elsewhere from logits made a slice at a time (sampler.score_rows)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.model.layers import block_scores, blocks_score
from hotprefix.model.parallel import Parallel
from hotprefix.model.sampler import logprob_entries, score_rows
from hotprefix.sampling_params import TokenLogprobs

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are made at once ([256, V] float32: 50 MB at 49k),
# into one buffer kept for the runner's life: a fresh tensor that size is mapped anew and faulted in
# page by page each time (as much kernel time as the head's product on the default model)
SCORE_HEAD_ROWS = 1024  # prompt positions scored at once on an int8 head (no logits made: its per-segment
# statistics, ~12 bytes a position, 1,024-token segment and top-k entry, are what it holds)

Logits = Callable[[torch.Tensor, slice, "torch.Tensor | None"], torch.Tensor]


class PromptScorer:
    """The prompt logprobs of a step's requests, for the runner. `logits(hidden, rows, out)`:
    the runner's logits of hidden's rows (over several ranks, gathered on rank 0), into `out`
    where the head can write there. `buffer` (made when first needed) and `rows_total` are
    its only state."""

    def __init__(self, model: torch.nn.Module, parallel: Parallel, logits: Logits) -> None:
        self.model = model
        self.parallel = parallel
        self.logits = logits
        self.buffer: torch.Tensor | None = None  # [PROMPT_LOGPROB_ROWS, V] logits, where the head is C blocks
        self.rows_total = 0  # prompt positions scored, for tests and stats

    def score(self, sched: SchedulerOutput, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Writes out.prompt_logprobs[request id] = (first position, entries) for every request
        of the step that asks for them, in slices of its rows. hidden: [T, E]."""
        end = 0
        on_head = self.on_head(hidden)
        step = SCORE_HEAD_ROWS if on_head else PROMPT_LOGPROB_ROWS
        for r in sched.requests:
            start, end = end, end + len(r.token_ids)
            k = r.sampling_params.prompt_logprobs
            rows = min(len(r.token_ids), len(r.prompt_token_ids) - 1 - r.start_pos)  # rows with a prompt target
            if k is None or rows <= 0:
                continue
            entries = []
            for a in range(0, rows, step):
                b = min(rows, a + step)
                targets = r.prompt_token_ids[r.start_pos + 1 + a:r.start_pos + 1 + b]
                entries += self._entries(hidden, slice(start + a, start + b), targets, k, on_head)
            self.rows_total += rows
            out.prompt_logprobs[r.request_id] = (r.start_pos + 1, entries)

    def on_head(self, hidden: torch.Tensor) -> bool:
        """Whether hidden's rows are scored on the head's blocks without making their logits
        (an int8 head on the CPU, one rank) rather than from logits."""
        return self.parallel.size == 1 and blocks_score(hidden, self.model.logits_blocks)

    def _entries(self, hidden: torch.Tensor, rows: slice, targets: list[int], k: int, on_head: bool
                 ) -> list[TokenLogprobs]:
        """The entries of hidden [T, E]'s `rows` scoring `targets`: on the head's blocks
        (on_head) or from their logits."""
        if on_head:
            t = torch.tensor(targets, dtype=torch.long)
            return logprob_entries(targets, *block_scores(hidden[rows], self.model.logits_blocks, t, k))
        return score_rows(self.logits(hidden, rows, self._buffer(rows.stop - rows.start)).float(), targets, k)

    def _buffer(self, rows: int) -> torch.Tensor | None:
        """The first `rows` rows of the logits buffer where the head is C blocks (its width:
        this rank's vocabulary rows); None elsewhere."""
        blocks = self.model.logits_blocks
        if blocks is None:
            return None
        if self.buffer is None:
            self.buffer = torch.empty(PROMPT_LOGPROB_ROWS, blocks.n, dtype=torch.float32)
        return self.buffer[:rows]
