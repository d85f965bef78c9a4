"""Single-stream decode rate of a running OpenAI-compatible server, shorter than `hotprefix
bench --workload decode` (3 x 128 tokens) for machines where that would take too long:
`rounds` streamed completions of `tokens` tokens, one at a time, each one's rate the tokens
after its first over the time after its first (bench's definition).

    .venv/bin/python benchmarks/stream_decode.py URL [--tokens 16] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx
from run_facts import report

from hotprefix.tools.bench import _request


async def rates(url: str, tokens: int, rounds: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=3600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        for i in range(rounds):
            r = await _request(client, url, model, f"Story {i}: the harbour at dawn, the boats and the gulls", tokens)
            if not r.ok or r.ttft is None or r.output_tokens < 2:
                raise SystemExit(f"round {i} failed: {r.error}")
            out.append((r.output_tokens - 1) / (r.end - r.start - r.ttft))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    got = asyncio.run(rates(a.url.rstrip("/"), a.tokens, a.rounds))
    report({"url": a.url, "tokens": a.tokens, "rates": got, "stream_tokens_per_s_median": statistics.median(got)},
           a.json)


if __name__ == "__main__":
    main()
