"""Single-stream decode rate of a running OpenAI-compatible server, shorter than `hotprefix
bench --workload decode` (3 x 128 tokens) for machines where that would take too long, and
independent of streamed text (llama-server holds back a random model's tokens that are not
whole UTF-8, so a stream's first text can come late or never): per round, one prompt asked
for 1 token (its prefix then cached), then 2, then 2 + `tokens` tokens; the rate is
`tokens` over the difference of the last two latencies (each server's own token counts
checked).

    .venv/bin/python benchmarks/stream_decode.py URL [--tokens 16] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from run_facts import report


def latency(client: httpx.Client, url: str, model: str, prompt: str, n: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    took = time.perf_counter() - t0
    r.raise_for_status()
    got = r.json()["usage"]["completion_tokens"]
    if got != n:
        raise SystemExit(f"asked for {n} tokens, got {got}")
    return took


def rates(url: str, tokens: int, rounds: int) -> list[float]:
    out = []
    with httpx.Client(timeout=3600) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for i in range(rounds):
            prompt = f"Story {i}: the harbour at dawn, the boats and the gulls"
            latency(client, url, model, prompt, 1)
            short, long = latency(client, url, model, prompt, 2), latency(client, url, model, prompt, 2 + tokens)
            out.append(tokens / (long - short))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    got = rates(a.url.rstrip("/"), a.tokens, a.rounds)
    report({"url": a.url, "tokens": a.tokens, "rates": got, "stream_tokens_per_s_median": statistics.median(got)},
           a.json)


if __name__ == "__main__":
    main()
