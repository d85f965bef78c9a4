"""In-process A/B runs on one engine, alternating a switch between runs (both sides see
the same machine noise). Prints tokens/s per run and the medians.

    .venv/bin/python benchmarks/ab_inprocess.py cascade-one-prefix   # 8 decodes on one warm 1,000-token prefix
    .venv/bin/python benchmarks/ab_inprocess.py cascade-four-prefixes # 8 decodes over 4 warm 500-token prompts
    .venv/bin/python benchmarks/ab_inprocess.py caching-unique        # 16 unique 300-token prompts, caching on/off
    .venv/bin/python benchmarks/ab_inprocess.py blocks-1              # 1 decode on a warm 1,000-token prefix,
    .venv/bin/python benchmarks/ab_inprocess.py blocks-8              # or 8: GGUF block kernel on/off
    .venv/bin/python benchmarks/ab_inprocess.py int8-8                # the same, int8 vs float32 activations
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import warnings

from hotprefix import LLM, SamplingParams
from hotprefix.config import QuantizedMatmul
from hotprefix.model.attention import AttentionPaths
from hotprefix.model.build import build_model
from hotprefix.model.kernels.build import resolve_matmul
from hotprefix.model.loader import load_model
from hotprefix.model.steps.fused_decode import FusedDecode, unfusable

warnings.filterwarnings("ignore")


def main(kind: str, reps: int = 3) -> None:
    llm = LLM(kv_cache_memory=1 << 30)
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.arch.vocab_size

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    if kind.startswith("cascade"):
        systems = [toks(1000)] if kind == "cascade-one-prefix" else [toks(500) for _ in range(4)]
        for i, s in enumerate(systems):  # make the prefixes warm
            eng.add_request(f"warm{i}", s + [5], SamplingParams(max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        prompts = lambda: [systems[i % len(systems)] + toks(30) for i in range(8)]  # noqa: E731

        def switch(on: bool) -> None:
            eng.runner.paths = AttentionPaths(cascade=on)
    elif kind.startswith(("blocks-", "int8-")):
        system = toks(1000)
        eng.add_request("warm", system + [5], SamplingParams(max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        prompts = lambda: [system + toks(30) for _ in range(int(kind.split("-")[1]))]  # noqa: E731
        runner = eng.runner
        int8 = resolve_matmul("auto") is QuantizedMatmul.INT8  # what serve would run
        # int8 vs float32 activations on the blocks; or the blocks (as configured) vs the float32 weights
        forms = {True: (True, True), False: (True, False)} if kind.startswith("int8-") else \
            {True: (True, int8), False: (False, False)}
        variants = {}
        for on, (blocks, as_int8) in forms.items():  # two models over the one pool, swapped between runs
            model = build_model(load_model(None), runner.device, runner.dtype, blocks, as_int8, runner.backend)[0]
            fused = unfusable(model, runner.kv_cache, runner.backend) is None
            variants[on] = (model, [FusedDecode(model, runner.kv_cache, runner.backend)] if fused else [])

        def switch(on: bool) -> None:
            runner.model, runner.steps = variants[on]
    elif kind == "caching-unique":
        prompts = lambda: [toks(300) for _ in range(16)]  # noqa: E731

        def switch(on: bool) -> None:
            eng.kv.enable_caching = on
            eng.kv.reset_prefix_cache()
    else:
        raise SystemExit(f"unknown A/B {kind!r}")

    def run() -> float:
        for i, p in enumerate(prompts()):
            eng.add_request(f"r{time.monotonic()}-{i}", p, SamplingParams(temperature=0, max_tokens=32,
                                                                          ignore_eos=True))
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            n += sum(len(o.new_token_ids[0]) for o in eng.step())
        return n / (time.perf_counter() - t0)

    run()  # first-call overheads
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for on in (True, False):
            switch(on)
            res[on].append(run())
    for on in (True, False):
        print(f"{kind} {'on ' if on else 'off'}: {[round(x, 1) for x in res[on]]} tok/s, "
              f"median {statistics.median(res[on]):.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cascade-one-prefix")
