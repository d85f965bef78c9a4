"""Tool calls in a model's output: parsers per format, their streaming form, and the
grammar that makes `tool_choice: "required"` (or a named function) produce valid calls.

A parser turns generated text into content and calls; a streamer does the same on
deltas, holding back text that may be the start of a call. Three formats (vLLM's
--tool-call-parser names): hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>),
which Qwen-family models use and which tool_prompt.py teaches models whose template has
no tools; llama3_json (Llama 3.1/3.2: the reply is {"name": ..., "parameters": {...}});
mistral ([TOOL_CALLS][{"name": ..., "arguments": {...}}]). Add another by implementing
ToolParser and registering it in PARSERS.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from hotprefix.grammar_build import COMPACT_JSON
from hotprefix.tokenizers.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's style for calls and Responses items: call_..., resp_..., msg_..."""
    return f"{prefix}_{secrets.token_hex(12)}"


def new_call_id() -> str:
    return new_item_id("call")


Event = tuple[str, "str | ParsedCall"]  # ("content", text) or ("call", ParsedCall)


class ToolStreamer(Protocol):
    def feed(self, delta: str) -> list[Event]:
        """Events for one more piece of generated text (text that may start a call is held)."""

    def finish(self, cut: bool = False) -> list[Event]:
        """Events for what is still held at the end. cut: the output was cut short (its
        finish reason is length): what is held (an unfinished call, or text that may
        start one) is dropped, never sent as content."""


class ToolParser(Protocol):
    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
        """(content outside the calls, or None when there is none; the calls). cut: the
        text was cut short: an unfinished call at its end is dropped, the calls before
        it are kept."""

    keeps_special_tokens: bool  # the format's marker is a special token: the text must keep it

    def streamer(self) -> ToolStreamer:
        ...

    def grammar(self, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
        """A Lark grammar (llguidance's) whose every sentence is one call in this format
        (several when parallel) to `only` or any of the tools, arguments valid for the
        function's parameters schema (tool_choice "required" or a named function)."""


def _call(body: str) -> ParsedCall | None:
    """A Hermes call body, or None when it is not one (it then stays content)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


class HermesParser:
    """<tool_call>{"name": "f", "arguments": {...}}</tool_call> blocks; a block that does
    not parse, or is not closed, stays content."""

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
        s = self.streamer()
        events = s.feed(text) + s.finish(cut)
        content = "".join(e for kind, e in events if kind == "content").strip()
        return content or None, [e for kind, e in events if kind == "call"]

    keeps_special_tokens = False

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()

    def grammar(self, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
        return call_grammar(tools, only, parallel)


class HermesStreamer:
    """HermesParser on deltas. Whitespace before a call, between calls and at the end is
    not sent (so a reply of calls alone has no content, and how the text was split into
    deltas never changes what is sent); whitespace after a call, before more text, is."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.blank = ""  # trailing whitespace held until real content follows it

    def _content(self, text: str) -> list[Event]:
        text = self.blank + text
        body = text.rstrip()
        self.blank = text[len(body):]
        return [("content", body)] if body else []

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        events: list[Event] = []
        while True:
            if not self.inside:
                i = self.buf.find(TOOL_CALL_OPEN)
                if i < 0:  # hold a tail that may be the start of a call
                    hold = _held_tail(self.buf, TOOL_CALL_OPEN)
                    events += self._content(self.buf[:len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold:]
                    return events
                events += self._content(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(TOOL_CALL_OPEN):], True
            j = self.buf.find(TOOL_CALL_CLOSE)
            if j < 0:
                return events
            body, self.buf, self.inside = self.buf[:j], self.buf[j + len(TOOL_CALL_CLOSE):], False
            call = _call(body.strip())
            if call is not None:
                self.blank = ""
                events.append(("call", call))
            else:
                events += self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)

    def finish(self, cut: bool = False) -> list[Event]:
        rest, self.buf, self.inside = (TOOL_CALL_OPEN if self.inside else "") + self.buf, "", False
        return [] if cut else self._content(rest)


def call_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's) whose every sentence is one Hermes call, or several
    when parallel, to `only` or to any of the tools, with arguments valid for the
    function's parameters schema."""
    schema = _call_schema(tools, only, "arguments")
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {calls}\n"
            f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} args {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n"
            f"args: %json {json.dumps(schema)}\n")


def _json_calls(text: str, sep: str | None) -> tuple[list[ParsedCall], str]:
    """The calls written as JSON objects ({"name": ..., "parameters" or "arguments":
    {...}}) at the start of `text`, one after another with `sep` (and whitespace)
    between them (None: one object at most), and the rest of the text after the last
    of them (a separator with no call after it belongs to the rest)."""
    dec, i, last, calls = json.JSONDecoder(), 0, 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return calls, text[last:]
        call = _call(json.dumps(obj)) if isinstance(obj, dict) else None
        if call is None:
            return calls, text[last:]
        calls.append(call)
        last, rest = i, text[i:].lstrip()
        if sep is None or not rest.startswith(sep):
            return calls, text[last:]
        i = len(text) - len(rest) + len(sep)


class _HeldStreamer:
    """A streamer for formats whose calls are known only once the output is whole: text
    before `marker(buf)` says a call may start is sent as it comes; from there on
    everything is held and parsed at the end (`parse`)."""

    def __init__(self, parser: Llama3JsonParser | MistralParser) -> None:
        self.parser, self.buf, self.held, self.sent = parser, "", False, ""

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        if self.held:
            return []
        start, hold = self.parser.call_start(self.buf, not self.sent)
        if start is not None:
            self.held = True
            out, self.buf = self.buf[:start], self.buf[start:]
        else:
            out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        self.sent += out
        return [("content", out)] if out else []

    def finish(self, cut: bool = False) -> list[Event]:
        """The held text parsed: its calls, or (when it does not parse) it as content
        (cut: dropped)."""
        if not self.held:
            rest, self.buf = self.buf, ""
            return [("content", rest)] if rest and not cut else []
        content, calls = self.parser.parse(self.buf, cut)
        if not calls and not cut:  # not calls after all: the held text is content, as it was written
            content = self.buf
        self.buf = ""
        return ([("content", content)] if content else []) + [("call", c) for c in calls]


def _held_tail(buf: str, marker: str) -> int:
    """How many of buf's last characters may be the start of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(buf)), 0, -1) if marker.startswith(buf[-n:])), 0)


class Llama3JsonParser:
    """Llama 3.1/3.2's JSON tool calls: the whole reply is {"name": "f", "parameters":
    {...}} (optionally after <|python_tag|>), several separated by "; ". A reply that
    does not start that way, or does not parse whole, is content."""

    TAG = "<|python_tag|>"
    keeps_special_tokens = False

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text.strip() or None, []
        calls, rest = _json_calls(body, ";")
        if calls and (cut or not rest.strip()):
            return None, calls
        return (None, []) if cut else (text.strip() or None, [])  # cut: a call cut short is dropped

    def call_start(self, buf: str, at_start: bool) -> tuple[int | None, int]:
        """(where a call starts in buf, or None; how much of buf's tail to hold
        meanwhile). at_start: nothing has been sent yet (calls open the reply only)."""
        head = buf.lstrip()
        if not at_start:
            return None, 0
        if head.startswith(("{", self.TAG)):
            return len(buf) - len(head), 0
        return None, len(buf) if not head or self.TAG.startswith(head) else 0  # undecided: hold it all

    def streamer(self) -> _HeldStreamer:
        return _HeldStreamer(self)

    def grammar(self, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
        return _sequence_grammar(_call_schema(tools, only, "parameters"), '"; "', "", "", parallel)


class MistralParser:
    """Mistral's tool calls: [TOOL_CALLS] then a JSON list of {"name": "f", "arguments":
    {...}}; text before the marker is content. The marker is a special token, so the
    server keeps special tokens in the text of requests with tools."""

    MARK = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
        i = text.find(self.MARK)
        if i < 0:
            return text.strip() or None, []
        body = text[i + len(self.MARK):].strip()
        listed = body.startswith("[")
        calls, rest = _json_calls(body[1:], ",") if listed else _json_calls(body, None)
        if calls and (cut or rest.strip() == ("]" if listed else "")):
            return text[:i].strip() or None, calls
        return (text[:i].strip() or None, []) if cut else (text.strip() or None, [])

    def call_start(self, buf: str, at_start: bool) -> tuple[int | None, int]:
        i = buf.find(self.MARK)
        return (i, 0) if i >= 0 else (None, _held_tail(buf, self.MARK))

    def streamer(self) -> _HeldStreamer:
        return _HeldStreamer(self)

    def grammar(self, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
        return _sequence_grammar(_call_schema(tools, only, "arguments"), '", "', json.dumps(self.MARK + "["), '"]"',
                                 parallel)


def _call_schema(tools: list[dict[str, Any]], only: str | None, args_key: str) -> dict[str, Any]:
    """The JSON schema of one call object to `only` or any of the tools, its arguments
    (under `args_key`) valid for the function's parameters schema."""
    options = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = _required_strings_filled(fn.get("parameters") or {"type": "object"})
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    return {"anyOf": options, "x-guidance": COMPACT_JSON} if len(options) > 1 else {**options[0],
                                                                                   "x-guidance": COMPACT_JSON}


SCHEMA_WALK_DEPTH = 64  # nesting followed by _required_strings_filled (request schemas are capped at 32)


def _required_strings_filled(schema: Any, depth: int = 0) -> Any:
    """A copy of a parameters schema in which every required property that is a plain
    string (no minLength of its own) has minLength 1: a forced call must fill the
    arguments its function requires, never with "" (a model that has nothing to say
    otherwise writes an empty value, which the schema alone allows). The rest is as given."""
    if depth > SCHEMA_WALK_DEPTH:
        return schema
    if isinstance(schema, list):
        return [_required_strings_filled(x, depth + 1) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _required_strings_filled(v, depth + 1) for k, v in schema.items()}
    props, required = out.get("properties"), schema.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        for name in required:
            p = props.get(name) if isinstance(name, str) else None
            if isinstance(p, dict) and p.get("type") == "string" and "minLength" not in p and "enum" not in p \
                    and "const" not in p:
                props[name] = {**p, "minLength": 1}
    return out


def _sequence_grammar(schema: dict[str, Any], sep: str, open_: str, close: str, parallel: bool) -> str:
    """A Lark grammar (llguidance's): open_, one call (several, `sep` between, when
    parallel), close."""
    calls = f"call ({sep} call)*" if parallel else "call"
    return (f"start: {open_} {calls} {close}\n".replace("  ", " ")
            + f"call: %json {json.dumps(schema)}\n")


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                  "mistral": MistralParser()}
