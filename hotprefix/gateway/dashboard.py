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
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse

from hotprefix.gateway.budgets import Ledger, Scope
from hotprefix.gateway.monitor import BackendMonitor
from hotprefix.gateway.routing import route_key
from hotprefix.gateway.store import Store, UsageStatus, utcnow

ERRORS = {UsageStatus.ERROR.value, UsageStatus.BACKEND_ERROR.value, UsageStatus.TIMEOUT.value,
          UsageStatus.INVALID.value, UsageStatus.INTERRUPTED.value}
COUNTS = ("requests", "ok", "rate_limited", "errors", "prompt_tokens", "cached_tokens", "completion_tokens")


def _add(acc: dict[str, int], row: dict[str, Any]) -> None:
    """Add one grouped usage row to a tally of COUNTS. Mutates acc."""
    n, status = row["requests"], row["status"]
    acc["requests"] += n
    acc["ok"] += n if status == UsageStatus.OK.value else 0
    acc["rate_limited"] += n if status == UsageStatus.RATE_LIMITED.value else 0
    acc["errors"] += n if status in ERRORS else 0
    for k in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        acc[k] += row[k]


def _tally() -> dict[str, int]:
    return dict.fromkeys(COUNTS, 0)


def _with_share(t: dict[str, int]) -> dict[str, Any]:
    return {**t, "cached_share": t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else None}


def activity(store: Store, monitor: BackendMonitor, minutes: float, bucket_s: int) -> dict[str, Any]:
    """The dashboard's JSON (blocking: run it off the event loop)."""
    now = utcnow()
    rows = store.usage_activity(now - dt.timedelta(minutes=minutes), bucket_s)
    per_key: dict[tuple[str, str], dict[str, int]] = defaultdict(_tally)
    per_tenant: dict[str, dict[str, int]] = defaultdict(_tally)
    for r in rows["totals"]:
        _add(per_key[(r["tenant"], r["key_id"])], r)
        _add(per_tenant[r["tenant"]], r)
    series: dict[tuple[str, int], dict[str, int]] = defaultdict(_tally)
    key_series: dict[tuple[str, int], dict[str, int]] = defaultdict(_tally)
    for r in rows["series"]:
        _add(series[(r["tenant"], r["bucket"])], r)
        _add(key_series[(r["key_id"], r["bucket"])], r)
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
                 **_with_share(per_key.get((t.name, k.id), _tally()))} for k in records]
        scopes += [Scope(f"key:{k.id}", k.budget) for k in records] + [Scope(f"tenant:{t.name}", t.budget)]
        tenants.append({"name": t.name, "prompt": t.prompt_name, "home_backend": home, "scope": f"tenant:{t.name}",
                        **_with_share(per_tenant.get(t.name, _tally())), "keys": keys})
    return {
        "time": now.isoformat() + "Z", "minutes": minutes, "bucket_s": bucket_s, "tenants": tenants,
        "scopes": scopes,
        "series": [{"tenant": tenant, "t": b, **_with_share(v)} for (tenant, b), v in sorted(series.items(),
                                                                                          key=lambda kv: kv[0][1])],
        "key_series": [{"key": k, "t": b, **_with_share(v)} for (k, b), v in sorted(key_series.items(),
                                                                                 key=lambda kv: kv[0][1])],
        "backends": [{"url": b.url, "healthy": b.healthy, "kind": b.kind.value, "model": b.model,
                      "inflight": b.inflight, "last_error": b.last_error, "home_of": sorted(homes.get(b.url, []))}
                     for b in monitor.router.backends],
    }


def page() -> str:
    return resources.files("hotprefix.gateway").joinpath("static/dashboard.html").read_text()


def dashboard_routes(store: Store, monitor: BackendMonitor, ledger: Ledger) -> tuple[APIRouter, APIRouter]:
    """(the open router with /dashboard, the admin router's /dashboard: mounted under /admin)."""
    open_api, admin_api = APIRouter(), APIRouter()
    html = page()

    @open_api.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(html)

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
