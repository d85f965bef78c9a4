"""Decode speed with and without prompt-lookup speculation (core/speculation.py), in one
process on the same weights and engine, the two alternating (speculation switched by
the scheduler's Speculator), one request at a time, greedy.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--tokens 96] [--k 4] [--workloads quote,...]
        [--model PATH]

Workloads on the bundled model (real weights; prompts from spec_prompts.py):
  quote   a ~1,500-token document (docs/engine.md's opening) and "repeat the paragraph about ..."
  edit    a 122-line Python file (hotprefix/core/fairness.py) and "rename X to Y, output the file"
  json    a schema-constrained extraction (a grammar: drafts cut where it stops taking them)
  unique  a story, nothing to copy
  chat    a multi-turn chat (system prompt, two earlier turns, a new question): little to copy
--model runs another model (e.g. a random-weight GGUF of the 1B shape, benchmarks/make_gguf.py):
its answers are noise, so on it every workload is one with nothing to accept.
Each workload runs once first (untimed), so every timed run finds its prompt cached. Prints,
per workload and mode, the median decode tokens/s over rounds (tokens after the first over
the time from the first token to the last) and the median process CPU seconds per token
(less sensitive to other load on a shared machine), the ratios, and the drafts' acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from spec_prompts import WORKLOADS, prompts

from hotprefix import LLM, SamplingParams
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.sampling_params import StructuredKind, StructuredOutput


def workloads(llm: LLM, tokens: int) -> dict[str, tuple[list[dict], SamplingParams]]:
    """spec_prompts' workloads as greedy SamplingParams of `tokens` tokens (json's schema a grammar)."""
    out = {}
    for name, (messages, schema) in prompts(llm.engine.tokenize).items():
        structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema)) if schema else None
        out[name] = (messages, SamplingParams(temperature=0.0, max_tokens=tokens, structured=structured))
    return out


def decode_rate(llm: LLM, messages: list[dict], params: SamplingParams) -> tuple[float, float, int]:
    """(decode tokens/s, process CPU seconds per token, tokens) of one request."""
    cpu = time.process_time()
    (out,) = llm.chat([messages], params)
    cpu = time.process_time() - cpu
    n = len(out.outputs[0].token_ids)
    return (n - 1) / (out.finished_time - out.first_token_time), cpu / n, n


def step_cost(llm: LLM, context: int, k: int, reps: int) -> tuple[float, float]:
    """The least wall seconds (over reps, the two alternating) of a decode step of one
    sequence at `context` tokens, and of the same step verifying a draft of k (k + 1 rows
    of the fused step, and their logits): the least is what contention on a shared
    machine disturbs least."""
    best = step_costs(llm, context, [0, k], reps)
    return best[0], best[k]


def step_costs(llm: LLM, context: int, drafts: list[int], reps: int) -> dict[int, float]:
    """The least wall seconds (over reps, interleaved) of a step of one sequence at
    `context` tokens verifying a draft of d tokens (d + 1 rows), for each d in drafts."""
    runner = llm.engine.runner
    bs = runner.block_size
    blocks = list(range(-(-(context + max(drafts) + 1) // bs)))  # a fresh pool: no request holds these
    prompt = [100 + i % 1000 for i in range(context)]
    runner.forward(SchedulerOutput([ScheduledRequest("c", prompt, 0, blocks, False, SamplingParams(), prompt, [])]))
    best = dict.fromkeys(drafts, float("inf"))
    for _ in range(reps):
        for d in drafts:
            sr = ScheduledRequest("c", [7] * (d + 1), context, blocks, False, SamplingParams(), prompt, [],
                                  draft_token_ids=[7] * d)
            t = time.perf_counter()
            hidden = runner.forward(SchedulerOutput([sr]))
            runner.model.compute_logits(hidden)
            best[d] = min(best[d], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--step-cost-only", action="store_true", help="only the cost of a step with and without a draft")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--model", default=None, help="a model path (default: the bundled model)")
    a = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(a.model, speculative_config=spec, kv_cache_memory="512MiB")
    sched = llm.engine.scheduler
    for context in (300, 1500):
        plain, draft = step_cost(llm, context, a.k, 40)
        print(f"one sequence at {context} tokens: a decode step {plain * 1e3:.1f} ms, with a draft of {a.k} "
              f"{draft * 1e3:.1f} ms ({draft / plain:.2f}x), fastest of 40 each", flush=True)
    if a.step_cost_only:
        return
    speculator = sched.spec
    loads = {k: v for k, v in workloads(llm, a.tokens).items() if k in a.workloads.split(",")}
    rates: dict[tuple[str, bool], list[float]] = {}
    cpus: dict[tuple[str, bool], list[float]] = {}
    accepted: dict[str, list[int]] = {}
    for messages, params in loads.values():
        llm.chat([messages], params)  # the prompt into the cache
    for r in range(a.rounds):
        for name, (messages, params) in loads.items():
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                sched.spec = speculator if on else None
                speculator.make_stats()
                rate, cpu, n = decode_rate(llm, messages, params)
                rates.setdefault((name, on), []).append(rate)
                cpus.setdefault((name, on), []).append(cpu)
                if on:
                    s = speculator.make_stats()
                    accepted[name] = [s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, n]
                mode = "spec" if on else "off "
                print(f"round {r} {name:7s} {mode} {rate:6.1f} tok/s, {cpu * 1e3:6.1f} CPU ms/token ({n} tokens)",
                      flush=True)
    print(f"\n| workload | off: tok/s, CPU ms/token | ngram k={a.k}: tok/s, CPU ms/token | ratio (tok/s; CPU) | "
          "drafts, draft tokens, accepted (last round) |")
    print("|---|---|---|---|---|")
    for name in loads:
        off, on = statistics.median(rates[(name, False)]), statistics.median(rates[(name, True)])
        c_off, c_on = statistics.median(cpus[(name, False)]) * 1e3, statistics.median(cpus[(name, True)]) * 1e3
        d, dt, acc, n = accepted[name]
        print(f"| {name} | {off:.1f}, {c_off:.0f} | {on:.1f}, {c_on:.0f} | {on / off:.2f}x; {c_off / c_on:.2f}x | "
              f"{d}, {dt}, {acc} of {n} tokens |")


if __name__ == "__main__":
    main()
