"""/v1/completions/render and /v1/chat/completions/render, as vLLM answers them: the
token ids a request would run (the operator's forced turns, the tools and the chat
template applied, truncated and checked exactly as for generation), so a router can
hash the blocks the engine will cache. Nothing is queued; the answer is vLLM's
GenerateRequest shape (one for a chat, a list with one per prompt for completions)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from fastapi.encoders import jsonable_encoder

from hotprefix.engine.async_engine import CacheScope, RequestOptions
from hotprefix.sampling_params import SamplingParams
from hotprefix.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, random_id
from hotprefix.server.routes import ServerContext


def generate_request(body: SamplingFields, token_ids: list[int], params: SamplingParams, model: str,
                     options: RequestOptions) -> dict[str, Any]:
    """One prompt as vLLM's render endpoints describe it (its GenerateRequest)."""
    return {"request_id": body.request_id or random_id("render"), "token_ids": token_ids, "features": None,
            "sampling_params": jsonable_encoder(asdict(params)), "model": model, "stream": False,
            "stream_options": None, "cache_salt": options.cache_scope.salt, "priority": options.priority,
            "kv_transfer_params": None}


def render_router(ctx: ServerContext) -> APIRouter:
    api = APIRouter()
    serving = ctx.serving

    @api.post("/v1/completions/render")
    async def render_completions(body: CompletionRequest) -> list[dict[str, Any]]:
        model = ctx.check_model(body.model)
        body.check()
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        params, options = serving.request_parts(body, scope, body.max_tokens, body.logprobs, body.add_special_tokens,
                                                body.split_special_tokens)
        ids = await ctx.engine.render(body.prompts(), params, options)
        return [generate_request(body, p, params, model, options) for p in ids]

    @api.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        model = ctx.check_model(body.model)
        prompt, structured, _ = serving.chat_parts(body)
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        k = body.top_logprobs or 0
        params, options = serving.request_parts(body, scope, body.limit(), k if body.logprobs else None, False,
                                                structured=structured)
        (ids,) = await ctx.engine.render([prompt], params, options)
        return generate_request(body, ids, params, model, options)

    return api
