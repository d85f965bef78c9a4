"""The OpenAI-compatible app: one `build_app()` factory, state on `app.state`.

The wiring only: routes are in routes.py (per endpoint family), request models in
protocol.py, the work of a completion in serving.py, refusals in error_handlers.py,
the edge (body guard, API key, CORS) in body_guard.py and middleware.py. Handlers
reach the engine only through AsyncEngine's facade (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import hotprefix
from hotprefix.config import ServerConfig
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.server.body_guard import BodyGuard
from hotprefix.server.dashboard import Dashboard, dashboard_router
from hotprefix.server.error_handlers import install_error_handlers
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.middleware import ApiKeyGuard
from hotprefix.server.prefix_log import LogKey, PrefixGroups, PrefixRecorder
from hotprefix.server.render import render_router
from hotprefix.server.request_log import KVShape, RequestLog
from hotprefix.server.routes import (
    ServerContext,
    cache_router,
    openai_router,
    ops_router,
    requests_router,
    tokens_router,
)
from hotprefix.server.serving import Serving, ServingOptions
from hotprefix.server.stats_log import StatsLogger
from hotprefix.server.tenancy import ClientTenant

log = logging.getLogger(__name__)


def prefix_recorder(engine: AsyncEngine, cfg: ServerConfig) -> PrefixRecorder | None:
    """Block-hash chains for the request log and /prefix_groups (None without prefix caching)."""
    info = engine.cache_info()
    if info["enable_prefix_caching"] != "True":
        return None
    windows, retain_every = engine.kv_groups
    grouped = len(windows) > 1  # (lint replays a grouped pool's groups)
    kv = KVShape(engine.block_size, int(info["num_gpu_blocks"]), int(info["num_cpu_blocks"]), engine.kv_block_bytes,
                 windows if grouped else None, retain_every if grouped else 0)
    return PrefixRecorder(LogKey.for_log(cfg.request_log), PrefixGroups(engine.block_size), kv,
                          cfg.request_log_prompts)


def server_limits(engine: AsyncEngine, cfg: ServerConfig) -> dict[str, object]:
    """What the dashboard lists as the server's limits."""
    info = engine.cache_info()
    return {"max_model_len": engine.max_model_len, "block_size": engine.block_size,
            "kv_blocks": int(info["num_gpu_blocks"]), "host_tier_blocks": int(info["num_cpu_blocks"]),
            "kv_cache_dtype": info["cache_dtype"], "prefix_caching": info["enable_prefix_caching"] == "True",
            "max_num_queued_requests": cfg.admission.max_num_queued_requests, "max_n": cfg.max_n,
            "max_logprobs": cfg.max_logprobs, "max_request_body_bytes": cfg.max_request_body_bytes,
            "api_key": cfg.api_key is not None, "admin_api_key": cfg.admin_api_key is not None}


def build_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    """The app serving `engine`. Starting the app starts the engine thread (and the
    stats line); stopping it stops the engine."""
    names = cfg.served_model_names or (engine.model_name,)
    metrics = ServerMetrics(engine, names[0], engine.cache_info(), cfg.metrics_prefix)
    request_log = RequestLog(cfg.request_log)
    serving = Serving(engine, metrics, request_log,
                      ServingOptions(cfg.chat_template, engine.scheduling_policy, cfg.max_n,
                                     cfg.trust_request_chat_template, engine.default_sampling, cfg.tool_call_parser,
                                     cfg.max_logprobs, cfg.return_tokens_as_token_ids),
                      prefix_recorder(engine, cfg))
    ctx = ServerContext(engine, serving, metrics, cfg, names)
    stats = StatsLogger(engine, cfg.stats_interval)
    dash = Dashboard(engine, metrics, serving.prefix, server_limits(engine, cfg), cfg.dashboard_interval,
                     cfg.dashboard_window, curve_every=6 * cfg.dashboard_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        stats_task = asyncio.create_task(stats.run()) if cfg.log_stats else None
        dash_task = asyncio.create_task(dash.run())
        scheme = "https" if cfg.ssl_certfile else "http"
        log.info("serving %s (max_model_len %d) on %s://%s:%d%s", ", ".join(names), engine.max_model_len, scheme,
                 cfg.host, cfg.port, cfg.root_path)
        yield
        dash_task.cancel()
        if stats_task is not None:
            stats_task.cancel()
        await engine.shutdown()
        request_log.close()

    docs = {} if cfg.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hotprefix", version=hotprefix.__version__, lifespan=lifespan, **docs)
    app.state.engine, app.state.serving, app.state.metrics, app.state.config = engine, serving, metrics, cfg
    app.state.model_name, app.state.responses = names[0], ctx.responses
    install_error_handlers(app, metrics)
    for router in (openai_router, render_router, tokens_router, cache_router, requests_router, ops_router):
        app.include_router(router(ctx))
    app.include_router(dashboard_router(dash))
    app.add_middleware(BodyGuard, max_bytes=cfg.max_request_body_bytes, on_reject=metrics.rejected)
    app.add_middleware(ApiKeyGuard, api_key=cfg.api_key, on_reject=metrics.rejected, admin_key=cfg.admin_api_key)
    app.add_middleware(ClientTenant)
    if cfg.allowed_origins:  # outermost: preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials)
    return app
