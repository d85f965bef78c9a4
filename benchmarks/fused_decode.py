"""Decode speed with and without the fused decode path (model/fused_decode.py), in one
process on the same weights, alternating rounds; and where a layer-by-layer step goes.

    .venv/bin/python benchmarks/fused_decode.py [--rounds 5] [--tokens 64]

Prints tokens/s of one sequence and of 8 together (greedy, ignore_eos, a 30-token
prompt), the median over rounds for each path, and the sum of the kernels' own times
at one row (each call timed alone) against the layer-by-layer step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model.kernels import ops
from hotprefix.model.runner import ModelRunner
from hotprefix.model.steps.fused_decode import FusedDecode


def decode_rate(llm: LLM, n_seqs: int, tokens: int) -> float:
    """Generated tokens/s over the steps after the first (the prefill) of n_seqs sequences."""
    eng = llm.engine
    for i in range(n_seqs):
        eng.add_request(f"r{i}", [100 + 17 * i + j for j in range(30)],
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    stamps = []
    while eng.has_unfinished_requests():
        if eng.step():
            stamps.append(time.perf_counter())
    return n_seqs * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def kernel_sum_ms(runner: ModelRunner) -> float:
    """The kernels of one layer-by-layer decode step at one row, each timed alone."""
    model = runner.model
    layer = model.model.layers[0]
    x, wide = torch.randn(1, model.arch.hidden_size), torch.randn(1, model.arch.intermediate_size)

    def med(fn, n: int = 200) -> float:
        for _ in range(10):
            fn()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    per_layer = (med(lambda: ops.qmatmul(x, layer.self_attn.qkv_blocks))
                 + med(lambda: ops.qmatmul(x, layer.self_attn.o_proj.blocks))
                 + med(lambda: ops.qmatmul(x, layer.mlp.gate_up_blocks))
                 + med(lambda: ops.qmatmul(wide, layer.mlp.down_proj.blocks)))
    return (per_layer * len(model.model.layers) + med(lambda: model.compute_logits(x), 50)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    llm = LLM(kv_cache_memory=512 << 20, quantized_matmul="int8")
    runner = llm.engine.runner
    steps = runner.steps
    assert runner.strategy(FusedDecode) is not None, "no fused path here (int8 mode needs the C library)"
    results: dict[tuple[str, int], list[float]] = {}
    decode_rate(llm, 1, 8)  # warm-up
    for _ in range(a.rounds):
        for name, path in (("layered", []), ("fused", steps)):
            runner.steps = path
            for n in (1, 8):
                results.setdefault((name, n), []).append(decode_rate(llm, n, a.tokens))
    runner.steps = steps
    for (name, n), rates in sorted(results.items()):
        print(f"{name:8s} {n} seq: median {statistics.median(rates):6.1f} tok/s  "
              f"(rounds: {', '.join(f'{r:.1f}' for r in rates)})")
    one = statistics.median(results[("layered", 1)])
    print(f"layered step at 1 seq: {1e3 / one:.2f} ms; its projections and logits, each timed alone: "
          f"{kernel_sum_ms(runner):.2f} ms")


if __name__ == "__main__":
    main()
