"""The periodic stats line, as vLLM logs it: throughput, queue, KV usage, prefix hit rate."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hotprefix.engine.async_engine import AsyncEngine

log = logging.getLogger("hotprefix.stats")


@dataclass
class _Seen:
    at: float
    prefill: int = 0
    decode: int = 0
    queries: int = 0
    hits: int = 0


class StatsLogger:
    """Every `interval` seconds, one line while the engine is busy (or was since the
    last line); nothing while it is idle. Reads the engine's counters and its live
    stats (both kept by the engine thread)."""

    def __init__(self, engine: AsyncEngine, interval: float = 10.0) -> None:
        self.engine = engine
        self.interval = interval
        self._seen = _Seen(time.monotonic())

    def line(self) -> str | None:
        """The line for the time since the last one, or None if nothing happened."""
        c, live = self.engine.counters, self.engine.live
        now = time.monotonic()
        s = self._seen
        prefill, decode = c.prefill_tokens - s.prefill, c.decode_tokens - s.decode
        queries, hits = c.prefix_cache_queries - s.queries, c.prefix_cache_hits - s.hits
        self._seen = _Seen(now, c.prefill_tokens, c.decode_tokens, c.prefix_cache_queries, c.prefix_cache_hits)
        running, waiting = live.running, live.waiting
        if not (prefill or decode or running or waiting):
            return None
        dt = max(now - s.at, 1e-9)
        return (f"Avg prompt throughput: {prefill / dt:.1f} tokens/s, Avg generation throughput: "
                f"{decode / dt:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * live.kv_usage:.1f}%, Prefix cache hit rate: "
                f"{100 * hits / queries if queries else 0.0:.1f}%")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text:
                log.info(text)
