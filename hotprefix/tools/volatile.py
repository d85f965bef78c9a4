"""Volatile content in prompts (timestamps, ids, nonces...) and the fix that moves it
to the end of the prompt, where it no longer breaks prefix sharing.

The fix is idempotent by construction: content already where the fix puts it (the
end of the prompt, or the opening of the first user turn, next to other moved lines
only) is never moved again, so applying the fix to its own output changes nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?\s"
_ID_LABEL = (r"(?:request|req|user|usr|session|sess|trace|span|correlation|message|msg|conversation|conv|chat|"
             r"order|account|acct|customer|cust|client|ticket|case|transaction|txn|tx|job|run|device|tenant|"
             r"invoice|booking|member|patient|employee)")
_ID_PREFIX = r"(?:req|sess|usr|user|u|msg|conv|ord|order|acct|cus|cust|tkt|txn|trace|span|run|job|cmpl|chatcmpl|call)"

VOLATILE = [  # (kind, pattern), most specific first: a span taken by an earlier kind is not matched again
    ("uuid", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    ("timestamp", r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?Z|\s?[+-]\d{2}:?\d{2}|\s?UTC)?"
                  # RFC 2822 / HTTP dates: Mon, 22 Nov 2026 14:03:11 GMT
                  rf"|\b{_WEEKDAY}?\d{{1,2}} {_MONTH} \d{{4}} \d{{2}}:\d{{2}}(?::\d{{2}})?(?: (?:GMT|UTC|[+-]\d{{4}}))?"
                  # common log format: 22/Nov/2026:14:03:11 +0000
                  rf"|\b\d{{2}}/{_MONTH}/\d{{4}}:\d{{2}}:\d{{2}}:\d{{2}}(?: [+-]\d{{4}})?"
                  # Nov 22, 2026 2:03 PM / November 22, 2026 at 14:03
                  rf"|\b{_MONTH} \d{{1,2}},? \d{{4}},?(?: at)? \d{{1,2}}:\d{{2}}(?::\d{{2}})?(?:\s?[AaPp][Mm])?"),
    ("date", r"\b\d{4}-\d{2}-\d{2}\b|\b\d{4}/\d{1,2}/\d{1,2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b\d{1,2}\.\d{1,2}\.\d{4}\b"
             rf"|\b(?:{_WEEKDAY})?{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b"
             rf"|\b(?:{_WEEKDAY})?\d{{1,2}}(?:st|nd|rd|th)? (?:of )?{_MONTH},? \d{{4}}\b"),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b"),
    ("unix_time", r"\b1[5-9]\d{8}(?:\d{3})?\b"),
    # a labelled id, label included ("User ID: u-43003", "session=s_9f8e", "order #A-1234"): one span
    ("id", rf"(?i)\b{_ID_LABEL}(?:[\s_-]?(?:id|no\.?|number|ref))?\s*[:=#]?\s*#?"
           r"(?=[A-Za-z0-9_.-]*\d)[A-Za-z0-9][A-Za-z0-9_.-]{2,}[A-Za-z0-9]"
           # an id with a known prefix and no label: req-9f8e7d6c, sess_01HX..., u-43003
           rf"|\b{_ID_PREFIX}[-_](?=[A-Za-z0-9]*\d)[A-Za-z0-9]{{3,}}\b"),
    ("hex_id", r"\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{12,}\b"),
    # random tokens: base62/base64 runs of 16+ with digits and both cases (nonces, API request tokens)
    ("nonce", r"(?<![A-Za-z0-9+/_-])(?=[A-Za-z0-9+/_-]*\d)(?=[A-Za-z0-9+/_-]*[a-z])(?=[A-Za-z0-9+/_-]*[A-Z])"
              r"[A-Za-z0-9+/_-]{16,}={0,2}(?![A-Za-z0-9+/_-])"),
    ("counter", r"\b\d+\b"),
]
KINDS = tuple(k for k, _ in VOLATILE)
_PATTERNS = [(k, re.compile(p)) for k, p in VOLATILE]
_CLAUSE_END = re.compile(r"[.;!?](?=\s)|\n")


@dataclass(frozen=True)
class Volatile:
    """A span of text (character offsets) that likely differs between requests."""

    kind: str
    start: int
    end: int
    text: str


def find_volatile(text: str) -> list[Volatile]:
    """Non-overlapping volatile spans of text in order, the most specific kind winning."""
    taken: list[Volatile] = []
    for kind, pat in _PATTERNS:
        for m in pat.finditer(text):
            if m.end() > m.start() and not any(m.start() < v.end and v.start < m.end() for v in taken):
                taken.append(Volatile(kind, m.start(), m.end(), m.group()))
    return sorted(taken, key=lambda v: v.start)


def _special_pattern(specials: Collection[str]) -> re.Pattern | None:
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) if specials else None


def content_end(text: str, specials: Collection[str] = ()) -> int:
    """Where the prompt's last content ends: before the trailing special tokens, role
    names and whitespace of a rendered chat prompt ("...?<|im_end|>\n<|im_start|>assistant\n"
    ends after the "?"); the end of text without special tokens."""
    pat = _special_pattern(specials)
    if pat is None:
        return len(text)
    marks = [(m.start(), m.end()) for m in pat.finditer(text)]
    pos = len(text)
    while True:
        pos = len(text[:pos].rstrip())
        mark = next(((s, e) for s, e in reversed(marks) if e <= pos), None)
        if mark is None:
            return pos
        between = text[mark[1]:pos]
        if between and (len(between) > 24 or not re.fullmatch(r"[A-Za-z_]+", between)):
            return pos  # real content (a role name is one short word right after a special token)
        pos = mark[0]


def clause(text: str, v: Volatile, specials: Collection[str] = ()) -> tuple[int, int]:
    """The clause around a span (character offsets): from the line's start, or the end of
    the sentence before it, to the end of its own sentence or line, never across a special
    token. This is what moves: the label ("Current time:") travels with the value."""
    start = text.rfind("\n", 0, v.start) + 1
    for m in _CLAUSE_END.finditer(text, start, v.start):
        start = m.end()
    m = _CLAUSE_END.search(text, v.end)
    end = len(text) if m is None else (m.end() if m.group() != "\n" else m.start())
    pat = _special_pattern(specials)
    if pat is not None:
        for sm in pat.finditer(text, start, end):
            if sm.end() <= v.start:
                start = sm.end()
            elif sm.start() >= v.end:
                end = sm.start()
                break
    while start < v.start and text[start] in " \t":
        start += 1
    return start, end


# -- request bodies ------------------------------------------------------------------


def texts(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(location, text) of every editable text of a request body, in prompt order."""
    if "messages" in body:
        return [(f"messages.{i}", m["content"]) for i, m in enumerate(body["messages"])
                if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return [("prompt", body["prompt"])] if isinstance(body.get("prompt"), str) else []


def set_text(body: dict[str, Any], loc: str, text: str) -> None:
    """Replace the text at loc (from `texts`). Mutates body."""
    if loc == "prompt":
        body["prompt"] = text
    else:
        body["messages"][int(loc.split(".")[1])]["content"] = text


class Placement(Enum):
    """Where the fix puts volatile content: the end of the prompt's content, or the start
    of the first user turn (after a shared system prompt, before the conversation, so a
    conversation's own turns keep sharing their history)."""

    END = "end"
    FIRST_TURN = "first_turn"


_USER_TURN = r"user(?:{specials})?[ \t]*\n*"


def first_turn(body: dict[str, Any], specials: Collection[str] = ()) -> tuple[str, int] | None:
    """(location, offset) where the first user turn's content starts: its message, or in a
    rendered prompt, after the first special token + "user" header; None when there is none."""
    if "messages" in body:
        return next(((f"messages.{i}", 0) for i, m in enumerate(body["messages"])
                     if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)), None)
    pat = _special_pattern(specials)
    if pat is None or not isinstance(body.get("prompt"), str):
        return None
    m = re.search(f"(?:{pat.pattern}){_USER_TURN.format(specials=pat.pattern)}", body["prompt"])
    return None if m is None else ("prompt", m.end())


def placed(body: dict[str, Any], loc: str, v: Volatile, specials: Collection[str] = ()) -> bool:
    """Whether a span is where the fix would put it already: at the end of the prompt (in
    the last text, followed up to the end of the content only by lines that hold volatile
    content too), or opening the first user turn (with other moved lines only before it)."""
    text = dict(texts(body))[loc]
    s, e = clause(text, v, specials)
    spot = first_turn(body, specials)
    if spot is not None and spot[0] == loc and spot[1] <= s:
        before = text[spot[1]:s]
        if all(not line.strip() or find_volatile(line) for line in before.split("\n")):
            return True
    all_texts = texts(body)
    if all_texts[-1][0] != loc:
        return False
    rest = text[e:max(content_end(text, specials), v.end)]
    return all(not line.strip() or find_volatile(line) for line in rest.split("\n"))


def move(body: dict[str, Any], loc: str, v: Volatile, where: Placement,
         specials: Collection[str] = ()) -> dict[str, Any]:
    """A copy of body with the clause around span v (in the text at loc) moved to `where`,
    on a line of its own. A span already placed (see `placed`), or a placement the body
    has no room for, gives the same body back: the fix is idempotent."""
    if placed(body, loc, v, specials):
        return body
    out = json.loads(json.dumps(body))
    text = dict(texts(out))[loc]
    s, e = clause(text, v, specials)
    moved = text[s:e].strip()
    if e < len(text) and text[e] == "\n" and (s == 0 or text[s - 1] == "\n"):
        e += 1  # a whole line: its newline goes with it
    elif e < len(text) and text[e] == " ":
        e += 1  # a sentence: the space after it goes with it
    set_text(out, loc, text[:s] + text[e:])
    if where is Placement.FIRST_TURN:
        spot = first_turn(out, specials)
        if spot is None:
            return body
        target = dict(texts(out))[spot[0]]
        set_text(out, spot[0], f"{target[:spot[1]]}{moved}\n{target[spot[1]:]}")
        return out
    last_loc, last_text = texts(out)[-1]
    end = content_end(last_text, specials)
    set_text(out, last_loc, f"{last_text[:end].rstrip()}\n{moved}{last_text[end:]}")
    return out


def spans_of(body: dict[str, Any]) -> list[tuple[str, Volatile]]:
    """(location, span) of every volatile span in the body's texts."""
    return [(loc, v) for loc, text in texts(body) for v in find_volatile(text)]
