"""The gateway app: one `build_gateway_app()` factory; state on `app.state`.

Client side: /v1/chat/completions, /v1/completions, /v1/responses (and GET/DELETE of a
stored response: gateway/responses_proxy.py), /v1/models (a gateway key
in `Authorization: Bearer sk-hp-...`), /health. Operator side: /admin (the admin
key): tenants, the prompt pool, keys, usage, backends, warm-up, the dashboard's data;
/metrics (the metrics key, else the admin key); /dashboard (a static page that asks for
the admin key). Operator keys are checked before any body is
read; every body is bounded and checked (server.body_guard) before a handler.
A background loop health-checks the backends; a backend that comes (back) up
is probed (hotprefix or another OpenAI-compatible server) and warmed. Another
beats for the requests in flight (gateway.usage).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

import hotprefix
from hotprefix.gateway.admin import admin_router
from hotprefix.gateway.backend_usage import UsageLookup
from hotprefix.gateway.budgets import Ledger, MemoryLedger, RedisLedger
from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.dashboard import dashboard_routes
from hotprefix.gateway.errors import GatewayError
from hotprefix.gateway.middleware import OperatorGuard
from hotprefix.gateway.monitor import BackendMonitor
from hotprefix.gateway.proxy import Proxy
from hotprefix.gateway.ratelimit import Limiter
from hotprefix.gateway.responses_proxy import responses_router
from hotprefix.gateway.routing import Backend, Router
from hotprefix.gateway.store import NotFound, Store, StoreError
from hotprefix.gateway.usage import Accounting
from hotprefix.server.body_guard import BodyGuard
from hotprefix.server.http_errors import error_response as _error
from hotprefix.server.http_errors import install_common_handlers

log = logging.getLogger(__name__)
NO_DOCS = {"docs_url": None, "redoc_url": None, "openapi_url": None}  # /docs and its kin: only with --docs


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


def client_router(proxy: Proxy, monitor: BackendMonitor, counters: Counters) -> APIRouter:
    """/v1/* (a gateway key), /health, /version, /metrics (see OperatorGuard)."""
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "chat")

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "completions")

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await proxy.handle(request, "responses")

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        await proxy.authenticate(request)
        for b in monitor.router.ranking(""):
            try:
                r = await monitor.client.get(b.url + "/v1/models", headers=monitor.headers, timeout=10)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError as e:
                b.mark_down(f"{type(e).__name__}: {e}")
        raise GatewayError(503, "no backend is up", "ServiceUnavailableError")

    @api.get("/health")
    async def health() -> Response:
        if any(b.healthy for b in monitor.router.backends):
            return Response(status_code=200)
        return _error(503, "no backend is up", "ServiceUnavailableError")

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hotprefix.__version__, "server": "hotprefix-gateway"}

    @api.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(counters.registry).decode(), media_type="text/plain; version=0.0.4")

    return api


def install_gateway_handlers(app: FastAPI) -> None:
    install_common_handlers(app)

    @app.exception_handler(GatewayError)
    async def _gateway(_: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.type, exc.param, headers=exc.headers)

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        if isinstance(exc, NotFound):
            return _error(404, str(exc), "NotFoundError")
        return _error(400, str(exc), "BadRequestError")


def build_gateway_app(cfg: GatewayConfig, store: Store, secret: bytes, limiter: Limiter,
                      ledger: Ledger | None = None) -> FastAPI:
    """The gateway over `cfg.backends`. The store must be migrated. Starting the app
    starts the health and usage loops; stopping it lets the requests' ends finish,
    then closes the HTTP client and the limiter."""
    router = Router([Backend(u) for u in cfg.backends], cfg.load_factor, cfg.min_cap)
    counters = Counters(router)
    client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.backend_timeout, connect=5.0),
                               limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
    ledger = ledger or make_ledger(cfg)
    acct = Accounting(store, limiter, counters, cfg.gateway_id, cfg.heartbeat_s, cfg.orphan_after_s, ledger,
                      UsageLookup(client, router, cfg.backend_headers(admin=True)))
    proxy = Proxy(cfg, store, secret, router, client, acct)
    background: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    health_client = httpx.AsyncClient(limits=httpx.Limits(max_connections=4 * len(cfg.backends)))
    monitor = BackendMonitor(cfg, store, secret, router, client, health_client, spawn)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await monitor.check_all()
        spawn(monitor.run())
        spawn(acct.run())
        log.info("gateway %s on http://%s:%d over %s", cfg.gateway_id, cfg.host, cfg.port,
                 ", ".join(f"{b.url} ({'up' if b.healthy else 'down'})" for b in router.backends))
        yield
        for t in list(background):
            t.cancel()
        await acct.drain()
        await client.aclose()
        await health_client.aclose()
        await limiter.close()
        await ledger.close()

    app = FastAPI(title="hotprefix gateway", version=hotprefix.__version__, lifespan=lifespan,
                  **({} if cfg.docs else NO_DOCS))
    app.state.proxy, app.state.router, app.state.store, app.state.monitor = proxy, router, store, monitor
    _mount(app, cfg, proxy, monitor, counters, ledger)
    return app


def _mount(app: FastAPI, cfg: GatewayConfig, proxy: Proxy, monitor: BackendMonitor, counters: Counters,
           ledger: Ledger) -> None:
    """The gateway's handlers, routes and edge middleware on `app`. Mutates app."""
    install_gateway_handlers(app)
    app.include_router(client_router(proxy, monitor, counters))
    app.include_router(responses_router(proxy))
    app.include_router(admin_router(proxy.store, proxy.secret, proxy, monitor))
    page, data = dashboard_routes(proxy.store, monitor, ledger)
    app.include_router(page)
    app.include_router(data, prefix="/admin")
    app.add_middleware(BodyGuard, max_bytes=cfg.max_request_body_bytes)
    app.add_middleware(OperatorGuard, admin_key=cfg.admin_key, metrics_key=cfg.metrics_key)


def make_limiter(cfg: GatewayConfig) -> Limiter:
    from hotprefix.gateway.ratelimit import MemoryLimiter, RedisLimiter

    return RedisLimiter(cfg.redis_url, cfg.lease_s) if cfg.redis_url else MemoryLimiter(cfg.lease_s)


def make_ledger(cfg: GatewayConfig) -> Ledger:
    """The budgets' counters: in Redis when the gateway has one (shared by every gateway), else here."""
    return RedisLedger(cfg.redis_url) if cfg.redis_url else MemoryLedger()
