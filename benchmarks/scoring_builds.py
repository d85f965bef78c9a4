"""Scoring's cost on each kernel build this CPU can run (issue 44): in process, the default
model, a fresh ~700-token prompt each time, a plain one-token request against `prompt_logprobs`
with `max_tokens: 0` (and with 1), interleaved; one child process per build, since a process
loads one kernel library:

    native        -march=native (AMX tiles where the CPU has them)
    native-noamx  the same with HOTPREFIX_NO_AMX=1: the AVX-512 VNNI kernels a CPU without AMX runs
    x86-64-v3     the AVX2 kernels an AVX2-only CPU runs (here on this CPU, so only indicative)

    .venv/bin/python benchmarks/scoring_builds.py [--reps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from run_facts import report

BUILDS = {"native": ("native", {}), "native-noamx": ("native", {"HOTPREFIX_NO_AMX": "1"}),
          "x86-64-v3": ("x86-64-v3", {})}


def child(march: str, reps: int) -> dict:
    """This process's medians (ms) for each kind, on a library built for `march`."""
    from hotprefix.model.kernels import build

    real = build.build_library
    build.build_library = lambda force=False, march_=march, defines=(): real(force, march=march_, defines=defines)
    from hotprefix.engine.llm import LLM
    from hotprefix.sampling_params import SamplingParams

    llm = LLM(kv_cache_memory="256MiB", enable_prefix_caching=False)
    base = [(31 * j) % 40000 + 100 for j in range(699)]
    kinds = {"plain": SamplingParams(max_tokens=1, temperature=0),
             "prompt_logprobs_max0": SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0),
             "prompt_logprobs_max1": SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    rng = random.Random(0)
    for rep in range(reps + 1):  # the first round warms up
        for kind, params in kinds.items():
            prompt = [rng.randrange(300, 40000), *base]  # a fresh first token: nothing cached
            t0 = time.perf_counter()
            llm.generate([prompt], [params])
            if rep:
                times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"paths": build.vector_paths(build.library()),
            "median_ms": {k: round(v * 1000, 1) for k, v in med.items()},
            "ratio_to_plain_median": {k: round(med[k] / med["plain"], 3) for k in kinds if k != "plain"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return
    builds = {}
    for name, (march, env) in BUILDS.items():
        out = subprocess.run([sys.executable, __file__, "--child", march, "--reps", str(args.reps)],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
        builds[name] = json.loads(out.strip().splitlines()[-1])
    report({"prompt_tokens": 700, "reps": args.reps, "builds": builds}, args.json)


if __name__ == "__main__":
    main()
