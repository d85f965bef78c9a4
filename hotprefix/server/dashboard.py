"""The built-in dashboard: GET /dashboard (one static page from the package: no build step,
no CDN, works offline) and GET /dashboard/data (the JSON it draws, behind --admin-api-key, else --api-key). The page
is sent with a Content-Security-Policy (server/static_page.py).

The numbers are the ones /metrics exports: the engine's counters (prefix-cache queries
and hits, cached tokens by source, tokens computed) and the handlers' counters, sampled
every `interval` seconds into a series over the last `window` seconds; latency
percentiles are exact over the window (ServerMetrics keeps the latest observations);
the top cached prefixes come from the prefix groups (server/prefix_log.py), with pins
marked; their text only when the operator logs prompts (--request-log-prompts).

The hit-rate curve (hotprefix/cachecurve: the hit rate this traffic would get at every
pool size, and with the host tier at the server's) is the recent prompts' (the
recorder's RecentPrompts, bounded by block digests), recomputed in a thread when the
page asks for it, at most every `curve_every` seconds and only when prompts finished
since; the server's pool is marked on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse

from hotprefix.cachecurve.advice import advise, to_json
from hotprefix.cachecurve.curve import Options, build
from hotprefix.cachecurve.request import SimRequest
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.prefix_log import PrefixRecorder
from hotprefix.server.request_log import KVShape, PrefixEntry
from hotprefix.server.static_page import StaticPage
from hotprefix.server.stats_log import Sample, rates

log = logging.getLogger(__name__)


@dataclass
class Dashboard:
    """The series and the page's JSON. Lives on the event loop; `run` samples until cancelled."""

    engine: AsyncEngine
    metrics: ServerMetrics
    prefix: PrefixRecorder | None
    limits: dict[str, Any]
    interval: float = 5.0
    window: float = 900.0
    curve_every: float = 30.0
    samples: deque[Sample] = field(default_factory=deque)
    curve: dict[str, Any] | None = None
    _curve_seen: int = 0  # RecentPrompts.added when the curve was computed
    _curve_at: float = -float("inf")
    _curve_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def sample(self, keep: bool = True) -> Sample:
        """Take one sample and return it; a kept one stays while it is inside the window (only
        the sampler keeps them, so a client polling /dashboard/data cannot grow the series)."""
        s = Sample.take(self.engine)
        if keep:
            self.samples.append(s)
            while len(self.samples) > 2 and self.samples[1].mono < s.mono - self.window:
                self.samples.popleft()
        return s

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    async def data(self, minutes: float | None = None) -> dict[str, Any]:
        """Everything the page shows, now (a fresh sample, not kept, closes the series)."""
        now = self.sample(keep=False)
        span = min(self.window, 60 * minutes) if minutes else self.window
        pts = [s for s in self.samples if s.mono >= now.mono - span - 1e-9]
        if len(pts) > 1 and now.mono - pts[-1].mono < self.interval / 2:
            pts[-1] = now  # a point a moment after the last would be a rate over a moment: a spike
        else:
            pts.append(now)
        base = pts[0]
        (ttft50, ttft95), n_ttft = self.metrics.recent_ttft.percentiles(base.mono)
        (itl50, itl95), n_itl = self.metrics.recent_itl.percentiles(base.mono)
        pins = await self.engine.call(lambda e: e.pin_summary())
        live = self.engine.live
        await self.refresh_curve()
        return {
            "time": now.t, "model": self.metrics.model_name, "limits": self.limits,
            "window": {"seconds": now.mono - base.mono, **rates(base, now),
                       "ttft_p50": ttft50, "ttft_p95": ttft95, "ttft_count": n_ttft,
                       "itl_p50": itl50, "itl_p95": itl95, "itl_count": n_itl},
            "series": [{"t": b.t, **rates(a, b), "running": b.running, "waiting": b.waiting, "kv_usage": b.kv_usage}
                       for a, b in zip(pts, pts[1:])],
            "now": {"running": live.running, "waiting": live.waiting, "swapped": live.swapped,
                    "preemptions": live.preemptions, "kv_usage": live.kv_usage,
                    "pinned_blocks": pins.pinned_blocks, "max_pinned_blocks": pins.max_pinned_blocks,
                    "cached_blocks": pins.cached_blocks, "num_blocks": pins.num_blocks,
                    "pinned_share": pins.pinned_blocks / pins.num_blocks,
                    "tiers": _tiers(live.tiers)},
            "totals": self._totals(now),
            "top_prefixes": self._top(pins.first_blocks),
            "curve": self.curve,
        }

    async def refresh_curve(self) -> None:
        """Recompute the curve (in a thread) if prompts finished since and it is older than
        curve_every seconds. Mutates self.curve."""
        if self.prefix is None:
            return
        async with self._curve_lock:
            recent = self.prefix.recent
            if recent.added == self._curve_seen or time.monotonic() - self._curve_at < self.curve_every:
                return
            self._curve_seen, self._curve_at = recent.added, time.monotonic()
            try:
                self.curve = await asyncio.to_thread(recent_curve, recent.snapshot(), self.prefix.kv)
            except Exception:  # a bug in the curve must not take the rest of the page down
                log.exception("the dashboard's hit-rate curve failed")
                self.curve = None

    def _totals(self, now: Sample) -> dict[str, Any]:
        """The counters as /metrics exports them (the page's numbers can be checked against it)."""
        m = self.metrics
        return {"prefix_cache_queries": now.queries, "prefix_cache_hits": now.hits,
                "prompt_tokens_cached_by_source": now.by_source,
                "prompt_tokens": m.total(m.prompt_tokens), "generation_tokens": m.total(m.generation_tokens),
                "prompt_tokens_cached": m.total(m.cached_tokens)}

    def _top(self, pinned: tuple[bytes, ...], top: int = 10) -> list[dict[str, Any]]:
        if self.prefix is None:
            return []
        pinned_groups = {self.prefix.key.digest(h) for h in pinned}
        groups = sorted((g for g in self.prefix.groups.snapshot(1000)["groups"] if g["blocks"]),
                        key=lambda g: -g["cached_tokens"])[:top]
        return [{"hash": g["group"], "tokens": g["blocks"] * self.prefix.groups.block_size,
                 "requests": g["requests"], "hit_tokens": g["cached_tokens"], "hit_rate": g["hit_rate"],
                 "last_use": g["last_use"], "pinned": g["group"] in pinned_groups,
                 **({"text": g["text"]} if "text" in g else {})} for g in groups]


def recent_curve(prompts: list[tuple[float, PrefixEntry]], kv: KVShape) -> dict[str, Any]:
    """The curve's JSON of prompts (when each finished, its entry) on the server's cache:
    its pool marked, its host tier (if any) replayed at the pool, no checks (the page is no
    place for them: `hotprefix lint LOG --curve` makes them)."""
    reqs = [SimRequest(e.blocks or (), e.tokens, e.completion or 1) for _, e in prompts]
    span = prompts[-1][0] - prompts[0][0] if len(prompts) > 1 else None
    curve = build(reqs, [e.salt for _, e in prompts], kv.block_size, span,
                  Options(kv.host_blocks, (kv.blocks,), checks=0, host_grid=0))
    return to_json(curve, advise(curve, kv.block_bytes, kv.blocks), kv.block_bytes)


def _tiers(t: Any) -> dict[str, Any]:
    if t is None:
        return {}
    return {"host": {"blocks": t.host_blocks, "capacity": t.host_capacity},
            "disk": {"blocks": t.disk_blocks, "capacity": t.disk_capacity}}


def dashboard_router(dash: Dashboard) -> APIRouter:
    """/dashboard (the page; it holds no data) and /dashboard/data (behind --api-key)."""
    api = APIRouter()
    page = StaticPage.load("hotprefix.server", "dashboard.html")

    @api.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return page.response()

    @api.get("/dashboard/data")
    async def dashboard_data(minutes: float | None = Query(None, gt=0, le=1440)) -> dict[str, Any]:
        return await dash.data(minutes)

    return api
