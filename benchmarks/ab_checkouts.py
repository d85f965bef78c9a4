"""Same-run A/B of two checkouts of hotprefix on the bundled model, offline (`LLM`): each
round runs one process per checkout, alternating, so both see the same machine noise.
Per process: the median of 3 cold prefills of a 1,030-token prompt (TTFT: one token),
single-stream decode tokens/s (64 tokens after a 100-token prompt), and 8 concurrent
requests on a warm 1,000-token shared prefix (32 tokens each). Prints each round and the
medians; --json writes them. --cpu-time: one thread (OMP_NUM_THREADS=1) and CPU seconds
(process_time) in place of wall seconds, for a machine loaded by others, where a 2-thread
step's barriers wait on descheduled threads.

    .venv/bin/python benchmarks/ab_checkouts.py BASE NEW --rounds 5 [--mode int8] [--kv auto] [--model FILE.gguf]

--base-env KEY=VALUE sets a variable in the base's processes only: one checkout against
itself with a path switched off, e.g. `. . --base-env HOTPREFIX_NO_AMX=1` (AMX tiles off
in base, on in new).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, random, statistics, sys, time
from hotprefix import LLM, SamplingParams
mode, kv, model = sys.argv[1], sys.argv[2], sys.argv[3] or None
llm = LLM(model=model, quantized_matmul=mode, kv_cache_dtype=kv, enable_prefix_caching=True, kv_cache_memory=1 << 30)
rng = random.Random(0)
def prompt(n): return [rng.randrange(100, 40000) for _ in range(n)]
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([prompt(64)], one)
def timed(fn):
    t = time.perf_counter(); fn(); return time.perf_counter() - t
ttft = statistics.median(timed(lambda: llm.generate([prompt(1030)], one)) for _ in range(3))
dec = statistics.median(64 / timed(lambda: llm.generate([prompt(100)], SamplingParams(
    temperature=0, max_tokens=64, ignore_eos=True))) for _ in range(3))
system = prompt(1000)
llm.generate([system + [5]], one)
conc = statistics.median(8 * 32 / timed(lambda: llm.generate([system + prompt(30) for _ in range(8)], SamplingParams(
    temperature=0, max_tokens=32, ignore_eos=True))) for _ in range(3))
print(json.dumps({"ttft_s": ttft, "decode_tok_s": dec, "conc8_tok_s": conc}))
'''


def run(checkout: str, python: str, mode: str, kv: str, model: str, cpu_time: bool = False,
        extra_env: dict[str, str] | None = None) -> dict:
    child, env = CHILD, {**os.environ, **(extra_env or {})}
    if cpu_time:
        child, env = CHILD.replace("time.perf_counter()", "time.process_time()"), {**env, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([python, "-c", child, mode, kv, model], cwd=checkout, capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--model", default="", help="a model path (default: the bundled model)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (its hotprefix is each checkout's own: "
                                                               "the checkout is the working directory)")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, CPU seconds (a loaded machine)")
    ap.add_argument("--base-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable of the base's processes only (repeatable)")
    ap.add_argument("--json")
    a = ap.parse_args()
    envs = {"base": dict(kv.split("=", 1) for kv in a.base_env), "new": {}}
    got: dict[str, list[dict]] = {"base": [], "new": []}
    for r in range(a.rounds):
        for name, path in (("base", a.base), ("new", a.new)) if r % 2 == 0 else (("new", a.new), ("base", a.base)):
            got[name].append(run(path, a.python, a.mode, a.kv, a.model, a.cpu_time, envs[name]))
            print(r, name, got[name][-1], flush=True)
    med = {n: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for n, rows in got.items()}
    for k in med["base"]:
        print(f"{k}: base {med['base'][k]:.3f}  new {med['new'][k]:.3f}  new/base {med['new'][k] / med['base'][k]:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": got, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
