"""Token masks of structured outputs, on the engine thread: one llguidance matcher
per constrained sequence, advanced by every token it samples.

The masks are computed after the forward pass, before sampling. Computing them on a
helper thread during the forward pass gained nothing measurable on 2 cores (the
forward pass uses both; benchmarks/structured_overhead.py, docs/benchmarks.md), so
there is no such thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hotprefix.grammar import MASK_BUDGET_S
from hotprefix.sampling_params import StructuredOutput


@dataclass
class StepMasks:
    """What the grammars forbid this step: `forbidden[request_id]` is an [n, V] bool
    tensor (True = the grammar forbids that token), row j the mask at the request's j-th
    position sampled this step: one row without a draft; with a draft, one row per
    position the grammar can judge (the draft's longest prefix the grammar accepts, plus
    one: n - 1 draft tokens can be verified); `failed[request_id]` says why a request's
    matcher could not give the first mask (it then fails alone)."""

    forbidden: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def first(self, request_id: str) -> torch.Tensor | None:
        """The [V] mask of the request's first sampled position (None: unconstrained)."""
        rows = self.forbidden.get(request_id)
        return rows[0] if rows is not None else None


def _unusable(matcher, took: float, row: torch.Tensor) -> str | None:
    """Why a mask just filled ([V/32] int32, 1 = allowed) is not the grammar's to sample
    from, or None: a limit hit while filling (often "end only"), more than MASK_BUDGET_S
    of CPU time (one more such step would stall the whole batch again), or nothing allowed
    (sampling from nothing would pick an arbitrary token)."""
    if matcher.is_error():
        return f"the grammar matcher failed: {matcher.get_error()}"
    if took > MASK_BUDGET_S:
        return (f"the grammar is too complex to enforce: one token mask took {took * 1e3:.0f} ms "
                f"(the limit is {MASK_BUDGET_S * 1e3:.0f} ms)")
    return None if row.any() else "the grammar allows no next token"


class GrammarMatchers:
    """The matchers of the running constrained sequences (by request id), for
    `vocab_size` logits. `source` is the GrammarCompiler that compiled their specs and
    copies its matchers for them. Engine thread only."""

    def __init__(self, source, vocab_size: int) -> None:
        self._source = source
        self.vocab_size = vocab_size
        self._matchers: dict[str, object] = {}

    def compute(self, requests: list[tuple[str, StructuredOutput, list[int]]]) -> StepMasks:
        """The masks of `requests` (request id, its constraint, its draft: [] for none);
        creates the matchers of new requests. A draft's positions are judged on a copy of
        the matcher walked through the draft's tokens (the matcher itself does not move;
        `consume` moves it by the tokens kept). Never raises: a matcher that cannot be
        made or is in an error state, or whose first mask takes more than MASK_BUDGET_S of
        CPU time or allows nothing, lands in the result's `failed`; such a mask at a
        draft's later position cuts the draft there instead (decoding fails, or not, when
        it gets there), as does a draft token the grammar rejects (the scheduler's drafts
        are already cut to what the grammar takes: core/speculation.py owns that check)."""
        import llguidance.torch as lt

        masks, live = StepMasks(), []
        for rid, so, draft in requests:
            try:
                m = self._matcher(rid, so)
            except Exception as e:  # noqa: BLE001 - a grammar the matcher refuses fails its request alone
                masks.failed[rid] = f"the grammar matcher could not start: {e}"
                continue
            if m.is_error():
                masks.failed[rid] = f"the grammar matcher failed: {m.get_error()}"
            else:
                live.append((rid, m, draft))
        if not live:
            return masks
        bitmask = torch.empty(sum(len(d) + 1 for _, _, d in live), -(-self.vocab_size // 32),
                              dtype=torch.int32)  # [rows, V/32] 1 = allowed
        judged = self._fill(lt, live, bitmask, masks.failed)
        forbidden = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [rows, 32W]
        rows = torch.from_numpy(forbidden[:, :self.vocab_size]).view(torch.bool)  # [rows, V]
        at = 0
        for rid, _, draft in live:
            if rid not in masks.failed:
                masks.forbidden[rid] = rows[at:at + judged[rid]]
            at += len(draft) + 1
        return masks

    @staticmethod
    def _fill(lt, live: list, bitmask: torch.Tensor, failed: dict[str, str]) -> dict[str, int]:
        """Fill each live request's rows of `bitmask` (its position's, then its draft's);
        returns how many of each request's rows are its grammar's masks, and puts in
        `failed` why a request's first is not."""
        judged, at = {}, 0
        for rid, m, draft in live:
            walker = m.deep_copy() if draft else m
            for j in range(len(draft) + 1):
                if j and not walker.consume_token(draft[j - 1]):
                    break  # a token the grammar rejects ends the draft (the scheduler's drafts come cut already)
                t = time.thread_time()  # CPU time: waiting for the GIL or a core is not the grammar's cost
                lt.fill_next_token_bitmask(walker, bitmask, at + j)
                if (why := _unusable(walker, time.thread_time() - t, bitmask[at + j])) is not None:
                    if j == 0:
                        failed[rid] = why
                    break
                judged[rid] = j + 1
            at += len(draft) + 1
        return judged

    def _matcher(self, request_id: str, so: StructuredOutput):
        m = self._matchers.get(request_id)
        if m is None:
            m = self._matchers[request_id] = self._source.new_matcher(so)
        return m

    def consume(self, request_id: str, tokens: list[int]) -> str | None:
        """Advance a sequence's matcher by the tokens it takes this step (a draft's kept
        ones, then the sampled one); returns why it failed, or None."""
        m = self._matchers.get(request_id)
        if m is None:
            return None
        for token in tokens:  # (one at a time: consume_tokens refuses a stopped parser's EOS, consume_token takes it)
            if not m.consume_token(token):
                return f"the grammar rejected token {token}: {m.get_error()}"
        return None

    def forced_tokens(self, request_id: str) -> list[int]:
        """The tokens the sequence's grammar forces next, the matcher unmoved ([] without a
        matcher, or one in an error state): llguidance's fast-forward tokens, the bytes the
        grammar forces (a schema's keys and punctuation) in the tokenizer's canonical
        tokenization, so a draft (the model may say the same bytes in other tokens) that the
        scheduler proposes before the n-gram's."""
        m = self._matchers.get(request_id)
        return [] if m is None or m.is_error() else m.compute_ff_tokens()

    def accepted_prefix(self, request_id: str, tokens: list[int]) -> int:
        """How many of `tokens`' first tokens the sequence's grammar accepts next, the
        matcher unmoved (0 without a matcher, or one in an error state): where the
        scheduler cuts a constrained request's draft."""
        m = self._matchers.get(request_id)
        return 0 if m is None or m.is_error() else m.validate_tokens(tokens)

    def drop(self, request_id: str) -> None:
        """Forget a finished sequence's matcher."""
        self._matchers.pop(request_id, None)
