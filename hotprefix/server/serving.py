"""Handlers for /v1/completions and /v1/chat/completions (and the chat that /v1/responses
stands for).

Both go the same way: check the request, build sampling params, submit one engine
request per prompt (each with n samples; the engine renders and tokenizes off the
event loop), then either stream or collect the final outputs while watching for a
client disconnect. What they produce is typed (server/results.py): an Answer, or a
stream of events, which a wire format writes (openai_format for the OpenAI endpoints,
responses_api for Responses). Any way a request ends (finished, failed, client gone,
even before the first byte) is logged and counted exactly once (request_log.LogRow),
and an unfinished request is aborted so its blocks return to the pool. An error that
belongs to one request (RequestFailedError) ends that request alone: a 500, or an error
event in its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse

from hotprefix.config import SchedulingPolicy
from hotprefix.engine.async_engine import AsyncEngine, CacheScope, ChatPrompt, Prompt, RequestOptions, RequestStream
from hotprefix.engine.llm_engine import RequestOutput
from hotprefix.errors import InvalidRequestError, RequestFailedError
from hotprefix.sampling_params import SamplingParams, StructuredKind, StructuredOutput
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.openai_format import ChatFormat, CompletionFormat, OpenAIStream
from hotprefix.server.prefix_log import PrefixRecorder
from hotprefix.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
    random_id,
)
from hotprefix.server.request_log import LogRow, LogStatus, RequestLog
from hotprefix.server.responses import ClientGone, ClosingStreamingResponse, wait_disconnect
from hotprefix.server.results import Answer, Choices, Done, Failed, Step, StreamEvent, Usage
from hotprefix.server.tenancy import tenant_of
from hotprefix.server.tool_parsers import PARSERS

log = logging.getLogger("hotprefix.requests")


class Ignoring(Protocol):
    """A request with fields accepted and not acted on (they cannot change a result)."""

    def ignored(self) -> list[str]:
        """The names of those fields this request set."""


@dataclass
class Run:
    """One HTTP request's engine requests (`streams`, one per prompt, n samples each),
    the choices they make, and what it has seen of them (for usage, metrics and the log)."""

    request_id: str
    endpoint: str
    user: str | None
    model: str  # the served name the client used (echoed in responses)
    streams: list[RequestStream]
    choices: Choices
    n: int = 1
    cache_scope: CacheScope = field(default_factory=CacheScope)
    start: float = field(default_factory=time.monotonic)
    last: dict[str, RequestOutput] = field(default_factory=dict)
    last_token_at: dict[str, float] = field(default_factory=dict)
    generated: int = 0  # tokens the outputs seen so far brought (an unfinished output's token list may be ahead)
    done: bool = False  # the log line is written

    def usage(self) -> Usage:
        return Usage(sum(len(s.prompt_token_ids) for s in self.streams), self.generated,
                     sum(out.num_cached_tokens for out in self.last.values()))

    def answer(self, finals: list[RequestOutput], prefixes: list[str] | None = None) -> Answer:
        """The typed answer of the final outputs (per prompt); prefixes: echoed prompts."""
        choices = [self.choices.whole(i * self.n + o.index, o, prefixes[i] if prefixes else "")
                   for i, out in enumerate(finals) for o in out.outputs]
        return Answer(self.request_id, self.model, choices, finals, self.usage())


class StreamWriter(Protocol):
    """A wire format of a stream: its text before any event, and each event's."""

    def start(self) -> list[str]:
        ...

    def write(self, ev: StreamEvent) -> list[str]:
        ...


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
                      logprobs: int | None, add_special_tokens: bool, base_id: str, split_special_tokens: bool = False,
                      structured: StructuredOutput | None = None) -> list[RequestStream]:
        """Validate and submit one engine request per prompt (see AsyncEngine.submit).
        Raises InvalidRequestError, QueueFullError or EngineDeadError with nothing queued."""
        params, options = self.request_parts(body, scope, max_tokens, logprobs, add_special_tokens,
                                             split_special_tokens, structured)
        streams = await self.engine.submit(base_id, prompts, params, options)
        most = self.engine.max_model_len if params.max_tokens is None else params.max_tokens  # (none set: the context)
        for _ in prompts:  # (vLLM's: one observation per engine request)
            self.metrics.observe_params(params.n, most)
        return streams

    def request_parts(self, body: SamplingFields, scope: CacheScope, max_tokens: int | None, logprobs: int | None,
                      add_special_tokens: bool, split_special_tokens: bool = False,
                      structured: StructuredOutput | None = None) -> tuple[SamplingParams, RequestOptions]:
        """A request's sampling params and options, checked as the engine runs it. Raises InvalidRequestError."""
        self.note_ignored(body)
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
        return params, RequestOptions(body.priority, add_special_tokens, scope, body.pin_prefix, split_special_tokens,
                                      body.truncate_prompt_tokens, tenant=tenant_of(scope))

    def note_ignored(self, body: Ignoring) -> None:
        """Log, once per field, that a field which cannot change a result here was ignored."""
        for name in body.ignored():
            if name not in self._noted:
                self._noted.add(name)
                log.info("request field %s accepted and ignored: it cannot change a result on this server "
                         "(logged once)", name)

    def token_text(self, token_id: int) -> str:
        """A token's text in logprobs (or "token_id:N", --return-tokens-as-token-ids)."""
        return f"token_id:{token_id}" if self.options.tokens_as_ids else self.engine.token_text(token_id)

    def _observe(self, run: Run, out: RequestOutput) -> None:
        stamp = time.monotonic()
        prev = run.last_token_at.get(out.request_id)
        if prev is not None and any(out.new_token_ids):
            self.metrics.observe_token_gap(stamp - prev)
        if any(out.new_token_ids):
            run.last_token_at[out.request_id] = stamp
        run.last[out.request_id] = out
        run.generated += sum(len(ids) for ids in out.new_token_ids)
        if out.finished:
            self.metrics.observe_finished(out)

    def _finish(self, run: Run, status: LogStatus) -> None:
        """Abort what is unfinished, count aborted ones, write the log line (once)."""
        if run.done:
            return
        run.done = True
        for s in run.streams:
            if not s.finished:
                s.close()
                last = run.last.get(s.request_id)
                if last is not None:
                    for o in last.outputs:
                        o.finish_reason = o.finish_reason or "abort"
                    self.metrics.observe_finished(last)
        self.request_log.write(self._log_row(run, status))

    def _log_row(self, run: Run, status: LogStatus) -> LogRow:
        outs = list(run.last.values())
        first = [o.first_token_time for o in outs if o.first_token_time is not None]
        reasons = sorted({o.finish_reason or "abort" for out in outs for o in out.outputs})
        usage = run.usage()
        row = LogRow(time.time(), run.request_id, run.endpoint, run.model, run.user, status, usage.prompt_tokens,
                     usage.cached_tokens, usage.completion_tokens,
                     round(min(first) - min(o.arrival_time for o in outs), 4) if first else None,
                     time.monotonic() - run.start, ",".join(reasons) if reasons else None)
        if self.prefix is None:
            return row
        text = self.engine.prompt_text if self.prefix.with_text else None
        return replace(row, kv=self.prefix.kv, prefix=tuple(
            self.prefix.entry(o, run.cache_scope, text(o.prompt_token_ids) if text else None)
            for o in outs))

    async def _collect(self, run: Run, raw: Request) -> list[RequestOutput]:
        """Final outputs of every stream. Raises RequestFailedError when the engine
        failed one of them, ClientGone when the client went away (every stream is then
        aborted, as when this is cancelled); however it ends, every stream is closed and
        the request logged."""
        async def consume(s: RequestStream) -> RequestOutput:
            final = None
            async for out in s:
                self._observe(run, out)
                if (err := failure(out)) is not None:
                    raise err
                final = out
            if final is None or not final.finished:
                raise RequestFailedError("the request ended without a final output")
            return final

        status = LogStatus.CLIENT_DISCONNECTED
        work = asyncio.ensure_future(asyncio.gather(*(consume(s) for s in run.streams)))
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read: no "never retrieved" noise)
        watch = asyncio.ensure_future(wait_disconnect(raw))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientGone(run.request_id)
            status = LogStatus.ERROR
            finals = work.result()
            status = LogStatus.OK
            return finals
        finally:
            watch.cancel()
            work.cancel()
            self._finish(run, status)

    async def answer(self, run: Run, raw: Request) -> Answer:
        """The run's typed answer, once every stream finished (see _collect). Raises RequestFailedError."""
        return run.answer(await self._collect(run, raw))

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

    async def events(self, run: Run) -> AsyncIterator[StreamEvent]:
        """The run's typed events as its outputs come (see results.py): a Step for each
        output that adds a choice, then Done, or Failed when the engine failed it. However
        it ends, the run is finished (unfinished streams aborted, the request logged once)."""
        status = LogStatus.CLIENT_DISCONNECTED
        try:
            async for i, out in self._merge(run.streams):
                self._observe(run, out)
                if (err := failure(out)) is not None:
                    raise err
                choices = run.choices.step(i, out, run.n)
                if choices:
                    yield Step(i, choices, run.usage())
            yield Done(run.usage())
            status = LogStatus.OK
        except Exception as e:  # an engine failure after the response started: report it in-band
            status = LogStatus.ERROR
            log.warning("stream %s failed: %s", run.request_id, e)
            yield Failed(str(e), isinstance(e, RequestFailedError) and e.own)  # own: the same request fails anywhere
        finally:
            self._finish(run, status)

    def stream(self, run: Run, writer: StreamWriter) -> ClosingStreamingResponse:
        """The run's events as server-sent events, written by `writer`; a client that goes
        away (even before the first byte) aborts the run."""
        async def sse() -> AsyncIterator[str]:
            for text in writer.start():
                yield text
            async with aclosing(self.events(run)) as events:
                async for ev in events:
                    for text in writer.write(ev):
                        yield text

        return ClosingStreamingResponse(sse(), lambda: self._finish(run, LogStatus.CLIENT_DISCONNECTED),
                                        media_type="text/event-stream")

    # -- /v1/completions -------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request, model: str) -> Any:
        body.check()
        rid = body.request_id or random_id("cmpl")
        prompts = body.prompts()
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        streams = await self._submit(body, scope, prompts, body.max_tokens, body.logprobs, body.add_special_tokens,
                                     rid, body.split_special_tokens)
        run = Run(rid, "completions", body.user, model, streams, Choices(None, body.logprobs is not None), body.n,
                  scope)
        fmt = CompletionFormat(self.token_text, body.logprobs or 0)
        if body.stream:
            return self.stream(run, OpenAIStream(fmt, rid, model, body.n, body.stream_options))
        finals = await self._collect(run, raw)
        prefixes = [(p if isinstance(p, str) else await self.engine.detokenize(p)) if body.echo else ""
                    for p in prompts]
        answer = run.answer(finals, prefixes)
        choices = []
        for c in answer.choices:
            out = finals[c.index // body.n]
            choice = fmt.choice(c, streamed=False)
            if body.echo and body.logprobs is not None:  # the prompt's tokens first, then the generated ones
                choice["logprobs"] = fmt.echoed(out.prompt_token_ids, out.prompt_logprobs, choice["logprobs"])
            choices.append(fmt.with_prompt_logprobs(choice, out, body.prompt_logprobs))
        return JSONResponse(fmt.response(answer, choices))

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
    def chat_parts(self, body: ChatCompletionRequest) -> tuple[ChatPrompt, StructuredOutput | None, Any]:
        """A checked chat request's prompt (operator's turns, tools, template: as the engine renders
        them), its tool-call grammar and tool parser (None: no tools). Raises InvalidRequestError."""
        body.check()
        if body.chat_template is not None and not self.options.trust_request_chat_template:
            raise InvalidRequestError("a request's own chat_template is refused: the server runs it; start the "
                                      "server with --trust-request-chat-template to allow it", "chat_template")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        parser = PARSERS[self.options.tool_parser] if body.calls_tools() else None
        if parser is not None and parser.keeps_special_tokens:
            body.skip_special_tokens = False  # the format's marker is a special token (as vLLM's parser does)
        prompt = ChatPrompt([m.for_template() for m in body.messages], body.add_generation_prompt,
                            body.continue_final_message, body.chat_template or self.options.chat_template,
                            body.chat_template_kwargs, tools, body.operator_messages)
        return prompt, self._tool_grammar(body, tools), parser

    async def start_chat(self, body: ChatCompletionRequest, model: str) -> Run:
        """Check and submit a chat request (its answer then comes from `answer` or `events`).
        Raises InvalidRequestError, QueueFullError or EngineDeadError with nothing queued."""
        prompt, structured, parser = self.chat_parts(body)
        rid = body.request_id or random_id("chatcmpl")
        k = body.top_logprobs or 0
        scope = CacheScope(body.cache_salt, body.cache_salt_offset)
        streams = await self._submit(body, scope, [prompt], body.limit(), k if body.logprobs else None, False, rid,
                                     structured=structured)
        return Run(rid, "chat.completions", body.user, model, streams,
                   Choices(parser, bool(body.logprobs), body.parallel_tool_calls), body.n, scope)

    async def chat(self, body: ChatCompletionRequest, raw: Request, model: str) -> Any:
        run = await self.start_chat(body, model)
        fmt = ChatFormat(self.token_text, body.top_logprobs or 0)
        if body.stream:
            return self.stream(run, OpenAIStream(fmt, run.request_id, model, body.n, body.stream_options))
        answer = await self.answer(run, raw)
        (final,) = answer.outputs
        return JSONResponse(fmt.response(answer, [fmt.with_prompt_logprobs(fmt.choice(c, streamed=False), final,
                                                                           body.prompt_logprobs)
                                                  for c in answer.choices]))
