"""The server's routes, per endpoint family, over one ServerContext (vLLM's
api_router shape: thin routes; protocol.py holds the models, serving.py the work)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response

import hotprefix
from hotprefix.config import ServerConfig
from hotprefix.engine.async_engine import AsyncEngine, CacheScope, ChatPrompt, RequestOptions
from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import SamplingParams
from hotprefix.server import responses_api
from hotprefix.server.error_handlers import ModelNotFound
from hotprefix.server.http_errors import error_response
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
from hotprefix.server.responses_api import ResponseStore
from hotprefix.server.responses_request import ResponsesRequest
from hotprefix.server.results import Usage
from hotprefix.server.serving import Serving, tenant_of

MAX_WAIT_S = 60.0  # the longest /requests/{id} waits for a request to end


@dataclass(frozen=True)
class ServerContext:
    """What the routes share: the engine's facade, the handlers, the metrics, the
    config, the served names (the first is the one reported) and the stored responses."""

    engine: AsyncEngine
    serving: Serving
    metrics: ServerMetrics
    cfg: ServerConfig
    names: tuple[str, ...]
    responses: ResponseStore = field(default_factory=ResponseStore)

    def check_model(self, name: str | None) -> str:
        """The served name to answer with. Raises ModelNotFound for a name not served."""
        if name is not None and name not in self.names:
            raise ModelNotFound(name)
        return name or self.names[0]

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None = None, tools: list | None = None,
                    operator_messages: int = 0) -> ChatPrompt:
        return ChatPrompt([m.for_template() for m in messages], add_generation_prompt, False, self.cfg.chat_template,
                          template_kwargs, [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                          operator_messages)

    async def prompt_ids(self, body: TokenizeRequest | PinRequest, add_generation_prompt: bool,
                         add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        """The token ids of a prompt or messages body (exactly one). Raises InvalidRequestError."""
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            return await self.engine.tokenize(self.chat_prompt(body.messages, add_generation_prompt,
                                                               getattr(body, "chat_template_kwargs", None),
                                                               getattr(body, "tools", None),
                                                               getattr(body, "operator_messages", 0)))
        if isinstance(body.prompt, list):
            return list(body.prompt)
        return await self.engine.tokenize(body.prompt or "", add_special_tokens, split_special_tokens)


def openai_router(ctx: ServerContext) -> APIRouter:
    """/v1/completions, /v1/chat/completions, /v1/models."""
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await ctx.serving.completions(body, request, ctx.check_model(body.model))

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await ctx.serving.chat(body, request, ctx.check_model(body.model))

    def card(name: str) -> dict[str, Any]:
        e = ctx.engine
        return {"id": name, "object": "model", "created": now(), "owned_by": "hotprefix", "root": e.model_name,
                "max_model_len": e.max_model_len, "max_n": ctx.cfg.max_n}

    store = ctx.responses

    @api.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await responses_api.create(ctx.serving, store, body, request, ctx.check_model(body.model))

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, cache_salt: str | None = None) -> Any:
        """A stored response, to a request with the cache salt that made it (a gateway's tenant)."""
        kept = store.response(response_id, cache_salt)
        if kept is None:
            return error_response(404, f"response {response_id!r} is not kept here", "NotFoundError", "response_id")
        return kept

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, cache_salt: str | None = None) -> Any:
        if not store.delete(response_id, cache_salt):
            return error_response(404, f"response {response_id!r} is not kept here", "NotFoundError", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(n) for n in ctx.names]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id not in ctx.names:
            return error_response(404, f"the model {model_id!r} does not exist; this server serves "
                                       f"{', '.join(ctx.names)}", "NotFoundError", "model")
        return card(model_id)

    return api


def tokens_router(ctx: ServerContext) -> APIRouter:
    """/tokenize and /detokenize."""
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ids = await ctx.prompt_ids(body, body.add_generation_prompt, body.add_special_tokens,
                                   body.split_special_tokens)
        return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        return {"prompt": await ctx.engine.detokenize(body.tokens)}

    return api


def cache_router(ctx: ServerContext) -> APIRouter:
    """/pin, /unpin, /reset_prefix_cache: the operator's controls of the prefix cache;
    /prefix_groups: how requests share prefixes (server/prefix_log.py)."""
    api = APIRouter()
    engine = ctx.engine

    @api.get("/prefix_groups")
    async def prefix_groups(top: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        """Requests grouped by their first block: where they broke off from every earlier
        request, and the hit rate measured and possible (`hotprefix lint --url` reads it)."""
        if ctx.serving.prefix is None:
            raise InvalidRequestError("prefix caching is off (--no-enable-prefix-caching): no prefix groups")
        return ctx.serving.prefix.groups.snapshot(top)

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"dropped_blocks": await engine.reset_prefix_cache()}

    @api.post("/pin")
    async def pin(body: PinRequest) -> dict[str, Any]:
        """Compute the prefix if it is not cached, then pin its full blocks."""
        ctx.check_model(body.model)
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        ids = await ctx.prompt_ids(body, False, True)
        n_blocks = len(ids) // engine.block_size
        if not n_blocks:
            raise InvalidRequestError(f"the prefix is shorter than one block ({engine.block_size} tokens)",
                                      "prompt")
        (stream,) = await engine.submit(random_id("pin"), [ids], SamplingParams(max_tokens=1),
                                        RequestOptions(cache_scope=scope, tenant=tenant_of(scope)))
        async for _ in stream:
            pass
        n = await engine.pin(ids, scope)
        return {"pinned_blocks": n, "prefix_tokens": n_blocks * engine.block_size}

    @api.post("/unpin")
    async def unpin(body: PinRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ids = await ctx.prompt_ids(body, False, True)
        return {"unpinned_blocks": await engine.unpin(ids, CacheScope(body.cache_salt, body.cache_salt_offset))}

    return api


def requests_router(ctx: ServerContext) -> APIRouter:
    """/requests/{id}: what a finished request used, by its request_id (an operator's: a
    gateway whose client went away is charged what this server computed)."""
    api = APIRouter()

    @api.get("/requests/{request_id:path}")
    async def finished_request(request_id: str, wait: float = Query(0.0, ge=0, le=MAX_WAIT_S)) -> Any:
        """The request's row: how it ended and its usage. `wait`: seconds to wait for a request
        still running (or not arrived yet) to end; 404 when none with this id ended meanwhile."""
        row = await ctx.serving.request_log.finished(request_id, wait)
        if row is None:
            return error_response(404, f"no finished request {request_id!r} is kept here", "NotFoundError",
                                  "request_id")
        return {"request_id": row.request_id, "status": row.status.value, "finish_reason": row.finish_reason,
                "usage": Usage(row.prompt_tokens, row.completion_tokens, row.cached_tokens).openai()}

    return api


def ops_router(ctx: ServerContext) -> APIRouter:
    """/health (and /ping, SageMaker's name), /load, /version, /metrics."""
    api = APIRouter()

    @api.get("/health")
    @api.get("/ping")
    @api.post("/ping")
    async def health() -> Response:
        if not ctx.engine.is_running:
            return error_response(503, "the engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    @api.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: the requests admitted and not yet finished."""
        return {"server_load": ctx.engine.num_unfinished}

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hotprefix.__version__, "server": "hotprefix"}

    @api.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    return api
