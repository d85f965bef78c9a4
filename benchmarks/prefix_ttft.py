"""Cold vs warm time to first token on a long shared prefix, in-process.

A 1,000-token prefix plus a 30-token question: one cold request, then warm
requests with new questions (the `ttft` shape of docs/benchmarks.md). TTFT here is the
time from add_request to the first sampled token, through the engine's step loop, by the
wall clock and by the process's CPU time (all its threads: on a shared machine the wall
clock measures the sharing; OMP_WAIT_POLICY=passive keeps idle threads from spinning).

    .venv/bin/python benchmarks/prefix_ttft.py [--model FILE.gguf] [--warm 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from run_facts import report

from hotprefix import LLM, SamplingParams


def ttft(llm: LLM, rid: str, ids: list[int]) -> float:
    return ttft_cpu(llm, rid, ids)[0]


def ttft_cpu(llm: LLM, rid: str, ids: list[int]) -> tuple[float, float]:
    """(wall, CPU) seconds from add_request to the first sampled token."""
    eng = llm.engine
    c0 = time.process_time()
    t0 = time.perf_counter()
    eng.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=1))
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0, time.process_time() - c0
    assert first is not None
    return first


def single_decode(llm: LLM, prompt: list[int], n: int = 33) -> float:
    """Tokens/s of one sequence: (n - 1) / (time of token n - time of token 1)."""
    eng = llm.engine
    eng.add_request("decode", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    stamps = []
    while eng.has_unfinished_requests():
        if eng.step():
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a model path (default: the bundled model)")
    ap.add_argument("--decode-tokens", type=int, default=33)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(model=a.model, kv_cache_memory=512 << 20)
    rng = random.Random(a.seed)
    vocab = llm.engine.arch.vocab_size
    prefix = [rng.randrange(100, vocab) for _ in range(a.prefix_tokens)]

    def question() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(a.question_tokens)]

    ttft(llm, "warmup", [rng.randrange(100, vocab) for _ in range(64)])  # first-call overheads
    cold_wall, cold_cpu = ttft_cpu(llm, "cold", prefix + question())
    warm_both = [ttft_cpu(llm, f"warm{i}", prefix + question()) for i in range(a.warm)]
    warm, warm_cpu = [w for w, _ in warm_both], [c for _, c in warm_both]
    stats = llm.engine.kv.make_stats()
    decode = single_decode(llm, question(), a.decode_tokens)
    result = {
        "model": llm.engine.model_name,
        "prompt_tokens": a.prefix_tokens + a.question_tokens,
        "cold_ttft_s": cold_wall,
        "warm_ttft_s_median": statistics.median(warm),
        "warm_ttft_s": warm,
        "warm_over_cold": statistics.median(warm) / cold_wall,
        "cold_ttft_cpu_s": cold_cpu,
        "warm_ttft_cpu_s_median": statistics.median(warm_cpu),
        "warm_over_cold_cpu": statistics.median(warm_cpu) / cold_cpu,
        "prefix_cache_hit_rate": stats.hit_rate,
        "decode_tokens_per_s_1_seq": decode,
    }
    report(result, a.json)


if __name__ == "__main__":
    main()
