"""Turn each row of logits into one token according to its SamplingParams.

Order of operations (vLLM's): raw logprobs are taken first; then the structured
output's mask, min_tokens suppression (of the stop ids, unless they are all the grammar
allows: the grammar wins), logit bias, penalties, temperature, top-k, top-p,
min-p; greedy rows take the argmax of the penalised logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotprefix.model.kernels import scores
from hotprefix.model.kernels.build import library
from hotprefix.sampling_params import Logprob, SamplingParams, TokenLogprobs


@dataclass
class SampleRow:
    """One row to sample: its params, its token history, and its generator (None: the shared one)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids_for_min_tokens: tuple[int, ...]
    generator: torch.Generator | None
    forbidden: torch.Tensor | None = None  # [V] bool: what a structured output forbids next


def min_tokens_suppressed(r: SampleRow) -> list[int]:
    """The stop ids min_tokens takes out of r's row: none once r has min_tokens output
    tokens, and none where they are all that its grammar allows (the grammar wins: its output
    ends there, shorter than min_tokens, and Request.check_token_stop stops it; masking them
    too would leave no token to sample, and argmax would pick token 0)."""
    if len(r.output_token_ids) >= r.params.min_tokens or not r.stop_ids_for_min_tokens:
        return []
    ids = list(r.stop_ids_for_min_tokens)
    if r.forbidden is not None:
        others = ~r.forbidden  # (a copy: the step's mask is not changed)
        others[ids] = False
        if not bool(others.any()):
            return []
    return ids


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """In place: repetition penalty over prompt+output tokens, presence and
    frequency penalties over output tokens. logits: [B, V] float32."""
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


NUCLEUS_TRIES = (256, 4096)  # the most likely tokens looked at before sorting the whole row


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p's tokens: the smallest run of the most likely tokens whose mass reaches top_p
    (the first always), as ids. probs: [V]. The run ends at the first token whose mass
    before it, summed in order, is >= top_p; it is looked for among the 256 most likely
    tokens, then 4,096, then the whole row sorted (a row's sort of 49,152 values: 2.6 ms on
    the CPU, its top 256: 0.15 ms). On the CPU the sums of a prefix are the same however
    long the run (torch's cumsum adds in order), so the answer is the whole sort's; a GPU's
    scan may round a prefix's sums differently by its length (a token at the boundary)."""
    n = probs.shape[0]
    for k in (*(t for t in NUCLEUS_TRIES if t < n), n):
        vals, ids = torch.topk(probs, k) if k < n else torch.sort(probs, descending=True)
        over = (torch.cumsum(vals, 0) - vals) >= top_p  # mass strictly before each token
        over[0] = False
        if bool(over.any()):
            return ids[:int(torch.argmax(over.to(torch.int8)))]
    return ids  # the whole row's mass is short of top_p: every token


def candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The temperature-scaled logits of the tokens top-k leaves (those >= the k-th largest:
    ties with it stay; tokens masked to -inf go) and their ids in ascending order, or the
    whole row and None where top-k is off. logits: [V] float32."""
    k, n = p.effective_top_k, logits.shape[0]
    if 0 < k < n:
        top = torch.topk(logits, k + 1).indices  # (dividing by the temperature keeps the order)
        xs = logits[top] / p.temperature
        if xs[k] < xs[k - 1] and xs[k - 1] != float("-inf"):  # no tie with the k-th, nothing masked
            ids = top[:k].sort().values
            return logits[ids] / p.temperature, ids
        x = logits / p.temperature
        ids = torch.nonzero((x >= xs[k - 1]) & (x != float("-inf"))).flatten()
        if ids.numel():
            return x[ids], ids
    return logits / p.temperature, None


def filtered(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Weights (float64) of `candidates`' logits x [C] after top-p and min-p: exp(x - max),
    normalised to sum to about 1 only with top-p (which needs it; min-p and the draw do not);
    excluded tokens get exactly 0; where some logits are +inf, those share the mass equally.
    The normalising sum is taken in id order, one term after another (torch's cumsum), so it
    is the same over the candidates as over the whole row (whose other terms are zeros):
    top-k restricting the work to its k tokens changes no weight."""
    top = x.max()
    # +inf logits (a repetition penalty near 0 divides a seen token's logit to inf): the limit,
    # their mass shared equally, not inf - inf's NaNs
    e = torch.exp(x - top) if top != float("inf") else (x == top).to(x.dtype)
    probs = e.double()  # min-p and the draw need no normalising (draw scales its uniform by the total)
    if p.top_p < 1.0:
        probs = probs / torch.cumsum(e, 0, dtype=torch.float64)[-1]
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[nucleus(probs, p.top_p)] = True
        probs = probs.masked_fill(~keep, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token of a sampled row: `draw` over the candidates' filtered probabilities
    (the same cumulative sums, so the same token, as over the whole row: its other terms
    are zeros). logits: [V] float32."""
    x, ids = candidates(logits, p)
    j = draw(filtered(x, p), generator)
    return j if ids is None else int(ids[j])


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [V] (non-negative, summing to about 1) by inverting its
    cumulative sum with one uniform draw. Exact for the distribution (sums in float64),
    and about 20x faster on the CPU than torch.multinomial, which draws V exponentials
    (1.5 ms for a 49k vocabulary). A token of probability 0 is never drawn."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # first token whose cdf exceeds u: p > 0
    if i >= probs.shape[0]:  # u rounded up to the total: the last token with p > 0
        i = int(torch.nonzero(probs).max())
    return i


def top_logprobs(raw_logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The sampled token's logprob and rank, and the k most likely tokens. raw_logprobs: [V]."""
    lp = float(raw_logprobs[token])
    rank = int((raw_logprobs > raw_logprobs[token]).sum()) + 1
    top: list[Logprob] = []
    if k > 0:
        vals, ids = torch.topk(raw_logprobs, k)
        top = [Logprob(int(t), float(v), j + 1) for j, (v, t) in enumerate(zip(vals, ids))]
    return TokenLogprobs(Logprob(token, lp, rank), top)


def score_rows(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's target token: its logprob (its logit less the row's log-sum-exp over the
    whole vocabulary), its rank, and the row's k most likely tokens (none for k=0), all
    rows at once. Each value depends on its own row only: on the CPU with the C library
    (kernels/scores.score_rows, one pass per row) the same bits whatever the number of rows.
    logits: [R, V] float32, one row per target."""
    t = torch.tensor(targets, dtype=torch.long, device=logits.device)
    if logits.device.type == "cpu" and library() is not None:
        return logprob_entries(targets, *scores.score_rows(logits, t, k))
    lse = torch.logsumexp(logits, -1, keepdim=True)  # [R, 1]
    chosen = logits.gather(1, t[:, None])  # [R, 1]
    top, top_ids = torch.topk(logits, k, -1)  # [R, k]
    return logprob_entries(targets, (chosen - lse)[:, 0], (logits > chosen).sum(-1) + 1, top_ids, top - lse)


def logprob_entries(targets: list[int], lp: torch.Tensor, rank: torch.Tensor, top_ids: torch.Tensor,
                    top_lp: torch.Tensor) -> list[TokenLogprobs]:
    """One TokenLogprobs per target from its scores: lp [R], rank [R], top_ids and top_lp [R, k]."""
    tops = [[Logprob(a, b, j + 1) for j, (a, b) in enumerate(zip(ids, vals))]
            for ids, vals in zip(top_ids.tolist(), top_lp.tolist())]
    return [TokenLogprobs(Logprob(tok, lp_, r), top) for tok, lp_, r, top in zip(targets, lp.tolist(), rank.tolist(),
                                                                                  tops)]


def greedy_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> list[int | None]:
    """Each greedy row's token (its first largest logit: argmax's rule, the same row by row
    or all at once), None for the rows that sample. logits: [B, V]."""
    out: list[int | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == len(rows):
        picked = torch.argmax(logits, dim=-1).tolist()
    elif greedy:
        picked = torch.argmax(logits[torch.tensor(greedy, device=logits.device)], dim=-1).tolist()
    else:
        return out
    for i, t in zip(greedy, picked):
        out[i] = t
    return out


class Sampler:
    """Stateless apart from the shared generator used by unseeded rows."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [B, V] float32 (modified in place). Returns a token and
        optional logprobs per row."""
        raw = None
        if any(r.params.logprobs is not None for r in rows):
            raw = torch.log_softmax(logits, dim=-1)
        for i, r in enumerate(rows):
            if r.forbidden is not None:  # first: nothing below may bring back a token the grammar forbids
                logits[i].masked_fill_(r.forbidden, float("-inf"))
        for i, r in enumerate(rows):
            if suppressed := min_tokens_suppressed(r):
                logits[i, suppressed] = float("-inf")
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                ids = torch.tensor([t for t, _ in r.params.logit_bias], device=logits.device)
                logits[i, ids] += torch.tensor([b for _, b in r.params.logit_bias], device=logits.device)
        apply_penalties(logits, rows)
        tokens = greedy_tokens(logits, rows)  # every greedy row in one argmax (one sync on a GPU)
        for i, r in enumerate(rows):
            if tokens[i] is None:
                tokens[i] = sample(logits[i], r.params, r.generator or self.generator)
        lps: list[TokenLogprobs | None] = [
            top_logprobs(raw[i], tokens[i], r.params.logprobs) if raw is not None and r.params.logprobs is not None
            else None
            for i, r in enumerate(rows)]
        return tokens, lps

    def verify(self, logits: torch.Tensor, rows: list[SampleRow], draft: list[int]
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Speculative decoding's acceptance, exact: position j (logits[j], rows[j]: the
        request's history with the draft's first j tokens) is sampled as decoding would
        sample it, with the request's generator, in order; the draft is kept while each
        sample equals its token. Returns the tokens to append (the kept draft tokens, then
        the first sample that differs, or one more after a draft kept whole) and their
        logprobs: the same draws, so the same tokens, as decoding one at a time.
        logits: [len(draft) + 1, V] float32 (modified in place)."""
        tokens: list[int] = []
        lps: list[TokenLogprobs | None] = []
        for j, row in enumerate(rows):
            (tok,), (lp,) = self(logits[j:j + 1], [row])
            tokens.append(tok)
            lps.append(lp)
            if j == len(draft) or tok != draft[j]:
                break
        return tokens, lps
