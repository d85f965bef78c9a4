"""Tool calls in a model's output: parsers per format, their streaming form, and the
grammar that makes `tool_choice: "required"` (or a named function) produce valid calls.

A parser turns generated text into content and calls; a streamer does the same on
deltas, holding back text that may be the start of a call. One format is built in,
Hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>), which Qwen-family
models use and which tool_prompt.py teaches models whose template has no tools; add
another by implementing ToolParser and registering it in PARSERS.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from hotprefix.engine.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from hotprefix.grammar import COMPACT_JSON


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


Event = tuple[str, "str | ParsedCall"]  # ("content", text) or ("call", ParsedCall)


class ToolStreamer(Protocol):
    def feed(self, delta: str) -> list[Event]:
        """Events for one more piece of generated text (text that may start a call is held)."""

    def finish(self) -> list[Event]:
        """Events for what is still held at the end."""


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content outside the calls, or None when there is none; the calls)."""

    def streamer(self) -> ToolStreamer:
        ...


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

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        s = self.streamer()
        events = s.feed(text) + s.finish()
        content = "".join(e for kind, e in events if kind == "content").strip()
        return content or None, [e for kind, e in events if kind == "call"]

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()


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
                    hold = next((n for n in range(min(len(TOOL_CALL_OPEN) - 1, len(self.buf)), 0, -1)
                                 if TOOL_CALL_OPEN.startswith(self.buf[-n:])), 0)
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

    def finish(self) -> list[Event]:
        rest, self.buf, self.inside = (TOOL_CALL_OPEN if self.inside else "") + self.buf, "", False
        return self._content(rest)


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser()}


def call_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's) whose every sentence is one Hermes call, or several
    when parallel, to `only` or to any of the tools, with arguments valid for the
    function's parameters schema."""
    options = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                         "arguments": fn.get("parameters") or {"type": "object"}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": options, "x-guidance": COMPACT_JSON} if len(options) > 1 else {**options[0],
                                                                                       "x-guidance": COMPACT_JSON}
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {calls}\n"
            f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} args {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n"
            f"args: %json {json.dumps(schema)}\n")
