"""The OpenAI-compatible app: one `build_app()` factory, state on `app.state`."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import hotprefix
from hotprefix.config import ServerConfig
from hotprefix.core.kv_cache_manager import PinError
from hotprefix.engine.async_engine import AsyncEngine, ChatPrompt, EngineDeadError, RequestOptions
from hotprefix.errors import InvalidRequestError, QueueFullError, RequestFailedError
from hotprefix.sampling_params import SamplingParams
from hotprefix.server.body_guard import BodyGuard
from hotprefix.server.http_errors import error_response, install_common_handlers
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    PinRequest,
    TokenizeRequest,
    now,
    random_id,
)
from hotprefix.server.serving import RequestLog, Serving, ServingOptions
from hotprefix.server.stats_log import StatsLogger

log = logging.getLogger(__name__)
PROTECTED = ("/v1/", "/reset_prefix_cache", "/pin", "/unpin", "/tokenize", "/detokenize")


class ModelNotFound(Exception):
    pass


_error = error_response


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """OpenAI error objects for every refusal, each counted in
    hotprefix:request_rejections_total{reason}."""
    reject = metrics.rejected
    install_common_handlers(app, reject)

    @app.exception_handler(PinError)
    async def _pin(_: Request, exc: PinError) -> JSONResponse:
        reject("invalid")
        return _error(400, str(exc), "BadRequestError", "prompt")

    @app.exception_handler(ModelNotFound)
    async def _model(_: Request, exc: ModelNotFound) -> JSONResponse:
        reject("invalid")
        return _error(404, f"The model `{exc}` does not exist.", "NotFoundError", "model")

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        reject("queue_full")
        return _error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        reject("engine_not_running")
        return _error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return _error(500, f"the request failed in the engine: {exc}", "InternalServerError")


def app_path(scope) -> str:
    """The request's path below --root-path (uvicorn puts the root path in front)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class ApiKeyGuard:
    """ASGI middleware: with an API key set, the protected paths need
    `Authorization: Bearer <key>` (checked before any body is read)."""

    def __init__(self, app, api_key: str | None, on_reject) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is None or scope["type"] != "http" or not app_path(scope).startswith(PROTECTED):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        self.on_reject("unauthorized")
        resp = _error(401, "invalid or missing API key (Authorization: Bearer <key>)", "AuthenticationError")
        await resp(scope, receive, send)


def build_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    """The app serving `engine`. Starting the app starts the engine thread; stopping
    it stops the engine. Handlers reach the engine only through AsyncEngine's facade."""
    names = cfg.served_model_names or (engine.model_name,)
    model_name = names[0]
    metrics = ServerMetrics(engine, model_name, engine.cache_info(), cfg.metrics_prefix)
    request_log = RequestLog(cfg.request_log)
    serving = Serving(engine, metrics, request_log,
                      ServingOptions(cfg.chat_template, engine.scheduling_policy, cfg.max_n,
                                     cfg.trust_request_chat_template, engine.default_sampling))
    stats = StatsLogger(engine, cfg.stats_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        stats_task = asyncio.create_task(stats.run()) if cfg.log_stats else None
        scheme = "https" if cfg.ssl_certfile else "http"
        log.info("serving %s (max_model_len %d) on %s://%s:%d%s", ", ".join(names), engine.max_model_len, scheme,
                 cfg.host, cfg.port, cfg.root_path)
        yield
        if stats_task is not None:
            stats_task.cancel()
        await engine.shutdown()
        request_log.close()

    app = FastAPI(title="hotprefix", version=hotprefix.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.model_name = model_name
    install_error_handlers(app, metrics)

    def check_model(name: str | None) -> str:
        """The served name to answer with. Raises ModelNotFound for a name not served."""
        if name is not None and name not in names:
            raise ModelNotFound(name)
        return name or model_name

    def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        return ChatPrompt([{"role": m.role, "content": m.text()} for m in messages], add_generation_prompt,
                          False, cfg.chat_template, template_kwargs)

    async def prompt_ids(body: TokenizeRequest | PinRequest, add_generation_prompt: bool,
                         add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            return await engine.tokenize(chat_prompt(body.messages, add_generation_prompt,
                                                     getattr(body, "chat_template_kwargs", None)))
        if isinstance(body.prompt, list):
            return list(body.prompt)
        return await engine.tokenize(body.prompt or "", add_special_tokens, split_special_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await serving.completions(body, request, check_model(body.model))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await serving.chat(body, request, check_model(body.model))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": now(), "owned_by": "hotprefix",
                                            "root": engine.model_name, "max_model_len": engine.max_model_len}
                                           for n in names]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        ids = await prompt_ids(body, body.add_generation_prompt, body.add_special_tokens, body.split_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        return {"prompt": await engine.detokenize(body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error(503, "the engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hotprefix.__version__, "server": "hotprefix"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"dropped_blocks": await engine.reset_prefix_cache()}

    @app.post("/pin")
    async def pin(body: PinRequest) -> dict[str, Any]:
        """Compute the prefix if it is not cached, then pin its full blocks."""
        check_model(body.model)
        ids = await prompt_ids(body, False, True)
        n_blocks = len(ids) // engine.block_size
        if not n_blocks:
            raise InvalidRequestError(f"the prefix is shorter than one block ({engine.block_size} tokens)",
                                      "prompt")
        (stream,) = await engine.submit(random_id("pin"), [ids], SamplingParams(max_tokens=1),
                                        RequestOptions(cache_salt=body.cache_salt,
                                                       cache_salt_offset=body.cache_salt_offset))
        async for _ in stream:
            pass
        n = await engine.pin(ids, body.cache_salt, body.cache_salt_offset)
        return {"pinned_blocks": n, "prefix_tokens": n_blocks * engine.block_size}

    @app.post("/unpin")
    async def unpin(body: PinRequest) -> dict[str, Any]:
        check_model(body.model)
        ids = await prompt_ids(body, False, True)
        return {"unpinned_blocks": await engine.unpin(ids, body.cache_salt, body.cache_salt_offset)}

    app.add_middleware(BodyGuard, max_bytes=cfg.max_request_body_bytes, on_reject=metrics.rejected)
    app.add_middleware(ApiKeyGuard, api_key=cfg.api_key, on_reject=metrics.rejected)
    if cfg.allowed_origins:  # outermost: preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials)
    return app
