"""Handlers for /v1/completions and /v1/chat/completions.

Both go the same way: check the request, build sampling params, submit one
engine request per prompt (each with n samples; the engine renders and
tokenizes off the event loop), then either stream SSE chunks or collect the
final outputs while watching for a client disconnect. Any way a request ends
(finished, failed, client gone, even before the first byte) is logged and
counted exactly once, and an unfinished request is aborted so its blocks return
to the pool. An error that belongs to one request (RequestFailedError) ends that
request alone: a 500, or an error event in its stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from hotprefix.config import SchedulingPolicy
from hotprefix.engine.async_engine import AsyncEngine, CacheScope, ChatPrompt, Prompt, RequestOptions, RequestStream
from hotprefix.engine.llm_engine import RequestOutput
from hotprefix.errors import InvalidRequestError, RequestFailedError
from hotprefix.sampling_params import StructuredKind, StructuredOutput
from hotprefix.server.http_errors import error_body
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.openai_format import ChatFormat, ChoiceFormat, CompletionFormat
from hotprefix.server.prefix_log import PrefixRecorder
from hotprefix.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
    now,
    random_id,
)
from hotprefix.server.responses import ClosingStreamingResponse, wait_disconnect
from hotprefix.server.tool_parsers import PARSERS

log = logging.getLogger("hotprefix.requests")


class RequestLog:
    """One line per finished request, to the log and optionally as JSON lines to a file."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives as long as the app

    def write(self, row: dict[str, Any]) -> None:
        log.info("request %(request_id)s %(status)s: prompt=%(prompt_tokens)d cached=%(cached_tokens)d "
                 "completion=%(completion_tokens)d ttft=%(ttft_s)s latency=%(latency_s).3fs finish=%(finish_reason)s",
                 row)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class LogStatus(str, Enum):
    """How a request ended, in its request-log line."""

    OK = "ok"
    ERROR = "error"
    CLIENT_DISCONNECTED = "client_disconnected"


@dataclass
class Tracker:
    """What one HTTP request has seen of its engine requests (for usage, metrics and the log)."""

    request_id: str
    endpoint: str
    user: str | None
    model: str  # the served name the client used (echoed in responses)
    start: float = field(default_factory=time.monotonic)
    last: dict[str, RequestOutput] = field(default_factory=dict)
    last_token_at: dict[str, float] = field(default_factory=dict)
    done: bool = False  # the log line is written
    cache_scope: CacheScope = field(default_factory=CacheScope)


def tenant_of(scope: CacheScope) -> str | None:
    """Whose share of the preprocessing workers a request takes (RequestOptions.tenant):
    the owner of its cache salt. The gateway gives each tenant its own salt
    (gateway/keys.tenant_salt), so the salt names the tenant; a request without one is
    no tenant's."""
    return scope.salt


def failure(out: RequestOutput) -> RequestFailedError | None:
    """The error of a sample of this output that failed inside the engine, if one did."""
    o = next((o for o in out.outputs if o.finish_reason == "error"), None)
    return None if o is None else RequestFailedError(o.error or "internal error", o.error_own)


@dataclass(frozen=True)
class ServingOptions:
    """chat_template: the server's override of the model's template.
    scheduling_policy: the engine's (priority is refused unless it is "priority").
    max_n: the most samples one request may ask for (n, best_of).
    trust_request_chat_template: accept a request's own `chat_template`.
    default_sampling: sampling defaults from the model's generation config.
    tool_parser: how tool calls are read from the model's text (tool_parsers.PARSERS).
    max_logprobs: the most logprobs (alternatives per token) a request may ask for.
    tokens_as_ids: logprob tokens written as "token_id:N" (vLLM's --return-tokens-as-token-ids)."""

    chat_template: str | None = None
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_n: int = 16
    trust_request_chat_template: bool = False
    default_sampling: dict[str, Any] = field(default_factory=dict)
    tool_parser: str = "hermes"
    max_logprobs: int = 20
    tokens_as_ids: bool = False


@dataclass
class Serving:
    engine: AsyncEngine
    metrics: ServerMetrics
    request_log: RequestLog
    options: ServingOptions = field(default_factory=ServingOptions)
    prefix: PrefixRecorder | None = None  # block-hash chains for the log and /prefix_groups (None: no caching)
    _noted: set[str] = field(default_factory=set, init=False, repr=False)  # ignored fields logged once

    # -- shared -------------------------------------------------------------------
    async def _submit(self, body: SamplingFields, scope: CacheScope, prompts: list[Prompt], max_tokens: int | None,
                      logprobs: int | None, add_special_tokens: bool, base_id: str,
                      split_special_tokens: bool = False,
                      structured: StructuredOutput | None = None) -> list[RequestStream]:
        """Validate and submit one engine request per prompt (see AsyncEngine.submit).
        Raises InvalidRequestError, QueueFullError or EngineDeadError with nothing queued."""
        self._note_ignored(body)
        if body.priority != 0 and self.options.scheduling_policy is not SchedulingPolicy.PRIORITY:
            raise InvalidRequestError("priority is only honoured with --scheduling-policy priority", "priority")
        if body.n > self.options.max_n:
            raise InvalidRequestError(f"n must be <= {self.options.max_n} (--max-n), got {body.n}", "n")
        if logprobs is not None and logprobs > self.options.max_logprobs:
            raise InvalidRequestError(f"at most {self.options.max_logprobs} logprobs (--max-logprobs), got {logprobs}",
                                      "logprobs")
        params = body.sampling_params(max_tokens, logprobs, self.options.default_sampling)
        if structured is not None:  # the tool-call grammar
            try:
                params = replace(params, structured=structured)
            except ValueError as e:
                raise InvalidRequestError(str(e), str(e).split(" ")[0]) from None
        options = RequestOptions(body.priority, add_special_tokens, scope, body.pin_prefix, split_special_tokens,
                                 body.truncate_prompt_tokens, tenant=tenant_of(scope))
        streams = await self.engine.submit(base_id, prompts, params, options)
        for _ in prompts:  # (vLLM's per engine request; max_model_len when the request set no max_tokens)
            self.metrics.observe_params(params.n, self.engine.max_model_len if params.max_tokens is None
                                        else params.max_tokens)
        return streams

    def _note_ignored(self, body: SamplingFields) -> None:
        """Log, once per field, that a field which cannot change a result here was ignored."""
        for name in body.ignored():
            if name not in self._noted:
                self._noted.add(name)
                log.info("request field %s accepted and ignored: it cannot change a result on this server "
                         "(logged once)", name)

    def _token_text(self, token_id: int) -> str:
        """A token's text in logprobs (or "token_id:N", --return-tokens-as-token-ids)."""
        return f"token_id:{token_id}" if self.options.tokens_as_ids else self.engine.token_text(token_id)

    def _observe(self, t: Tracker, out: RequestOutput) -> None:
        stamp = time.monotonic()
        prev = t.last_token_at.get(out.request_id)
        if prev is not None and any(out.new_token_ids):
            self.metrics.observe_token_gap(stamp - prev)
        if any(out.new_token_ids):
            t.last_token_at[out.request_id] = stamp
        t.last[out.request_id] = out
        if out.finished:
            self.metrics.observe_finished(out)

    def _finish(self, t: Tracker, streams: list[RequestStream], status: LogStatus) -> None:
        """Abort what is unfinished, count aborted ones, write the log line (once)."""
        if t.done:
            return
        t.done = True
        for s in streams:
            if not s.finished:
                s.close()
                last = t.last.get(s.request_id)
                if last is not None:
                    for o in last.outputs:
                        o.finish_reason = o.finish_reason or "abort"
                    self.metrics.observe_finished(last)
        outs = list(t.last.values())
        first = [o.first_token_time for o in outs if o.first_token_time is not None]
        reasons = sorted({o.finish_reason or "abort" for out in outs for o in out.outputs})
        row = {
            "time": time.time(), "request_id": t.request_id, "endpoint": t.endpoint, "model": t.model,
            "user": t.user, "status": status.value,
            "prompt_tokens": sum(len(s.prompt_token_ids) for s in streams),
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "completion_tokens": sum(len(o.token_ids) for out in outs for o in out.outputs),
            "ttft_s": round(min(first) - min(o.arrival_time for o in outs), 4) if first else None,
            "latency_s": time.monotonic() - t.start,
            "finish_reason": ",".join(reasons) if reasons else None,
        }
        if self.prefix is not None:
            text = self.engine.prompt_text if self.prefix.with_text else None
            row["kv"] = self.prefix.kv
            row["prefix"] = [self.prefix.entry(o, t.cache_scope,
                                               text(o.prompt_token_ids) if text else None) for o in outs]
        self.request_log.write(row)

    def usage(self, streams: list[RequestStream], t: Tracker) -> dict[str, Any]:
        prompt = sum(len(s.prompt_token_ids) for s in streams)
        completion = sum(len(o.token_ids) for out in t.last.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in t.last.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _collect(self, streams: list[RequestStream], t: Tracker, raw: Request) -> list[RequestOutput]:
        """Final outputs of every stream. Raises RequestFailedError when the engine
        failed one of them; aborts them all if the client goes away (or this is
        cancelled); however it ends, every stream is closed and the request logged."""
        async def consume(s: RequestStream) -> RequestOutput:
            final = None
            async for out in s:
                self._observe(t, out)
                if (err := failure(out)) is not None:
                    raise err
                final = out
            if final is None or not final.finished:
                raise RequestFailedError("the request ended without a final output")
            return final

        status = LogStatus.CLIENT_DISCONNECTED
        work = asyncio.ensure_future(asyncio.gather(*(consume(s) for s in streams)))
        watch = asyncio.ensure_future(wait_disconnect(raw))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise asyncio.CancelledError("client disconnected")
            status = LogStatus.ERROR
            finals = work.result()
            status = LogStatus.OK
            return finals
        finally:
            watch.cancel()
            work.cancel()
            self._finish(t, streams, status)

    async def _merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all streams as they come, tagged with the stream's index."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    await q.put((i, out))
            except Exception as e:
                await q.put((i, e))
            await q.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            open_ = len(streams)
            while open_:
                i, item = await q.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    def _sse(self, streams: list[RequestStream], t: Tracker, body: SamplingFields,
             fmt: ChoiceFormat) -> ClosingStreamingResponse:
        """Stream chunks as server-sent events: fmt's head (if any), the choices each
        step adds, then a usage chunk if asked, then [DONE]. A failure ends the
        stream with one error event and [DONE]."""
        opts = body.stream_options
        base = {"id": t.request_id, "object": fmt.chunk_object_name, "created": now(), "model": t.model}

        def event(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        async def gen() -> AsyncIterator[str]:
            status = LogStatus.CLIENT_DISCONNECTED
            try:
                if (head := fmt.head(body.n)) is not None:
                    yield event({**base, "choices": head})
                async for i, out in self._merge(streams):
                    self._observe(t, out)
                    if (err := failure(out)) is not None:
                        raise err
                    choices = fmt.stream_choices(i, out, body.n)
                    if not choices:
                        continue
                    obj = {**base, "choices": choices}
                    if opts and opts.include_usage:
                        obj["usage"] = self.usage(streams, t) if opts.continuous_usage_stats else None
                    yield event(obj)
                if opts and opts.include_usage:
                    yield event({**base, "choices": [], "usage": self.usage(streams, t)})
                yield "data: [DONE]\n\n"
                status = LogStatus.OK
            except Exception as e:  # an engine failure after the response started: report it in-band
                status = LogStatus.ERROR
                log.warning("stream %s failed: %s", t.request_id, e)
                own = isinstance(e, RequestFailedError) and e.own  # its grammar: the same request fails anywhere
                yield event(error_body(str(e), *(("BadRequestError", 400) if own else ("InternalServerError", 500))))
                yield "data: [DONE]\n\n"
            finally:
                self._finish(t, streams, status)

        return ClosingStreamingResponse(gen(), lambda: self._finish(t, streams, LogStatus.CLIENT_DISCONNECTED),
                                        media_type="text/event-stream")

    def _respond(self, t: Tracker, fmt: ChoiceFormat, choices: list[dict[str, Any]],
                 streams: list[RequestStream]) -> JSONResponse:
        return JSONResponse({"id": t.request_id, "object": fmt.object_name, "created": now(), "model": t.model,
                             "choices": choices, "usage": self.usage(streams, t)})

    # -- /v1/completions -------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request, model: str) -> Any:
        body.check()
        rid = body.request_id or random_id("cmpl")
        prompts = body.prompts()
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        streams = await self._submit(body, scope, prompts, body.max_tokens, body.logprobs, body.add_special_tokens,
                                     rid, body.split_special_tokens)
        t = Tracker(rid, "completions", body.user, model, cache_scope=scope)
        fmt = CompletionFormat(self._token_text, body.logprobs or 0, body.logprobs is not None)
        if body.stream:
            return self._sse(streams, t, body, fmt)
        finals = await self._collect(streams, t, raw)
        choices = []
        for i, (p, out) in enumerate(zip(prompts, finals)):
            prefix = (p if isinstance(p, str) else await self.engine.detokenize(p)) if body.echo else ""
            for o in out.outputs:
                c = fmt.final_choice(i * body.n + o.index, o, prefix)
                if body.echo and body.logprobs is not None:  # the prompt's tokens first, then the generated ones
                    c["logprobs"] = fmt.echoed(out.prompt_token_ids, out.prompt_logprobs, c["logprobs"])
                choices.append(fmt.with_prompt_logprobs(c, out, body.prompt_logprobs))
        return self._respond(t, fmt, choices, streams)

    def _tool_grammar(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> StructuredOutput | None:
        """tool_choice "required" or a named function: the output is constrained to valid
        calls in the --tool-call-parser's format."""
        choice = body.tool_choice
        if not tools or choice in (None, "none", "auto"):
            return None
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        grammar = PARSERS[self.options.tool_parser].grammar(tools, only, body.parallel_tool_calls)
        return StructuredOutput(StructuredKind.GRAMMAR, grammar)

    # -- /v1/chat/completions ------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request, model: str) -> Any:
        body.check()
        if body.chat_template is not None and not self.options.trust_request_chat_template:
            raise InvalidRequestError("a request's own chat_template is refused: the server runs it; start the "
                                      "server with --trust-request-chat-template to allow it", "chat_template")
        rid = body.request_id or random_id("chatcmpl")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        if body.calls_tools() and PARSERS[self.options.tool_parser].keeps_special_tokens:
            body.skip_special_tokens = False  # the format's marker is a special token (as vLLM's parser does)
        prompt = ChatPrompt([m.for_template() for m in body.messages], body.add_generation_prompt,
                            body.continue_final_message, body.chat_template or self.options.chat_template,
                            body.chat_template_kwargs, tools, body.operator_messages)
        k = body.top_logprobs or 0
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        streams = await self._submit(body, scope, [prompt], body.limit(), k if body.logprobs else None, False, rid,
                                     structured=self._tool_grammar(body, tools))
        t = Tracker(rid, "chat.completions", body.user, model, cache_scope=scope)
        fmt = ChatFormat(self._token_text, k, bool(body.logprobs),
                         PARSERS[self.options.tool_parser] if body.calls_tools() else None)
        if body.stream:
            return self._sse(streams, t, body, fmt)
        (final,) = await self._collect(streams, t, raw)
        choices = [fmt.with_prompt_logprobs(fmt.final_choice(o.index, o), final, body.prompt_logprobs)
                   for o in final.outputs]
        return self._respond(t, fmt, choices, streams)
