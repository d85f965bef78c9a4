"""OpenAI's response shapes for /v1/completions and /v1/chat/completions: choices
(streamed and final) and logprob blocks. One streamed-choice loop serves both
endpoints; they differ in how a piece of text and a logprob block are written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hotprefix.engine.llm_engine import CompletionOutput, RequestOutput
from hotprefix.sampling_params import TokenLogprobs
from hotprefix.server.tool_parsers import ToolParser, ToolStreamer, new_call_id


class ChoiceFormat:
    """The choices of one response. token_text: a token id's text; top: alternatives
    per logprob entry; logprobs: whether the client asked for logprobs. Streaming
    keeps per-sample text offsets (for completions' text_offset)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, token_text: Callable[[int], str], top: int, logprobs: bool) -> None:
        self.token_text = token_text
        self.top = top
        self.logprobs = logprobs
        self._emitted: dict[tuple[int, int], int] = {}

    def piece(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def logprob_block(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        raise NotImplementedError

    def head(self, n: int) -> list[dict[str, Any]] | None:
        """The choices of a first chunk sent before any token (None: no such chunk)."""
        return None

    def stream_choices(self, i: int, out: RequestOutput, n: int) -> list[dict[str, Any]]:
        """The choices one step adds to prompt i's n samples (none for a sample with nothing new)."""
        choices = []
        for j, o in enumerate(out.outputs):
            new = out.new_token_ids[j]
            ending = out.finished and o.finished
            body = self.delta(i * n + j, out.deltas[j], ending)
            if body is None and not ending and not (self.logprobs and new):
                continue
            c: dict[str, Any] = {"index": i * n + j, **(body or self.piece("")), "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}
            if self.logprobs and new:
                c["logprobs"] = self.logprob_block((o.logprobs or [])[-len(new):], self._emitted.get((i, j), 0))
            self._emitted[(i, j)] = self._emitted.get((i, j), 0) + len(out.deltas[j])
            if out.finished:
                c["finish_reason"], c["stop_reason"] = self.finish_reason(i * n + j, o), o.stop_reason
            choices.append(c)
        return choices

    def delta(self, index: int, text: str, ending: bool) -> dict[str, Any] | None:
        """What a step adds to choice `index`, or None when it adds nothing to send."""
        return self.piece(text) if text else None

    def finish_reason(self, index: int, o: CompletionOutput) -> str | None:
        return o.finish_reason

    def final_choice(self, index: int, o: CompletionOutput, prefix: str = "") -> dict[str, Any]:
        """A non-streamed choice; prefix: the echoed prompt (completions)."""
        return {"index": index, **self.whole(prefix + o.text),
                "logprobs": self.logprob_block(o.logprobs or [], len(prefix)) if self.logprobs else None,
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}

    def whole(self, text: str) -> dict[str, Any]:
        return self.piece(text)

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


class CompletionFormat(ChoiceFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def piece(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def logprob_block(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
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


class ChatFormat(ChoiceFormat):
    """Chat choices; with a tool parser (tools given, tool_choice not "none"), tool calls
    in the text become `tool_calls` (streamed as OpenAI streams them: one delta a
    call, with its id, name and arguments) and the finish reason `tool_calls`."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, token_text: Callable[[int], str], top: int, logprobs: bool,
                 tools: ToolParser | None = None) -> None:
        super().__init__(token_text, top, logprobs)
        self.tools = tools
        self._streamers: dict[int, ToolStreamer] = {}
        self._calls: dict[int, int] = {}  # calls sent per choice

    def final_choice(self, index: int, o: CompletionOutput, prefix: str = "") -> dict[str, Any]:
        choice = super().final_choice(index, o, prefix)
        if self.tools is not None:
            content, calls = self.tools.parse(o.text)
            if calls:
                choice["message"] = {"role": "assistant", "content": content,
                                     "tool_calls": [c.to_openai(new_call_id()) for c in calls]}
                if o.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        return choice

    def delta(self, index: int, text: str, ending: bool) -> dict[str, Any] | None:
        if self.tools is None:
            return super().delta(index, text, ending)
        streamer = self._streamers.setdefault(index, self.tools.streamer())
        events = streamer.feed(text) + (streamer.finish() if ending else [])
        content = "".join(e for kind, e in events if kind == "content")
        calls = [e for kind, e in events if kind == "call"]
        if not content and not calls:
            return None
        body: dict[str, Any] = {"content": content} if content else {}
        if calls:
            first = self._calls.get(index, 0)
            self._calls[index] = first + len(calls)
            body["tool_calls"] = [{"index": first + k, **c.to_openai(new_call_id())} for k, c in enumerate(calls)]
        return {"delta": body}

    def finish_reason(self, index: int, o: CompletionOutput) -> str | None:
        return "tool_calls" if self._calls.get(index) and o.finish_reason == "stop" else o.finish_reason

    def piece(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}}

    def whole(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def head(self, n: int) -> list[dict[str, Any]]:
        return [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for j in range(n)]

    def logprob_block(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        def entry(tok: str, lp: float) -> dict[str, Any]:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

        return {"content": [{**entry(self.token_text(lp.sampled.token_id), lp.sampled.logprob),
                             "top_logprobs": [entry(self.token_text(a.token_id), a.logprob)
                                              for a in lp.top[:self.top]]} for lp in lps]}
