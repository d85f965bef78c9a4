"""The gateway's dashboard: GET /dashboard (one static page; it holds no data and asks for
the admin key) and GET /admin/dashboard (its JSON, behind the admin key).

Per tenant and per key over a window: requests, tokens, cached share, 429s and errors,
from the usage rows (the same rows /admin/usage reports); the same per time bucket for
the charts; each budget's spend in its current period; the backends with their health
and the tenants whose prefixes they are home to (rendezvous routing: a tenant's prompt
always ranks the backends the same way).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse

from hotprefix.gateway.budgets import Ledger, Scope
from hotprefix.gateway.monitor import BackendMonitor
from hotprefix.gateway.routing import route_key
from hotprefix.gateway.store import ActivityRow, Store, UsageStatus, utcnow
from hotprefix.server.static_page import StaticPage

ERRORS = {UsageStatus.ERROR, UsageStatus.BACKEND_ERROR, UsageStatus.TIMEOUT, UsageStatus.INVALID,
          UsageStatus.INTERRUPTED}


@dataclass
class Tally:
    """Usage rows counted: requests, answered, refused by a limit, failed; token sums."""

    requests: int = 0
    ok: int = 0
    rate_limited: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, row: ActivityRow) -> None:
        """Count one grouped usage row. Mutates the tally."""
        n = row.requests
        self.requests += n
        self.ok += n if row.status is UsageStatus.OK else 0
        self.rate_limited += n if row.status is UsageStatus.RATE_LIMITED else 0
        self.errors += n if row.status in ERRORS else 0
        self.prompt_tokens += row.prompt_tokens
        self.cached_tokens += row.cached_tokens
        self.completion_tokens += row.completion_tokens

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cached_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens
                else None}


def activity(store: Store, monitor: BackendMonitor, minutes: float, bucket_s: int) -> dict[str, Any]:
    """The dashboard's JSON (blocking: run it off the event loop)."""
    now = utcnow()
    rows = store.usage_activity(now - dt.timedelta(minutes=minutes), bucket_s)
    per_key: dict[tuple[str, str], Tally] = defaultdict(Tally)
    per_tenant: dict[str, Tally] = defaultdict(Tally)
    for r in rows.totals:
        per_key[(r.tenant, r.key_id)].add(r)
        per_tenant[r.tenant].add(r)
    series: dict[tuple[str, int | None], Tally] = defaultdict(Tally)
    key_series: dict[tuple[str, int | None], Tally] = defaultdict(Tally)
    for r in rows.series:
        series[(r.tenant, r.bucket)].add(r)
        key_series[(r.key_id, r.bucket)].add(r)
    homes: dict[str, list[str]] = defaultdict(list)
    tenants: list[dict[str, Any]] = []
    scopes: list[Scope] = []
    for t in store.list_tenants():
        prompt = store.tenant_prompt(t)
        ranked = monitor.router.ranking(route_key(prompt.text if prompt else None, bool(prompt and prompt.public),
                                                  t.name), healthy_only=False)
        home = ranked[0].url if ranked else None
        if home:
            homes[home].append(t.name)
        records = store.list_keys(t.name)
        keys = [{"id": k.id, "name": k.name, "hint": k.hint, "active": k.active(now), "scope": f"key:{k.id}",
                 **per_key.get((t.name, k.id), Tally()).to_json()} for k in records]
        scopes += [Scope(f"key:{k.id}", k.budget) for k in records] + [Scope(f"tenant:{t.name}", t.budget)]
        tenants.append({"name": t.name, "prompt": t.prompt_name, "home_backend": home, "scope": f"tenant:{t.name}",
                        **per_tenant.get(t.name, Tally()).to_json(), "keys": keys})
    return {
        "time": now.isoformat() + "Z", "minutes": minutes, "bucket_s": bucket_s, "tenants": tenants,
        "scopes": scopes,
        "series": [{"tenant": tenant, "t": b, **v.to_json()} for (tenant, b), v in sorted(series.items(),
                                                                                          key=lambda kv: kv[0][1])],
        "key_series": [{"key": k, "t": b, **v.to_json()} for (k, b), v in sorted(key_series.items(),
                                                                                 key=lambda kv: kv[0][1])],
        "backends": [{"url": b.url, "healthy": b.healthy, "kind": b.kind.value, "model": b.model,
                      "inflight": b.inflight, "last_error": b.last_error, "home_of": sorted(homes.get(b.url, []))}
                     for b in monitor.router.backends],
    }


def dashboard_routes(store: Store, monitor: BackendMonitor, ledger: Ledger) -> tuple[APIRouter, APIRouter]:
    """(the open router with /dashboard, the admin router's /dashboard: mounted under /admin)."""
    open_api, admin_api = APIRouter(), APIRouter()
    page = StaticPage.load("hotprefix.gateway", "dashboard.html")

    @open_api.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return page.response()

    @admin_api.get("/dashboard")
    async def data(minutes: float = Query(60, gt=0, le=31 * 1440),
                   bucket_s: int = Query(60, ge=10, le=86400)) -> dict[str, Any]:
        if minutes * 60 / bucket_s > 10_000:
            bucket_s = int(minutes * 60 / 10_000) + 1  # at most 10,000 buckets per tenant
        out = await asyncio.to_thread(activity, store, monitor, minutes, bucket_s)
        spent = await ledger.spent(out.pop("scopes"))  # each budget's current period, as admission counts it
        for t in out["tenants"]:
            for row in (t, *t["keys"]):
                row["budget"] = spent.get(row.pop("scope"))
        return out

    return open_api, admin_api
