"""The gateway app: one `build_gateway_app()` factory; state on `app.state`.

Client side: /v1/chat/completions, /v1/completions, /v1/models (a gateway key
in `Authorization: Bearer sk-hp-...`), /health. Operator side: /admin (the admin
key): tenants, the prompt pool, keys, usage, backends, warm-up; /metrics (the
metrics key, else the admin key). Operator keys are checked before any body is
read; every body is bounded and checked (server.body_guard) before a handler.
A background loop health-checks the backends; a backend that comes (back) up
is probed (hotprefix or another OpenAI-compatible server) and warmed. Another
beats for the requests in flight (gateway.usage).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field

import hotprefix
from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.proxy import GatewayError, Proxy
from hotprefix.gateway.ratelimit import Limiter
from hotprefix.gateway.routing import Backend, Router
from hotprefix.gateway.store import MAX_GRACE_S, USAGE_GROUPS, NotFound, Store, StoreError
from hotprefix.gateway.usage import Accounting
from hotprefix.gateway.warmup import warm_backend, warm_items
from hotprefix.server.body_guard import BodyGuard
from hotprefix.server.http_errors import error_response as _error
from hotprefix.server.http_errors import install_common_handlers

MAX_EXPIRES_S = 10 * 365 * 86400.0  # a new key's lifetime: at most ten years

log = logging.getLogger(__name__)


class Counters:
    """The gateway's Prometheus metrics (one registry per app)."""

    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hotprefix_gateway_requests", "Requests that passed authentication, by outcome.",
                                ["tenant", "status"], registry=self.registry)
        self.routes = Counter("hotprefix_gateway_routed", "Requests sent to each backend.", ["backend"],
                              registry=self.registry)
        up = Gauge("hotprefix_gateway_backend_up", "1 when the backend passes its health check.", ["backend"],
                   registry=self.registry)
        inflight = Gauge("hotprefix_gateway_backend_inflight", "Requests in flight to the backend.", ["backend"],
                         registry=self.registry)
        for b in router.backends:
            up.labels(b.url).set_function(lambda b=b: float(b.healthy))
            inflight.labels(b.url).set_function(lambda b=b: float(b.inflight))

    def finished(self, tenant: str, status: str) -> None:
        self.requests.labels(tenant, status).inc()

    def routed(self, backend: str) -> None:
        self.routes.labels(backend).inc()


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewTenant(Strict):
    name: str
    prompt: str | None = None


class TenantUpdate(Strict):
    prompt: str | None


class NewPrompt(Strict):
    name: str
    text: str
    public: bool = False


class NewKey(Strict):
    tenant: str
    name: str | None = None
    expires_in_s: float | None = Field(None, gt=0, le=MAX_EXPIRES_S)
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


class Rotation(Strict):
    grace_s: float = Field(0.0, ge=0, le=MAX_GRACE_S)


async def probe(client: httpx.AsyncClient, backend: Backend, headers: dict[str, str]) -> None:
    """Learn the backend's kind (hotprefix or other), its first model id and context."""
    try:
        v = await client.get(backend.url + "/version", headers=headers, timeout=5)
        backend.kind = "hotprefix" if v.status_code == 200 and v.json().get("server") == "hotprefix" else "openai"
    except (httpx.HTTPError, ValueError, AttributeError):
        backend.kind = "openai"
    try:
        m = (await client.get(backend.url + "/v1/models", headers=headers, timeout=5)).json()["data"][0]
        backend.model = m["id"]
        n = m.get("max_model_len")
        backend.max_model_len = n if isinstance(n, int) and n > 0 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        backend.model = backend.max_model_len = None


class OperatorGuard:
    """ASGI middleware: /admin needs the admin key; /metrics the metrics key (else the
    admin key). Checked before any body is read; a key that is not configured turns
    its endpoints off (403)."""

    def __init__(self, app, admin_key: str | None, metrics_key: str | None) -> None:
        self.app = app
        self.keys = {"/admin": admin_key, "/metrics": metrics_key or admin_key}

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        area = next((a for a in self.keys if path == a or path.startswith(a + "/")), None)
        if area is None:
            await self.app(scope, receive, send)
            return
        key = self.keys[area]
        given = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
        if key is None:
            flag = "--admin-key" if area == "/admin" else "--metrics-key or --admin-key"
            resp = _error(403, f"{area} is off: start the gateway with {flag}", "PermissionDeniedError")
        elif not hmac.compare_digest(given, f"Bearer {key}".encode()):
            resp = _error(401, f"invalid or missing {area[1:]} key", "AuthenticationError")
        else:
            await self.app(scope, receive, send)
            return
        await resp(scope, receive, send)


def build_gateway_app(cfg: GatewayConfig, store: Store, secret: bytes, limiter: Limiter) -> FastAPI:
    """The gateway over `cfg.backends`. The store must be migrated. Starting the app
    starts the health and usage loops; stopping it lets the requests' ends finish,
    then closes the HTTP client and the limiter."""
    router = Router([Backend(u) for u in cfg.backends], cfg.load_factor, cfg.min_cap)
    counters = Counters(router)
    headers = {"authorization": f"Bearer {cfg.backend_api_key}"} if cfg.backend_api_key else {}
    state: dict[str, Any] = {"warmups": 0}
    client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.backend_timeout, connect=5.0),
                               limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
    acct = Accounting(store, limiter, counters, cfg.gateway_id, cfg.heartbeat_s, cfg.orphan_after_s)
    proxy = Proxy(cfg, store, secret, router, client, acct)
    background: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    async def warm(backend: Backend) -> None:
        items = await asyncio.to_thread(warm_items, store)
        n = await warm_backend(client, router, backend, items, secret, headers)
        state["warmups"] += 1
        log.info("warm-up of %s done: %d prompt(s)", backend.url, n)

    async def check(backend: Backend) -> None:
        try:
            r = await client.get(backend.url + "/health", headers=headers, timeout=min(5.0, cfg.health_interval * 2))
            ok = r.status_code == 200
            err = None if ok else f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            ok, err = False, f"{type(e).__name__}: {e}"
        if ok and not backend.healthy:
            await probe(client, backend, headers)
            backend.healthy, backend.last_error = True, None
            backend.token_counts.clear()  # it may have restarted with another model or template
            log.info("backend %s is up (%s, model %s)", backend.url, backend.kind, backend.model)
            if cfg.warmup:
                spawn(warm(backend))
        elif not ok:
            if backend.healthy:
                log.warning("backend %s is down: %s", backend.url, err)
            backend.healthy, backend.last_error = False, err

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(b) for b in router.backends))
            await asyncio.sleep(cfg.health_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.gather(*(check(b) for b in router.backends))
        spawn(health_loop())
        spawn(acct.run())
        log.info("gateway %s on http://%s:%d over %s", cfg.gateway_id, cfg.host, cfg.port,
                 ", ".join(f"{b.url} ({'up' if b.healthy else 'down'})" for b in router.backends))
        yield
        for t in list(background):
            t.cancel()
        await acct.drain()
        await client.aclose()
        await limiter.close()

    app = FastAPI(title="hotprefix gateway", version=hotprefix.__version__, lifespan=lifespan)
    app.state.proxy = proxy
    app.state.router = router
    app.state.store = store
    app.state.warm_state = state
    install_common_handlers(app)

    @app.exception_handler(GatewayError)
    async def _gateway(_: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.type, exc.param, headers=exc.headers)

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        if isinstance(exc, NotFound):
            return _error(404, str(exc), "NotFoundError")
        return _error(400, str(exc), "BadRequestError")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        await proxy.authenticate(request)
        for b in router.ranking(""):
            try:
                r = await client.get(b.url + "/v1/models", headers=headers, timeout=10)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError as e:
                proxy.mark_down(b, e)
        raise GatewayError(503, "no backend is up", "ServiceUnavailableError")

    @app.get("/health")
    async def health() -> Response:
        if any(b.healthy for b in router.backends):
            return Response(status_code=200)
        return _error(503, "no backend is up", "ServiceUnavailableError")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hotprefix.__version__, "server": "hotprefix-gateway"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(counters.registry).decode(), media_type="text/plain; version=0.0.4")

    app.include_router(admin_router(store, secret, proxy, router, warm))
    app.add_middleware(BodyGuard, max_bytes=cfg.max_request_body_bytes)
    app.add_middleware(OperatorGuard, admin_key=cfg.admin_key, metrics_key=cfg.metrics_key)
    return app


def admin_router(store: Store, secret: bytes, proxy: Proxy, router: Router, warm) -> APIRouter:
    """/admin/*: the admin key is checked by OperatorGuard before any body is read."""
    api = APIRouter(prefix="/admin")

    def run(fn, *args, **kw):
        return asyncio.to_thread(fn, *args, **kw)

    @api.get("/tenants")
    async def tenants() -> dict[str, Any]:
        return {"data": [t.__dict__ for t in await run(store.list_tenants)]}

    @api.post("/tenants", status_code=201)
    async def create_tenant(body: NewTenant) -> dict[str, Any]:
        return (await run(store.create_tenant, body.name, body.prompt)).__dict__

    @api.patch("/tenants/{name}")
    async def update_tenant(name: str, body: TenantUpdate) -> dict[str, Any]:
        t = await run(store.set_tenant_prompt, name, body.prompt)
        proxy.auth_cache.clear()
        return t.__dict__

    @api.get("/prompts")
    async def prompts() -> dict[str, Any]:
        return {"data": await run(store.list_prompts)}

    @api.post("/prompts", status_code=201)
    async def add_prompt(body: NewPrompt) -> dict[str, Any]:
        p = await run(store.add_prompt, body.name, body.text, body.public)
        proxy.auth_cache.clear()
        return {"name": p.name, "version": p.version, "public": p.public}

    @api.get("/keys")
    async def list_keys(tenant: str | None = None) -> dict[str, Any]:
        return {"data": [k.public() for k in await run(store.list_keys, tenant)]}

    @api.post("/keys", status_code=201)
    async def create_key(body: NewKey) -> dict[str, Any]:
        expires = None if body.expires_in_s is None else (
            dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) + dt.timedelta(seconds=body.expires_in_s))
        key, rec = await run(store.create_key, secret, body.tenant, body.name, expires, body.rpm, body.tpm,
                             body.max_concurrent)
        return {"key": key, **rec.public()}

    @api.post("/keys/{key_id}/revoke")
    async def revoke(key_id: str) -> dict[str, Any]:
        rec = await run(store.revoke_key, key_id)
        proxy.auth_cache.clear()
        return rec.public()

    @api.post("/keys/{key_id}/rotate")
    async def rotate(key_id: str, body: Rotation | None = None) -> dict[str, Any]:
        key, rec = await run(store.rotate_key, secret, key_id, (body or Rotation()).grace_s)
        proxy.auth_cache.clear()
        return {"key": key, **rec.public()}

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
        return {"group_by": group_by, "data": await run(store.usage_report, group_by, s, u)}

    @api.get("/backends")
    async def backends() -> dict[str, Any]:
        return {"data": [{"url": b.url, "healthy": b.healthy, "kind": b.kind, "model": b.model,
                          "inflight": b.inflight, "last_error": b.last_error} for b in router.backends]}

    @api.post("/warmup")
    async def warmup() -> dict[str, Any]:
        up = [b for b in router.backends if b.healthy]
        await asyncio.gather(*(warm(b) for b in up))
        return {"warmed_backends": [b.url for b in up]}

    return api


def make_limiter(cfg: GatewayConfig) -> Limiter:
    from hotprefix.gateway.ratelimit import MemoryLimiter, RedisLimiter

    return RedisLimiter(cfg.redis_url, cfg.lease_s) if cfg.redis_url else MemoryLimiter(cfg.lease_s)


