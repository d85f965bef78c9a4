"""The OpenAI-compatible app: one `build_app()` factory, state on `app.state`."""

from __future__ import annotations

import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import hotprefix
from hotprefix.config import ServerConfig
from hotprefix.core.kv_cache_manager import PinError
from hotprefix.core.scheduler import QueueFullError
from hotprefix.engine.async_engine import AsyncEngine, EngineDeadError
from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import SamplingParams
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
)
from hotprefix.server.serving import RequestLog, Serving

log = logging.getLogger(__name__)
PROTECTED = ("/v1/", "/reset_prefix_cache", "/pin", "/unpin", "/tokenize", "/detokenize")


class ModelNotFound(Exception):
    pass


_error = error_response


def install_error_handlers(app: FastAPI) -> None:
    install_common_handlers(app)

    @app.exception_handler(PinError)
    async def _pin(_: Request, exc: PinError) -> JSONResponse:
        return _error(400, str(exc), "BadRequestError", "prompt")

    @app.exception_handler(ModelNotFound)
    async def _model(_: Request, exc: ModelNotFound) -> JSONResponse:
        return _error(404, f"The model `{exc}` does not exist.", "NotFoundError", "model")

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError")


def build_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    """The app serving `engine`. Starting the app starts the engine thread; stopping it stops the engine."""
    eng = engine.engine
    model_name = cfg.served_model_name or eng.model_name
    plan = eng.runner.plan
    cache_info = {"block_size": str(plan.block_size), "num_gpu_blocks": str(plan.num_blocks),
                  "cache_dtype": plan.dtype_name,
                  "enable_prefix_caching": str(eng.config.cache.enable_prefix_caching),
                  "prefix_caching_hash_algo": eng.config.cache.prefix_caching_hash_algo}
    metrics = ServerMetrics(engine, model_name, cache_info)
    request_log = RequestLog(cfg.request_log)
    serving = Serving(engine, model_name, metrics, request_log, cfg.chat_template,
                      eng.config.scheduler.scheduling_policy)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s (max_model_len %d) on http://%s:%d", model_name, eng.max_model_len, cfg.host,
                 cfg.port)
        yield
        await engine.shutdown()
        request_log.close()

    app = FastAPI(title="hotprefix", version=hotprefix.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.model_name = model_name
    install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFound(name)

    def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        return eng.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                       add_generation_prompt, False, cfg.chat_template)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "hotprefix", "root": eng.model_name,
                                            "max_model_len": eng.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            ids = eng.tokenize(chat_prompt(body.messages, body.add_generation_prompt), False)
        else:
            ids = eng.tokenize(body.prompt or "", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < eng.arch.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of range for vocabulary size "
                                      f"{eng.arch.vocab_size}", "tokens")
        return {"prompt": eng.detokenize(body.tokens)}

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
        return {"dropped_blocks": await engine.call(lambda e: e.reset_prefix_cache())}

    async def pin_ids(body: PinRequest) -> list[int]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            return eng.tokenize(chat_prompt(body.messages, False), False)
        return list(body.prompt) if isinstance(body.prompt, list) else eng.tokenize(body.prompt or "")

    @app.post("/pin")
    async def pin(body: PinRequest) -> dict[str, Any]:
        """Compute the prefix if it is not cached, then pin its full blocks."""
        ids = await pin_ids(body)
        n_blocks = len(eng.prefix_hashes(ids))
        if not n_blocks:
            raise InvalidRequestError(f"the prefix is shorter than one block ({eng.kv.block_size} tokens)",
                                      "prompt")
        stream = engine.add_request(f"pin-{now()}-{id(body)}", ids, SamplingParams(max_tokens=1),
                                    cache_salt=body.cache_salt, cache_salt_offset=body.cache_salt_offset)
        async for _ in stream:
            pass
        n = await engine.call(lambda e: e.pin(ids, body.cache_salt, body.cache_salt_offset))
        return {"pinned_blocks": n, "prefix_tokens": n_blocks * eng.kv.block_size}

    @app.post("/unpin")
    async def unpin(body: PinRequest) -> dict[str, Any]:
        ids = await pin_ids(body)
        return {"unpinned_blocks": await engine.call(lambda e: e.unpin(ids, body.cache_salt,
                                                                       body.cache_salt_offset))}

    @app.middleware("http")
    async def malformed_json(request: Request, call_next):
        """A body that is not JSON (or not an object) is a 400, not FastAPI's 422."""
        if request.method == "POST" and request.headers.get("content-type", "").startswith("application/json"):
            raw = await request.body()
            try:
                parsed = json.loads(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return _error(400, f"invalid JSON body: {e}", "BadRequestError")
            if not isinstance(parsed, dict):
                return _error(400, "the request body must be a JSON object", "BadRequestError")
        return await call_next(request)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if cfg.api_key and request.url.path.startswith(PROTECTED):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                return _error(401, "invalid or missing API key (Authorization: Bearer <key>)",
                              "AuthenticationError")
        return await call_next(request)

    return app

