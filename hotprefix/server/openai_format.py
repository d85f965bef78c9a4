"""OpenAI's wire formats for /v1/completions and /v1/chat/completions: typed choices
(server/results.py) written as JSON bodies and SSE chunks, with their logprob blocks.
One writer serves both endpoints; they differ in how a piece of text, a whole answer
and a logprob block are written."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hotprefix.engine.outputs import RequestOutput
from hotprefix.sampling_params import TokenLogprobs
from hotprefix.server.http_errors import error_body
from hotprefix.server.protocol import StreamOptions, now
from hotprefix.server.results import Answer, Choice, Done, Failed, Step, StreamEvent


class OpenAIFormat:
    """The choices of one response. token_text: a token id's text; top: alternatives
    per logprob entry."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, token_text: Callable[[int], str], top: int) -> None:
        self.token_text = token_text
        self.top = top

    def piece(self, c: Choice) -> dict[str, Any]:
        """The body of a streamed choice."""
        raise NotImplementedError

    def whole(self, c: Choice) -> dict[str, Any]:
        """The body of a non-streamed choice."""
        raise NotImplementedError

    def logprob_block(self, lps: tuple[TokenLogprobs, ...] | list[TokenLogprobs], offset: int) -> dict[str, Any]:
        raise NotImplementedError

    def head(self, n: int) -> list[dict[str, Any]] | None:
        """The choices of a first chunk sent before any token (None: no such chunk)."""
        return None

    def choice(self, c: Choice, streamed: bool) -> dict[str, Any]:
        return {"index": c.index, **(self.piece(c) if streamed else self.whole(c)),
                "logprobs": None if c.logprobs is None else self.logprob_block(c.logprobs, c.offset),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def response(self, answer: Answer, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON body of a non-streamed answer with its choices written."""
        return {"id": answer.request_id, "object": self.object_name, "created": now(), "model": answer.model,
                "choices": choices, "usage": answer.usage.openai()}

    def with_prompt_logprobs(self, choice: dict[str, Any], out: RequestOutput, k: int | None) -> dict[str, Any]:
        """The choice with vLLM's `prompt_logprobs` when the request asked (k not None):
        None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
        for the prompt token and its k most likely alternatives."""
        if k is None:
            return choice
        entries: list[dict[str, Any] | None] = []
        for lp in out.prompt_logprobs or [None] * len(out.prompt_token_ids):
            if lp is None:
                entries.append(None)
                continue
            shown = {a.token_id: a for a in lp.top[:k]} | {lp.sampled.token_id: lp.sampled}
            entries.append({str(t): {"logprob": a.logprob, "rank": a.rank, "decoded_token": self.token_text(t)}
                            for t, a in shown.items()})
        return {**choice, "prompt_logprobs": entries}


class CompletionFormat(OpenAIFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def piece(self, c: Choice) -> dict[str, Any]:
        return {"text": c.text or ""}

    def whole(self, c: Choice) -> dict[str, Any]:
        return {"text": c.text or ""}

    def logprob_block(self, lps: tuple[TokenLogprobs, ...] | list[TokenLogprobs], offset: int) -> dict[str, Any]:
        toks = [self.token_text(lp.sampled.token_id) for lp in lps]
        offsets, pos = [], offset
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": toks, "token_logprobs": [lp.sampled.logprob for lp in lps],
                "top_logprobs": [{self.token_text(a.token_id): a.logprob for a in lp.top[:self.top]} for lp in lps],
                "text_offset": offsets}

    def echoed(self, prompt_ids: list[int], prompt_lps: list[TokenLogprobs | None] | None,
               generated: dict[str, Any]) -> dict[str, Any]:
        """An echoed prompt's logprob block (its first token has none, as in OpenAI's
        legacy API; the engine scored every later one), then the generated tokens'
        (`generated`, whose offsets follow)."""
        first = self.token_text(prompt_ids[0])
        rest = self.logprob_block((prompt_lps or [])[1:], len(first))  # entry i scores prompt token i
        return {"tokens": [first] + rest["tokens"] + generated["tokens"],
                "token_logprobs": [None] + rest["token_logprobs"] + generated["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"] + generated["top_logprobs"],
                "text_offset": [0] + rest["text_offset"] + generated["text_offset"]}


class ChatFormat(OpenAIFormat):
    """Chat choices; tool calls (see results.Choices) as `tool_calls`, streamed as OpenAI
    streams them: one delta a call, with its id, name and arguments."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def piece(self, c: Choice) -> dict[str, Any]:
        if not c.calls:
            return {"delta": {"content": c.text or ""}}
        body: dict[str, Any] = {"content": c.text} if c.text else {}
        body["tool_calls"] = [{"index": c.first_call + k, **call.openai()} for k, call in enumerate(c.calls)]
        return {"delta": body}

    def whole(self, c: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.calls:
            message["tool_calls"] = [call.openai() for call in c.calls]
        return {"message": message}

    def head(self, n: int) -> list[dict[str, Any]]:
        return [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for j in range(n)]

    def logprob_block(self, lps: tuple[TokenLogprobs, ...] | list[TokenLogprobs], offset: int) -> dict[str, Any]:
        def entry(tok: str, lp: float) -> dict[str, Any]:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

        return {"content": [{**entry(self.token_text(lp.sampled.token_id), lp.sampled.logprob),
                             "top_logprobs": [entry(self.token_text(a.token_id), a.logprob)
                                              for a in lp.top[:self.top]]} for lp in lps]}


class OpenAIStream:
    """A stream's events as OpenAI's server-sent events: the format's head (if any), a
    chunk per step, then a usage chunk if asked (`stream_options`), then [DONE]; a
    failure ends the stream with one error event and [DONE]."""

    def __init__(self, fmt: OpenAIFormat, request_id: str, model: str, n: int,
                 options: StreamOptions | None) -> None:
        self.fmt, self.n, self.options = fmt, n, options
        self.base = {"id": request_id, "object": fmt.chunk_object_name, "created": now(), "model": model}

    @staticmethod
    def event(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        head = self.fmt.head(self.n)
        return [] if head is None else [self.event({**self.base, "choices": head})]

    def write(self, ev: StreamEvent) -> list[str]:
        opts = self.options
        if isinstance(ev, Step):
            obj = {**self.base, "choices": [self.fmt.choice(c, True) for c in ev.choices]}
            if opts and opts.include_usage:
                obj["usage"] = ev.usage.openai() if opts.continuous_usage_stats else None
            return [self.event(obj)]
        if isinstance(ev, Done):
            usage = [self.event({**self.base, "choices": [], "usage": ev.usage.openai()})] \
                if opts and opts.include_usage else []
            return [*usage, "data: [DONE]\n\n"]
        assert isinstance(ev, Failed)
        kind = ("BadRequestError", 400) if ev.own else ("InternalServerError", 500)
        return [self.event(error_body(ev.message, *kind)), "data: [DONE]\n\n"]
