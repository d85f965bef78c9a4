"""How much could any draft proposer gain on benchmarks/speculative.py's workloads: an
upper bound from the greedy answers themselves, and the step costs measured here.

    .venv/bin/python benchmarks/spec_oracle.py [--tokens 96] [--k 4] [--workloads edit,json]

Each workload's greedy answer (speculation off, `--tokens` tokens) is generated once.
Then, for every answer token after the first (the first comes from the prefill, not a
decode step), is it one a proposer could have drafted:
  copy    its preceding token occurs earlier in the context (prompt and answer so far)
          followed by it: the loosest n-gram oracle (n = 1; any longer match implies it),
          so no proposer that copies the request's own text drafts a token this misses
  forced  (under a grammar) it is the first of llguidance's fast-forward tokens there
With c(d) the measured cost of a decode step verifying d draft tokens (the fastest of
`--reps`, interleaved: speculative.py's step_costs, at the workload's context length, d up
to 2k under a grammar: a constrained draft is up to k forced tokens and then up to k n-gram
tokens), an omniscient proposer drafts at each step d <= k tokens (2k for copy or forced)
of the run of draftable tokens that follows, d chosen for the least total cost (a dynamic
program): the step yields them and the sampled token, and its speed-up over no speculation
is (N - 1) c(0) / sum of c(d) over its steps, the bound for that kind of proposer at that k. The same is printed for the
real proposer's rules with no adaptive back-off (n-gram lookup prompt_lookup_min..max,
the latest occurrence; under a grammar up to k forced tokens first, then up to k n-gram
tokens), which shows what the adaptive rules and the lookup leave on the table.
"""

from __future__ import annotations

import argparse

from speculative import step_costs, workloads  # (benchmarks/speculative.py: the same prompts)

from hotprefix import LLM, SamplingParams
from hotprefix.config import SpeculativeConfig
from hotprefix.core.request import Request
from hotprefix.core.speculation import CONSTRAINED_LOOKUP_MIN, Speculator, find_draft
from hotprefix.core.suffix_table import encode


def copyable(context: list[int], token: int) -> bool:
    """Whether (context[-1], token) occurs in context: an n = 1 match that a copy proposes."""
    last = context[-1]
    return any(context[j] == last and context[j + 1] == token for j in range(len(context) - 1))


def forced_runs(llm: LLM, so, answer: list[int]) -> list[list[int]]:
    """The grammar's fast-forward tokens after each prefix answer[:i] (i = 0 .. N - 1)."""
    m = llm.engine.grammars.new_matcher(so)
    runs = []
    for tok in answer:
        runs.append(m.compute_ff_tokens())
        m.consume_token(tok)
    return runs


def omniscient(draftable: list[bool], k: int, cost: list[float]) -> list[tuple[int, int]]:
    """The steps (draft length, accepted) over positions 1 .. N - 1 of an omniscient
    proposer: at each step a draft of d <= k tokens, all draftable (and before the last
    position: a step samples one more), d chosen for the least total cost (a dynamic
    program over the positions)."""
    n = len(draftable)
    best: list[tuple[float, int]] = [(0.0, 0)] * (n + 1)  # from position i on: (least cost, first step's d)
    for i in range(n - 1, 0, -1):
        options, d = [(cost[0] + best[min(n, i + 1)][0], 0)], 0
        while d < k and i + d < n - 1 and draftable[i + d]:
            d += 1
            options.append((cost[d] + best[i + d + 1][0], d))
        best[i] = min(options)
    steps, i = [], 1
    while i < n:
        d = best[i][1]
        steps.append((d, d))
        i += d + 1
    return steps


def rules(prompt: list[int], answer: list[int], forced: list[list[int]] | None, k: int,
          min_n: int, max_n: int) -> list[tuple[int, int]]:
    """The steps (draft length, accepted) of the real proposer's drafts with no back-off:
    up to k forced tokens (under a grammar), then k n-gram tokens after them."""
    steps, i = [], 1
    while i < len(answer):
        context = prompt + answer[:i]
        ff = forced[i][:min(k, len(answer) - 1 - i)] if forced is not None else []
        draft = ff + find_draft(encode(context + ff), min_n, max_n, k)
        draft = draft[:len(answer) - 1 - i]
        a = 0
        while a < len(draft) and draft[a] == answer[i + a]:
            a += 1
        steps.append((len(draft), a))
        i += a + 1
    return steps


class Replayed:
    """The grammar of a replayed answer (GrammarDrafts): a matcher moved by the tokens kept."""

    def __init__(self, matcher) -> None:
        self.m = matcher

    def forced_tokens(self, request_id: str) -> list[int]:
        return self.m.compute_ff_tokens()

    def accepted_prefix(self, request_id: str, tokens: list[int]) -> int:
        return self.m.validate_tokens(tokens)


def replay(llm: LLM, config: SpeculativeConfig, prompt: list[int], answer: list[int], params: SamplingParams
           ) -> list[tuple[int, int]]:
    """The steps (draft length, accepted) the engine's Speculator, adaptive rules included,
    takes over a greedy answer, each draft's verification being its common prefix with the
    answer (what greedy verification gives): the benchmark's counters without the model."""
    grammar = Replayed(llm.engine.grammars.new_matcher(params.structured)) if params.structured else None
    spec = Speculator(config, grammar)
    req = Request("r", prompt, params)
    steps, i = [], 1
    take = answer[:1]
    while i < len(answer):
        req.output_token_ids += take
        if grammar is not None:
            grammar.m.consume_tokens(take)
        req.num_computed_tokens = req.num_tokens - 1
        draft = spec.propose(req)
        a = 0
        while a < len(draft) and draft[a] == answer[i + a]:
            a += 1
        if draft:
            spec.observe("r", len(draft), a)
        steps.append((len(draft), a))
        take = answer[i:i + a + 1]
        i += a + 1
    return steps


def report(label: str, steps: list[tuple[int, int]], cost: list[float], n: int) -> str:
    """One line: the steps, drafts, draft tokens and accepted, and the speed-up by the costs."""
    drafts = [(d, a) for d, a in steps if d]
    return (f"  {label}: {len(steps)} steps, {len(drafts)} drafts, {sum(d for d, _ in drafts)} draft tokens, "
            f"{sum(a for _, a in drafts)} accepted; {(n - 1) / len(steps):.2f} tokens a step; "
            f"speed-up {(n - 1) * cost[0] / sum(cost[d] for d, _ in steps):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--workloads", default="edit,json")
    a = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(speculative_config=spec, kv_cache_memory="512MiB")
    llm.engine.scheduler.spec = None  # the reference answers: no speculation
    loads = {k: v for k, v in workloads(llm, a.tokens).items() if k in a.workloads.split(",")}
    answers = {}
    for name, (messages, params) in loads.items():  # all answers first: step_costs writes KV blocks in place
        (out,) = llm.chat([messages], params)
        answers[name] = out.prompt_token_ids, out.outputs[0].token_ids
    for name, (_, params) in loads.items():
        prompt, answer = answers[name]
        n = len(answer)
        forced = forced_runs(llm, params.structured, answer) if params.structured is not None else None
        copy = [i > 0 and copyable(prompt + answer[:i], answer[i]) for i in range(n)]
        ff = [bool(forced and forced[i] and forced[i][0] == answer[i]) for i in range(n)]
        config = llm.engine.config.scheduler.speculative_config
        longest = config.max_draft_tokens if forced is not None else a.k  # (up to k forced, then k n-gram tokens)
        best = step_costs(llm, len(prompt) + n // 2, list(range(longest + 1)), a.reps) if a.reps else {}
        cost = [best.get(d, 1.0) for d in range(longest + 1)]  # --reps 0: every step costs the same
        print(f"\n{name}: {n} tokens, prompt {len(prompt)}; step cost at {len(prompt) + n // 2} tokens: "
              f"{cost[0] * 1e3:.1f} ms, c(d)/c(0) for d = 0..{longest}: "
              + " ".join(f"{c / cost[0]:.2f}" for c in cost))
        print(f"  draftable of {n - 1}: copy {sum(copy)}, forced {sum(ff)} (of {sum(1 for f in forced or [] if f)} "
              f"positions with forced tokens), either {sum(c or f for c, f in zip(copy, ff))}")
        for label, able, most in (("omniscient, copy", copy, a.k), ("omniscient, forced", ff, a.k),
                                  ("omniscient, copy or forced", [c or f for c, f in zip(copy, ff)], longest)):
            print(report(label, omniscient(able, most, cost), cost, n))
        least = min(config.prompt_lookup_min, CONSTRAINED_LOOKUP_MIN) if forced is not None \
            else config.prompt_lookup_min  # (a constrained request's lookup: core/speculation.py)
        print(report(f"the Speculator replayed (k={a.k}, n={least}..{config.prompt_lookup_max})",
                     replay(llm, config, prompt, answer, params), cost, n))
        for min_n, use_ff in ((2, False), (1, False), (2, True), (1, True)):
            if not use_ff or forced is not None:
                steps = rules(prompt, answer, forced if use_ff else None, a.k, min_n, 4)
                print(report(f"rules n={min_n}..4{', forced first' if use_ff else ''}", steps, cost, n))


if __name__ == "__main__":
    main()
