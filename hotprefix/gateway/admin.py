"""The admin API under /admin (the admin key is checked by middleware.OperatorGuard
before any body is read): tenants and the prompt pool, keys, usage, backends."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from hotprefix.gateway.budgets import PriceTable, Scope
from hotprefix.gateway.errors import GatewayError
from hotprefix.gateway.monitor import BackendMonitor
from hotprefix.gateway.proxy import Proxy
from hotprefix.gateway.store import MAX_GRACE_S, USAGE_GROUPS, Store, check_budget

MAX_EXPIRES_S = 10 * 365 * 86400.0  # a new key's lifetime: at most ten years


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BudgetFields(Strict):
    """A budget (gateway/budgets.py); every field None: no cap."""

    max_budget_tokens: int | None = Field(None, ge=1, le=2**62)
    max_budget: float | None = Field(None, gt=0, lt=1e12)
    budget_duration: str | None = Field(None, max_length=16)

    def has_budget(self) -> bool:
        return any(v is not None for v in (self.max_budget_tokens, self.max_budget, self.budget_duration))


class KeyBudget(BudgetFields):
    models: list[str] | None = Field(None, max_length=100)


class NewTenant(BudgetFields):
    name: str
    prompt: str | None = None


class TenantUpdate(Strict):
    prompt: str | None


class NewPrompt(Strict):
    name: str
    text: str
    public: bool = False


class NewKey(KeyBudget):
    tenant: str
    name: str | None = None
    expires_in_s: float | None = Field(None, gt=0, le=MAX_EXPIRES_S)
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


class Rotation(Strict):
    grace_s: float = Field(0.0, ge=0, le=MAX_GRACE_S)


def _run(fn, *args, **kw):
    """A blocking store call, off the event loop."""
    return asyncio.to_thread(fn, *args, **kw)


def tenant_routes(api: APIRouter, store: Store, proxy: Proxy) -> None:
    """/admin/tenants and /admin/prompts (a change clears the key cache: it takes effect at once)."""

    @api.get("/tenants")
    async def tenants() -> dict[str, Any]:
        return {"data": [t.__dict__ for t in await _run(store.list_tenants)]}

    @api.post("/tenants", status_code=201)
    async def create_tenant(body: NewTenant) -> dict[str, Any]:
        if body.has_budget():  # checked before anything is written
            check_budget(body.max_budget_tokens, body.max_budget, body.budget_duration)
        t = await _run(store.create_tenant, body.name, body.prompt)
        if body.has_budget():
            await _run(store.set_budget, tenant=t.name, tokens=body.max_budget_tokens, money=body.max_budget,
                       duration=body.budget_duration)
        return (await _run(store.tenant, t.name)).__dict__

    @api.put("/tenants/{name}/budget")
    async def tenant_budget(name: str, body: BudgetFields) -> dict[str, Any]:
        await _run(store.set_budget, tenant=name, tokens=body.max_budget_tokens, money=body.max_budget,
                   duration=body.budget_duration)
        proxy.auth_cache.clear()
        return (await _run(store.tenant, name)).__dict__

    @api.patch("/tenants/{name}")
    async def update_tenant(name: str, body: TenantUpdate) -> dict[str, Any]:
        t = await _run(store.set_tenant_prompt, name, body.prompt)
        proxy.auth_cache.clear()
        return t.__dict__

    @api.get("/prompts")
    async def prompts() -> dict[str, Any]:
        return {"data": await _run(store.list_prompts)}

    @api.post("/prompts", status_code=201)
    async def add_prompt(body: NewPrompt) -> dict[str, Any]:
        p = await _run(store.add_prompt, body.name, body.text, body.public)
        proxy.auth_cache.clear()
        return {"name": p.name, "version": p.version, "public": p.public}


def key_routes(api: APIRouter, store: Store, secret: bytes, proxy: Proxy) -> None:
    """/admin/keys: list, create (the key is in the answer, once), revoke, rotate."""

    @api.get("/keys")
    async def list_keys(tenant: str | None = None) -> dict[str, Any]:
        return {"data": [k.public() for k in await _run(store.list_keys, tenant)]}

    @api.post("/keys", status_code=201)
    async def create_key(body: NewKey) -> dict[str, Any]:
        expires = None if body.expires_in_s is None else (
            dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) + dt.timedelta(seconds=body.expires_in_s))
        if body.has_budget():  # checked before anything is written
            check_budget(body.max_budget_tokens, body.max_budget, body.budget_duration)
        key, rec = await _run(store.create_key, secret, body.tenant, body.name, expires, body.rpm, body.tpm,
                              body.max_concurrent)
        if body.has_budget() or body.models is not None:
            await _run(store.set_budget, key_id=rec.id, tokens=body.max_budget_tokens, money=body.max_budget,
                       duration=body.budget_duration, models=body.models)
            rec = await _run(store.key, rec.id)
        return {"key": key, **rec.public()}

    @api.put("/keys/{key_id}/budget")
    async def key_budget(key_id: str, body: KeyBudget) -> dict[str, Any]:
        await _run(store.set_budget, key_id=key_id, tokens=body.max_budget_tokens, money=body.max_budget,
                   duration=body.budget_duration, models=body.models)
        proxy.auth_cache.clear()
        return (await _run(store.key, key_id)).public()

    @api.get("/budgets")
    async def budgets(tenant: str | None = None) -> dict[str, Any]:
        """What each budgeted key and tenant spent in its current period, and its caps."""
        scopes = [Scope(f"tenant:{t.name}", t.budget) for t in await _run(store.list_tenants)
                  if tenant in (None, t.name)]
        scopes += [Scope(f"key:{k.id}", k.budget) for k in await _run(store.list_keys, tenant)]
        return {"data": [{"scope": name, **v} for name, v in (await proxy.acct.ledger.spent(scopes)).items()]}

    @api.post("/keys/{key_id}/revoke")
    async def revoke(key_id: str) -> dict[str, Any]:
        rec = await _run(store.revoke_key, key_id)
        proxy.auth_cache.clear()
        return rec.public()

    @api.post("/keys/{key_id}/rotate")
    async def rotate(key_id: str, body: Rotation | None = None) -> dict[str, Any]:
        key, rec = await _run(store.rotate_key, secret, key_id, (body or Rotation()).grace_s)
        proxy.auth_cache.clear()
        return {"key": key, **rec.public()}


def operations_routes(api: APIRouter, store: Store, monitor: BackendMonitor, prices: PriceTable) -> None:
    """/admin/usage, /admin/backends, /admin/warmup."""

    @api.get("/usage")
    async def usage(group_by: str = "tenant", since: str | None = None, until: str | None = None) -> dict[str, Any]:
        if group_by not in USAGE_GROUPS:
            raise GatewayError(400, f"group_by must be one of {', '.join(USAGE_GROUPS)}", "BadRequestError",
                               "group_by")
        try:
            s = None if since is None else dt.datetime.fromisoformat(since)
            u = None if until is None else dt.datetime.fromisoformat(until)
        except ValueError as e:
            raise GatewayError(400, f"since/until must be ISO dates: {e}", "BadRequestError", "since") from None
        priced = bool(prices.prices)
        rows = await _run(store.usage_report, group_by, s, u, prices if priced else None)
        return {"group_by": group_by, "data": [r.to_json(group_by, priced) for r in rows]}

    @api.get("/backends")
    async def backends() -> dict[str, Any]:
        return {"data": [{"url": b.url, "healthy": b.healthy, "kind": b.kind.value, "model": b.model,
                          "inflight": b.inflight, "last_error": b.last_error} for b in monitor.router.backends]}

    @api.post("/warmup")
    async def warmup() -> dict[str, Any]:
        up = [b for b in monitor.router.backends if b.healthy]
        await asyncio.gather(*(monitor.warm(b) for b in up))
        return {"warmed_backends": [b.url for b in up]}


def admin_router(store: Store, secret: bytes, proxy: Proxy, monitor: BackendMonitor) -> APIRouter:
    api = APIRouter(prefix="/admin")
    tenant_routes(api, store, proxy)
    key_routes(api, store, secret, proxy)
    operations_routes(api, store, monitor, proxy.cfg.prices)
    return api
