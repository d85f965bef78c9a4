"""The typed result of a completion or chat request, before any wire format.

Serving turns engine outputs into these (`Choices` makes the choices: it parses tool
calls for chat, as a whole or streamed); a wire format writes them: openai_format's
CompletionFormat and ChatFormat as OpenAI's JSON and SSE chunks, responses_api's as a
Response object and Responses' typed events. No format reads another's output.

Non-streamed, a request gives one `Answer`; streamed, a sequence of events: a `Step`
per engine output that adds something to the choices, then `Done` (with the final
usage), or `Failed` once something failed after the response started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotprefix.engine.outputs import CompletionOutput, RequestOutput
from hotprefix.sampling_params import TokenLogprobs
from hotprefix.server.tool_parsers import ParsedCall, ToolParser, ToolStreamer, new_call_id


@dataclass(frozen=True)
class Usage:
    """Tokens of one request: its prompts', the cached part of those, and the generated."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def openai(self) -> dict[str, Any]:
        """OpenAI's usage object (completions and chat)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class FunctionCall:
    """A tool call the model made, with the id it is answered by."""

    id: str
    name: str
    arguments: str  # JSON text of an object

    @classmethod
    def of(cls, call: ParsedCall) -> FunctionCall:
        """A parsed call with a new id."""
        return cls(new_call_id(), call.name, call.arguments)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Choice:
    """One sample's answer, whole or what one step adds to it (streamed).

    index: its index in the response (prompt i's sample j: i * n + j). text: its text
    (with a tool parser: the text outside the calls; None when a whole answer is only
    calls). calls: its tool calls (streamed: those the step completed); first_call: how
    many the choice streamed before these. logprobs: the sampled tokens' (None: not
    asked). offset: characters of the choice's text before this part (an echoed
    prompt's included). finish_reason and stop_reason: set once it ended."""

    index: int
    text: str | None
    calls: tuple[FunctionCall, ...] = ()
    first_call: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Answer:
    """A non-streamed request's result: its choices, the engine's final output per prompt
    (prompt tokens and prompt logprobs, for the formats that show them) and its usage."""

    request_id: str
    model: str
    choices: list[Choice]
    outputs: list[RequestOutput]
    usage: Usage


@dataclass(frozen=True)
class Step:
    """Streamed: what one engine output (of prompt `prompt`) adds; the usage so far."""

    prompt: int
    choices: list[Choice]
    usage: Usage


@dataclass(frozen=True)
class Done:
    """Streamed: every sample ended; the request's usage."""

    usage: Usage


@dataclass(frozen=True)
class Failed:
    """Streamed: the request failed after its response started. own: by its own fault
    (its constraint or sampling parameters: the same request fails anywhere, a 400)."""

    message: str
    own: bool


StreamEvent = Step | Done | Failed


class Choices:
    """Engine outputs as typed choices. tools: the parser of tool calls in the text
    (chat with tools; None: the text is all content); logprobs: whether the client
    asked for them; parallel: several calls per answer (else the first call only, as
    vLLM's parallel_tool_calls false). Streaming keeps per-choice state (text offsets,
    the tool streamer, the calls sent), so one Choices serves one request.

    An answer cut by length never shows a cut call as text: the parser drops it, and
    an answer that is then only complete calls ends "tool_calls" (what it holds);
    otherwise it ends "length", its text without the cut markup."""

    def __init__(self, tools: ToolParser | None, logprobs: bool, parallel: bool = True) -> None:
        self.tools = tools
        self.logprobs = logprobs
        self.parallel = parallel
        self._emitted: dict[int, int] = {}  # characters streamed per choice
        self._streamers: dict[int, ToolStreamer] = {}
        self._calls: dict[int, int] = {}  # calls streamed per choice
        self._texted: set[int] = set()  # choices that streamed content beside their calls

    def step(self, i: int, out: RequestOutput, n: int) -> list[Choice]:
        """What one engine output adds to prompt i's n samples (no choice for a sample
        that gains nothing to send: no text, no call, no logprob, not ending)."""
        choices = []
        for j, o in enumerate(out.outputs):
            index, new = i * n + j, out.new_token_ids[j]
            ending = out.finished and o.finished
            text, calls = self._delta(index, out.deltas[j], ending, ending and o.finish_reason == "length")
            if not text and not calls and not ending and not (self.logprobs and new):
                continue
            first = self._calls.get(index, 0)
            self._calls[index] = first + len(calls)
            offset = self._emitted.get(index, 0)
            self._emitted[index] = offset + len(out.deltas[j])
            logprobs = tuple((o.logprobs or [])[-len(new):]) if self.logprobs and new else None
            choices.append(Choice(index, text, calls, first, logprobs, offset,
                                  self._finish_reason(index, o) if out.finished else None,
                                  o.stop_reason if out.finished else None))
        return choices

    def _delta(self, index: int, text: str, ending: bool, cut: bool) -> tuple[str, tuple[FunctionCall, ...]]:
        """The content and the completed calls in one step's text of choice `index`
        (cut: the output ended by length, what is held is dropped)."""
        if self.tools is None:
            return text, ()
        streamer = self._streamers.setdefault(index, self.tools.streamer())
        events = streamer.feed(text) + (streamer.finish(cut) if ending else [])
        content = "".join(e for kind, e in events if kind == "content")
        if content:
            self._texted.add(index)
        calls = [e for kind, e in events if kind == "call"]
        return content, tuple(FunctionCall.of(e) for e in self._allowed(calls, self._calls.get(index, 0)))

    def _allowed(self, calls: list[ParsedCall], before: int) -> list[ParsedCall]:
        """The calls an answer may return after `before` others (parallel: all, else the first)."""
        return calls if self.parallel else calls[:max(0, 1 - before)]

    @staticmethod
    def _reason(reason: str | None, calls: bool, texted: bool) -> str | None:
        """An answer's finish reason: "tool_calls" when it has calls and stopped, or was cut
        while it held only calls (the cut call dropped); else the engine's."""
        return "tool_calls" if calls and (reason == "stop" or (reason == "length" and not texted)) else reason

    def _finish_reason(self, index: int, o: CompletionOutput) -> str | None:
        return self._reason(o.finish_reason, bool(self._calls.get(index)), index in self._texted)

    def whole(self, index: int, o: CompletionOutput, prefix: str = "") -> Choice:
        """A sample's whole answer; prefix: the echoed prompt (completions)."""
        text: str | None = prefix + o.text
        calls: tuple[FunctionCall, ...] = ()
        reason = o.finish_reason
        if self.tools is not None:
            cut = reason == "length"
            content, parsed = self.tools.parse(o.text, cut)
            parsed = self._allowed(parsed, 0)
            if parsed:
                text, calls = content, tuple(FunctionCall.of(c) for c in parsed)
                reason = self._reason(reason, True, content is not None)
            elif cut and content != (o.text.strip() or None):  # a cut call dropped: the text before it
                text = content
        return Choice(index, text, calls, 0, tuple(o.logprobs or []) if self.logprobs else None, len(prefix),
                      reason, o.stop_reason)
