"""The periodic stats line, as vLLM logs it: throughput, queue, KV usage, prefix hit rate."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hotprefix.engine.async_engine import AsyncEngine

log = logging.getLogger("hotprefix.stats")


SOURCES = ("device", "host", "disk")


@dataclass(frozen=True)
class Sample:
    """The engine's cumulative counters and its gauges at one moment (unix time `t`,
    monotonic `mono`): what the stats line and the dashboard compute their rates from."""

    t: float
    mono: float
    queries: int = 0
    hits: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    prefill: int = 0
    decode: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @classmethod
    def take(cls, engine: AsyncEngine) -> Sample:
        c, live = engine.counters, engine.live
        return cls(time.time(), time.monotonic(), c.prefix_cache_queries, c.prefix_cache_hits,
                   dict(c.cached_tokens_by_source), c.prefill_tokens, c.decode_tokens, live.running, live.waiting,
                   live.kv_usage)


def rates(a: Sample, b: Sample) -> dict[str, Any]:
    """Between two samples: prefix-cache queries and hits, the token-weighted hit rate (and
    by source; None without queries), and prompt and generation tokens per second."""
    q = b.queries - a.queries
    dt = max(b.mono - a.mono, 1e-9)
    return {"queries": q, "hits": b.hits - a.hits, "hit_rate": (b.hits - a.hits) / q if q else None,
            "hit_rate_by_source": {s: (b.by_source.get(s, 0) - a.by_source.get(s, 0)) / q if q else None
                                   for s in SOURCES},
            "prompt_tps": (b.prefill - a.prefill) / dt, "generation_tps": (b.decode - a.decode) / dt}


class StatsLogger:
    """Every `interval` seconds, one line while the engine is busy (or was since the
    last line); nothing while it is idle. Reads the engine's counters and its live
    stats (both kept by the engine thread)."""

    def __init__(self, engine: AsyncEngine, interval: float = 10.0) -> None:
        self.engine = engine
        self.interval = interval
        self._seen = Sample(time.time(), time.monotonic())  # counters from zero: the first line covers the start

    def line(self) -> str | None:
        """The line for the time since the last one, or None if nothing happened."""
        now = Sample.take(self.engine)
        r, self._seen = rates(self._seen, now), now
        if not (r["prompt_tps"] or r["generation_tps"] or now.running or now.waiting):
            return None
        return (f"Avg prompt throughput: {r['prompt_tps']:.1f} tokens/s, Avg generation throughput: "
                f"{r['generation_tps']:.1f} tokens/s, Running: {now.running} reqs, Waiting: {now.waiting} reqs, "
                f"KV cache usage: {100 * now.kv_usage:.1f}%, Prefix cache hit rate: "
                f"{100 * (r['hit_rate'] or 0.0):.1f}%")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text:
                log.info(text)
