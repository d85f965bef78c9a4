"""`hotprefix bench`: the shared-prefix workloads (docs/benchmarks.md) against any OpenAI-compatible server.

Prompts are built deterministically from a seed and sent as text to
/v1/completions (every server sees identical text), streamed, greedy, with a
fixed max_tokens and ignore_eos. `--compare URL2` runs the same workload
against a second server in the same invocation and prints ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hotprefix.config import ConfigError
from hotprefix.tools.logs import percentile
from hotprefix.tools.watch import parse_metrics
from hotprefix.tools.workloads import WORKLOADS, Job, build, words

__all__ = ["WORKLOADS", "Job", "build", "run"]


@dataclass
class Result:
    ok: bool
    start: float
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    error: str | None = None


async def _request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, start=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                for c in chunk.get("choices") or []:
                    if c.get("text"):
                        if res.ttft is None:
                            res.ttft = now - res.start
                        elif last is not None:
                            res.itls.append(now - last)
                        last = now
                        res.output_tokens += 1
                        res.text += c["text"]
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end = time.perf_counter()
    return res


async def _metrics(client: httpx.AsyncClient, url: str):
    try:
        r = await client.get(url + "/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ConfigError):
        return None


def _rss_peak(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def run_workload(url: str, workload: str, seed: int = 0, scale: float = 1.0, max_tokens: int = 32,
                       pid: int | None = None, progress: bool = False, api_key: str | None = None) -> dict[str, Any]:
    """Run one workload against url (with `Authorization: Bearer api_key` if given);
    return its measurements."""
    url = url.rstrip("/")
    jobs, concurrency, turns = build(workload, seed, scale)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # a fresh connection per request, for every server alike: llama-server closes idle keep-alive
    # connections, and a request sent on one it had closed failed ("Server disconnected without
    # sending a response"), which turned its first (cold) TTFT into a warm one
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers, limits=limits) as client:
        try:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"cannot list models at {url}/v1/models: {e}") from None
        for job in [j for j in jobs if j.warmup]:  # before the counters: not measured
            await _request(client, url, model, job.prompt, job.max_tokens or max_tokens)
        jobs = [j for j in jobs if not j.warmup]
        before = await _metrics(client, url)
        total = len(jobs) * (turns or 1)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"{workload} @ {url}", file=sys.stderr, leave=False)
        sem = asyncio.Semaphore(concurrency)
        results: list[Result] = []

        async def one(prompt: str, n: int | None = None) -> Result:
            async with sem:
                r = await _request(client, url, model, prompt, n or max_tokens)
            results.append(r)
            if bar is not None:
                bar.update(1)
            return r

        async def conversation(job: Job) -> None:
            history = job.prompt
            rng = random.Random(seed * 1000 + (job.conversation or 0))
            for _ in range(turns):
                r = await one(history + "\nAssistant:")
                history += f"\nAssistant:{r.text}\nUser: {words(rng, max(1, round(40 * scale)))}"

        t0 = time.perf_counter()
        if turns:
            await asyncio.gather(*(conversation(j) for j in jobs))
        elif concurrency == 1:  # one at a time, in order (ttft: the cold request first, then warm ones)
            for job in jobs:
                await one(job.prompt, job.max_tokens)
        else:
            await asyncio.gather(*(one(j.prompt, j.max_tokens) for j in jobs))
        wall = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        after = await _metrics(client, url)
    return summarise(workload, url, model, results, wall, before, after, _rss_peak(pid), concurrency)


def summarise(workload: str, url: str, model: str, results: list[Result], wall: float, before, after,
              rss: int | None, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    # a stream's decode rate: the tokens after its first over the time after its first
    streams = [(r.output_tokens - 1) / (r.end - r.start - r.ttft) for r in ok
               if r.ttft is not None and r.output_tokens > 1 and r.end > r.start + r.ttft]
    out_tokens = sum(r.output_tokens for r in ok)
    hit_rate, source = None, None
    if before is not None and after is not None and after.prefix_queries > before.prefix_queries:
        hit_rate = (after.prefix_hits - before.prefix_hits) / (after.prefix_queries - before.prefix_queries)
        source = "metrics"
    elif ok and all(r.cached_tokens is not None and r.prompt_tokens for r in ok):
        hit_rate = sum(r.cached_tokens or 0 for r in ok) / sum(r.prompt_tokens or 0 for r in ok)
        source = "usage"

    def p(v: list[float], q: float) -> float | None:
        return percentile(v, q) if v else None

    return {
        "workload": workload, "url": url, "model": model, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3], "concurrency": concurrency,
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall else None,
        "output_tokens_per_s": out_tokens / wall if wall else None, "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok) or None,
        "ttft_s": {"p50": p(ttfts, 50), "p95": p(ttfts, 95),
                   "first": ok[0].ttft if ok and workload == "ttft" else None,
                   "warm_median": statistics.median(ttfts[1:]) if workload == "ttft" and len(ttfts) > 1 else None},
        "itl_s": {"p50": p(itls, 50), "p95": p(itls, 95)},
        "stream_tokens_per_s_median": statistics.median(streams) if streams else None,
        "prefix_cache_hit_rate": hit_rate, "hit_rate_source": source, "server_peak_rss_bytes": rss,
    }


ROWS = [("requests", lambda r: f"{r['requests']} ({r['failed']} failed)"),
        ("wall time", lambda r: f"{r['wall_s']:.2f} s"),
        ("requests/s", lambda r: f"{r['requests_per_s']:.2f}"),
        ("output tokens/s", lambda r: f"{r['output_tokens_per_s']:.1f}"),
        ("TTFT p50 / p95", lambda r: _pair(r["ttft_s"]["p50"], r["ttft_s"]["p95"])),
        ("ITL p50 / p95", lambda r: _pair(r["itl_s"]["p50"], r["itl_s"]["p95"])),
        ("tokens/s of a stream (median)", lambda r: "-" if r.get("stream_tokens_per_s_median") is None
         else f"{r['stream_tokens_per_s_median']:.1f}"),
        ("prefix-cache hit rate", lambda r: "-" if r["prefix_cache_hit_rate"] is None
         else f"{100 * r['prefix_cache_hit_rate']:.1f} % ({r['hit_rate_source']})"),
        ("server peak RSS", lambda r: "-" if r["server_peak_rss_bytes"] is None
         else f"{r['server_peak_rss_bytes'] / 2**20:.0f} MiB")]


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None else f"{1000 * a:.0f} / {1000 * (b or 0):.0f} ms"


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """B relative to A: throughput as B / A (higher is better for B), latencies as A / B (ditto)."""
    def div(x, y):
        return x / y if x is not None and y else None
    return {"output_tokens_per_s": div(b["output_tokens_per_s"], a["output_tokens_per_s"]),
            "requests_per_s": div(b["requests_per_s"], a["requests_per_s"]),
            "ttft_p50_speedup": div(a["ttft_s"]["p50"], b["ttft_s"]["p50"]),
            "itl_p50_speedup": div(a["itl_s"]["p50"], b["itl_s"]["p50"])}


def render(results: list[dict[str, Any]], ratio: dict[str, Any] | None = None) -> str:
    head = ["", *(r["url"] for r in results)]
    rows = [[label, *(fn(r) for r in results)] for label, fn in ROWS]
    if results[0]["workload"] == "ttft":
        rows.insert(4, ["TTFT cold / warm median", *(_pair(r["ttft_s"]["first"], r["ttft_s"]["warm_median"])
                                                     for r in results)])
    if ratio:
        rows.append(["B vs A (tokens/s, TTFT)", "", f"{ratio['output_tokens_per_s']:.2f}x, "
                     f"{ratio['ttft_p50_speedup']:.2f}x" if ratio["ttft_p50_speedup"] else "-"])
    w = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    lines = [f"workload {results[0]['workload']} ({results[0]['model']})",
             "  ".join(str(h).ljust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(row)) for row in rows]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="shared-prefix workloads against any OpenAI-compatible server",
                       description="Run the workloads of docs/benchmarks.md (ttft, tenants, rag, chat, unique), a "
                                   "single-stream decode one (decode) and 8 concurrent requests on a warm "
                                   "shared prefix (shared) against a server.")
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", action="append", choices=WORKLOADS, help="repeatable (default: all)")
    p.add_argument("--compare", default=None, metavar="URL2", help="run the same workload against URL2 too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="shrink request counts and prompt lengths")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--pid", type=int, default=None, help="server process id, for its peak RSS")
    p.add_argument("--pid2", type=int, default=None, help="the --compare server's process id")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key of the server (a hotprefix --api-key, a gateway key; env OPENAI_API_KEY)")
    p.add_argument("--compare-api-key", default=None, help="bearer key of the --compare server (default: --api-key)")
    p.add_argument("--json", default=None, help="write all results as JSON to this file")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    out = []
    progress = sys.stderr.isatty()
    for w in a.workload or WORKLOADS:
        res = [asyncio.run(run_workload(a.url, w, a.seed, a.scale, a.max_tokens, a.pid, progress, a.api_key))]
        if a.compare:
            res.append(asyncio.run(run_workload(a.compare, w, a.seed, a.scale, a.max_tokens, a.pid2, progress,
                                                a.compare_api_key or a.api_key)))
        ratio = ratios(res[0], res[1]) if a.compare else None
        print(render(res, ratio) + "\n")
        out.append({"workload": w, "results": res, "ratios": ratio})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0

