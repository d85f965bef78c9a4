"""`hotprefix watch URL`: poll /metrics and summarise KV usage and prefix-cache hits.

Reads hotprefix's metric names and vLLM's (`vllm:`), so it watches either.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hotprefix import metric_names as N
from hotprefix.config import ConfigError
from hotprefix.tools.logs import percentile


@dataclass
class Sample:
    t: float
    kv_usage: float
    running: float
    waiting: float
    preemptions: float
    prefix_queries: float
    prefix_hits: float


def parse_metrics(text: str) -> Sample:
    """One sample from a Prometheus text page (values summed over label sets).
    Raises ConfigError when the page has none of the known names."""
    vals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for prefix in N.PEER_PREFIXES:
                if s.name.startswith(prefix):
                    key = s.name[len(prefix):].removesuffix("_total")
                    vals[key] = vals.get(key, 0.0) + s.value
    if N.RUNNING not in vals:
        raise ConfigError("no hotprefix: or vllm: metrics on that page")
    return Sample(time.monotonic(), vals.get(N.KV_USAGE, vals.get(N.KV_USAGE_LEGACY, 0.0)), vals.get(N.RUNNING, 0.0),
                  vals.get(N.WAITING, 0.0), vals.get(N.PREEMPTIONS, 0.0), vals.get(N.PREFIX_QUERIES, 0.0),
                  vals.get(N.PREFIX_HITS, 0.0))


def summarise(samples: list[Sample]) -> dict[str, Any]:
    """KV usage mean/p95/max, the hit rate over the window (tokens), running and
    waiting, and preemptions during the window."""
    first, last = samples[0], samples[-1]
    kv = [s.kv_usage for s in samples]
    dq, dh = last.prefix_queries - first.prefix_queries, last.prefix_hits - first.prefix_hits
    pct95 = percentile(kv, 95)
    return {
        "samples": len(samples), "window_s": round(last.t - first.t, 3),
        "kv_usage": {"mean": statistics.fmean(kv), "p95": pct95, "max": max(kv)},
        "prefix_cache_hit_rate": dh / dq if dq else None, "prefix_cache_queries": dq, "prefix_cache_hits": dh,
        "running": {"mean": statistics.fmean(s.running for s in samples), "max": max(s.running for s in samples)},
        "waiting": {"mean": statistics.fmean(s.waiting for s in samples), "max": max(s.waiting for s in samples)},
        "preemptions": last.preemptions - first.preemptions,
    }


def line(s: Sample, first: Sample) -> str:
    dq, dh = s.prefix_queries - first.prefix_queries, s.prefix_hits - first.prefix_hits
    rate = f"{100 * dh / dq:5.1f}%" if dq else "    -"
    bar = "#" * round(20 * s.kv_usage)
    return (f"KV [{bar:<20}] {100 * s.kv_usage:5.1f}%  hit rate {rate}  running {s.running:3.0f}  "
            f"waiting {s.waiting:3.0f}  preemptions {s.preemptions - first.preemptions:.0f}")


def watch(url: str, interval: float, duration: float | None, count: int | None, live: bool,
          stop: threading.Event | None = None) -> dict[str, Any]:
    """Poll until duration seconds, count samples, the stop event (when embedded) or
    Ctrl-C; return the summary."""
    metrics_url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/metrics") else "/metrics")
    samples: list[Sample] = []
    end = None if duration is None else time.monotonic() + duration
    try:
        with httpx.Client(timeout=10) as client:
            while True:
                try:
                    r = client.get(metrics_url)
                    r.raise_for_status()
                except httpx.HTTPError as e:
                    raise ConfigError(f"cannot read {metrics_url}: {e}") from None
                samples.append(parse_metrics(r.text))
                if live:
                    print("\r" + line(samples[-1], samples[0]), end="", file=sys.stderr, flush=True)
                if ((count is not None and len(samples) >= count) or (end is not None and time.monotonic() >= end)
                        or (stop is not None and stop.is_set())):
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if live:
        print(file=sys.stderr)
    if not samples:
        raise ConfigError("no sample taken")
    return summarise(samples) | {"url": metrics_url, "last": asdict(samples[-1])}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("watch", help="poll a server's /metrics: KV usage, prefix-cache hit rate, queue",
                       description="Poll /metrics of a hotprefix or vLLM server; a live line, then a JSON summary.")
    p.add_argument("url", help="the server's base URL (or its /metrics URL)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: Ctrl-C)")
    p.add_argument("--count", type=int, default=None, help="stop after this many samples")
    p.add_argument("--quiet", action="store_true", help="no live line, only the summary")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    summary = watch(a.url, a.interval, a.duration, a.count, live=not a.quiet and sys.stderr.isatty())
    print(json.dumps(summary, indent=2))
    return 0

