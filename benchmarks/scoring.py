"""Scoring vs generating over HTTP (issue 44): a ~700-token prompt's echo + logprobs with
max_tokens 0 against a plain one-token request of a prompt of the same length, on
`hotprefix serve` with the default model; interleaved, every prompt fresh (its first token
differs, so nothing is a cache hit) except the repeat, which scores the previous scoring
prompt again (its blocks and their logprobs cached).

    .venv/bin/python benchmarks/scoring.py [--reps 15] [--tokens 700] [--url URL ...] [--json out.json]

With several --url, each round runs every kind on every server in turn (e.g. the main
branch's server beside this one's): the same run, the same load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx
from run_facts import report

TEXT = ("The scheduler decides which requests run each step and how many tokens each one computes; the "
        "prefix cache keeps the keys and values of every block it has seen, so a prompt that shares its start "
        "with an earlier one computes only the rest. ")


def serve(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "hotprefix", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up")


def timed(url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "default", "temperature": 0, **body}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--url", action="append", help="a running server (default: start one here)")
    ap.add_argument("--json")
    args = ap.parse_args()
    proc = None if args.url else serve(8197)
    urls = args.url or ["http://127.0.0.1:8197"]
    models = {u: httpx.get(u + "/v1/models").json()["data"][0]["id"] for u in urls}
    base = httpx.post(urls[0] + "/tokenize", json={"prompt": TEXT * 20}).json()["tokens"][:args.tokens - 1]
    kinds = {"plain": {"max_tokens": 1}, "score": {"max_tokens": 0, "echo": True, "logprobs": 1},
             "score_again": {"max_tokens": 0, "echo": True, "logprobs": 1},
             "prompt_logprobs": {"max_tokens": 1, "prompt_logprobs": 1}}
    times: dict[str, dict[str, list[float]]] = {u: {k: [] for k in kinds} for u in urls}
    load = [os.getloadavg()[0]]
    fresh, first = iter(range(300, 10**6)), 0
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for u in urls:
            for kind, extra in kinds.items():
                first = first if kind == "score_again" else next(fresh)  # again: the scoring prompt just sent
                t = timed(u, {"model": models[u], "prompt": [first, *base], **extra})
                if rep:
                    times[u][kind].append(t)
        load.append(os.getloadavg()[0])
    if proc is not None:
        proc.terminate()
    result = {"prompt_tokens": args.tokens, "reps": args.reps, "load_avg_1min": [round(x, 1) for x in load],
              "servers": {}}
    for u in urls:
        med = {k: statistics.median(v) for k, v in times[u].items()}
        result["servers"][u] = {
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "min_s": {k: round(min(v), 3) for k, v in times[u].items()},
            "ratio_to_plain_median": {k: round(med[k] / med["plain"], 3) for k in kinds if k != "plain"},
            "ratio_to_plain_min": {k: round(min(times[u][k]) / min(times[u]["plain"]), 3) for k in kinds
                                   if k != "plain"}}
    report(result, args.json)


if __name__ == "__main__":
    main()
