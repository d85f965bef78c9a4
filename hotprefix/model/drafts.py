"""Speculative decoding on the runner's side: a step's drafts verified (the scheduler's
side, the drafts themselves: core/speculation.py).

Each request with a draft samples its chunk's positions in order (Sampler.verify: each
exactly as decoding one token at a time would sample it) and keeps the draft while each
sample equals the draft's token. A request with an output constraint samples each
position under its grammar's mask there (model/structured.StepMasks: the masks of the
draft's positions, judged on a copy of its matcher walked through the draft), its draft
cut where the grammar stops judging it, and its matcher then takes the tokens kept and the
sampled one: the same tokens, under the same masks, as decoding one at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotprefix.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hotprefix.errors import PeerLostError
from hotprefix.model.sampler import Sampler, SampleRow
from hotprefix.model.structured import GrammarMatchers, StepMasks
from hotprefix.sampling_params import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drafting:
    """What verification uses of the runner: its sampler, its grammar matchers (None
    without structured outputs), the logits of rows of the step's hidden states
    ([n, V]), and the row that samples a request after a history (raises where it
    cannot be made)."""

    sampler: Sampler
    matchers: GrammarMatchers | None
    logits: Callable[[slice], torch.Tensor]
    row: Callable[[ScheduledRequest, list[int], torch.Tensor | None], SampleRow]


def verify_drafts(sched: SchedulerOutput, masks: StepMasks, out: ModelRunnerOutput, d: Drafting) -> None:
    """Each request of the step with a draft: the draft tokens it keeps go to
    out.accepted_token_ids, the last token to out.sampled_token_ids (their logprobs where
    asked for), and its matcher takes them. A request whose mask or sampling fails lands
    in out.failed; PeerLostError (another rank gone) is raised."""
    end = 0
    for r in sched.requests:
        end += len(r.token_ids)
        if not r.draft_token_ids:
            continue
        try:
            tokens, lps = _verify(r, end - len(r.token_ids), masks, d)
        except PeerLostError:
            raise
        except Exception as e:
            log.warning("request %s: sampling failed: %s", r.request_id, e)
            out.failed[r.request_id] = f"sampling failed: {e}"
            continue
        out.accepted_token_ids[r.request_id], out.sampled_token_ids[r.request_id] = tokens[:-1], tokens[-1]
        if r.sampling_params.logprobs is not None:
            out.accepted_logprobs[r.request_id], out.logprobs[r.request_id] = lps[:-1], lps[-1]


def _verify(r: ScheduledRequest, at: int, masks: StepMasks, d: Drafting
            ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One request's draft verified (its chunk's rows from `at` on: its last token, then
    the draft): the tokens it takes and their logprobs. Raises, saying why, where its
    mask or sampling fails."""
    if r.request_id in masks.failed:
        raise RuntimeError(masks.failed[r.request_id])
    draft, forbidden = r.draft_token_ids, masks.forbidden.get(r.request_id)
    draft = draft if forbidden is None else draft[:len(forbidden) - 1]
    rows = [d.row(r, r.output_token_ids + draft[:j], None if forbidden is None else forbidden[j])
            for j in range(len(draft) + 1)]
    tokens, lps = d.sampler.verify(d.logits(slice(at, at + len(draft) + 1)), rows, draft)
    if forbidden is not None and (why := d.matchers.consume(r.request_id, tokens)) is not None:
        raise RuntimeError(why)
    return tokens, lps
