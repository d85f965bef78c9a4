"""The request log (`serve --request-log FILE`): one JSON line per finished request.

The server writes it (serving.Serving builds a LogRow when a request ends, once;
prefix_log.PrefixRecorder adds a PrefixEntry per prompt) and `hotprefix lint` reads
it, both through the types of this module: it owns the row's fields, their JSON and
their validation.

A row: the unix time it ended, the request's id, endpoint, served model name and user,
how it ended (LogStatus), its prompt, cached and completion tokens, time to first
token, latency and finish reasons; with prefix caching, `kv` (the cache the server has:
lint replays that size) and `prefix` (per prompt: its tokens, cached tokens and
completion tokens, its keyed block-hash chain, the salt's digest and offset, and its
text with --request-log-prompts). Rows written by earlier versions of this server
have the same JSON and read the same.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

log = logging.getLogger("hotprefix.requests")

RECENT_ROWS = 10_000  # finished requests' rows kept by id (GET /requests/{id})
# What no server's row holds (a reader refuses more, rather than allocate for it):
MAX_BLOCK_SIZE = 1024  # --block-size's own limit
MAX_BLOCKS = 1 << 24  # a pool's or host tier's blocks (16.7M: more than any server has)
MAX_TOKENS = 1 << 24  # one prompt's tokens or one request's completion tokens
MAX_PROMPTS = 1 << 16  # prompts of one request
MAX_DIGEST_CHARS = 128  # one block digest, in hex
MAX_BLOCK_BYTES = 1 << 40  # one block of every layer's K and V
MAX_GROUPS = 1 << 10  # a grouped pool's KV-cache groups (one a layer at most)
_HEX = re.compile("[0-9a-f]*")
REPLAYED = "`prefix` or times"  # what lint replays: the prompts' chains, the cache, the order of arrival
_MISSING = object()


class LogStatus(str, Enum):
    """How a request ended, in its request-log line."""

    OK = "ok"
    ERROR = "error"
    CLIENT_DISCONNECTED = "client_disconnected"


class LogRowError(ValueError):
    """A JSON object that is not a request-log row; the message is one line that names
    the field (lint prefixes the file and line)."""


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _positive(x: Any) -> bool:
    return _count(x) and x >= 1


def _group_windows(x: Any) -> bool:
    """A grouped pool's windows: the full group (null), then 1 to MAX_GROUPS - 1 windows of
    1 to MAX_TOKENS tokens."""
    return (isinstance(x, list) and 2 <= len(x) <= MAX_GROUPS and x[0] is None
            and all(_positive(w) and w <= MAX_TOKENS for w in x[1:]))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _hex_list(x: Any) -> bool:
    """At most MAX_TOKENS lowercase hex strings of whole bytes, each of at most
    MAX_DIGEST_CHARS (a log's rows hold thousands: checked in C)."""
    if not isinstance(x, list) or len(x) > MAX_TOKENS:
        return False
    try:
        joined = "".join(x)
    except TypeError:  # an element that is not a string
        return False
    if any(map((1).__and__, map(len, x))) or max(map(len, x), default=0) > MAX_DIGEST_CHARS:
        return False
    return _HEX.fullmatch(joined) is not None


def _field(obj: dict[str, Any], name: str, ok: Callable[[Any], bool], what: str, group: str,
           default: Any = _MISSING, where: str = "", most: int | None = None) -> Any:
    """obj[name] if ok(it) (and, with `most`, it is at most that), else default when it is
    absent. Raises LogRowError naming it (one line: the value shown is cut short)."""
    if name not in obj and default is not _MISSING:
        return default
    value = obj.get(name, _MISSING)
    bad = value is _MISSING or not ok(value)
    if bad or (most is not None and value > most):
        shown = "missing" if value is _MISSING else f"{json.dumps(value)[:40]}"
        verb = "are" if group == REPLAYED else "is"
        must = what if bad else f"at most {most} (no server's row holds more)"
        raise LogRowError(f"a request-log row whose {group} {verb} malformed: {where}{name} must be {must}, "
                          f"got {shown}")
    return value


@dataclass(frozen=True)
class KVShape:
    """The prefix cache the server had: its block size, pool blocks and host-tier blocks,
    and the bytes of one block (None in logs older than it: lint --curve then needs the
    model); a grouped pool's KV-cache groups (core/kv_groups.py: the full group's window
    None, then the window groups'; None for one group) and its window retention interval."""

    block_size: int
    blocks: int
    host_blocks: int = 0
    block_bytes: int | None = None
    windows: tuple[int | None, ...] | None = None
    retain_every: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"block_size": self.block_size, "blocks": self.blocks, "host_blocks": self.host_blocks}
        if self.windows is not None:
            out |= {"windows": list(self.windows), "retain_every": self.retain_every}
        return out if self.block_bytes is None else {**out, "block_bytes": self.block_bytes}

    @classmethod
    def from_json(cls, obj: Any) -> KVShape:
        """Raises LogRowError."""
        kv = _field({"kv": obj}, "kv", lambda x: isinstance(x, dict), "an object", REPLAYED)
        return cls(_field(kv, "block_size", _positive, "an integer >= 1", REPLAYED, where="kv.", most=MAX_BLOCK_SIZE),
                   _field(kv, "blocks", _positive, "an integer >= 1", REPLAYED, where="kv.", most=MAX_BLOCKS),
                   _field(kv, "host_blocks", _count, "an integer >= 0", REPLAYED, 0, "kv.", MAX_BLOCKS),
                   _field(kv, "block_bytes", _positive, "an integer >= 1", REPLAYED, None, "kv.", MAX_BLOCK_BYTES),
                   _tuple(_field(kv, "windows", _group_windows, "null, then 1 to 1023 windows of 1 to 2^24 tokens",
                                 REPLAYED, None, "kv.")),
                   _field(kv, "retain_every", _count, "an integer >= 0", REPLAYED, 0, "kv.", MAX_TOKENS))


def _tuple(x: list | None) -> tuple | None:
    return None if x is None else tuple(x)


@dataclass(frozen=True)
class PrefixEntry:
    """One prompt of a request: its tokens, the tokens the cache gave it, the tokens it
    generated (its first sample's), the keyed digests of its full blocks (prompt, then
    output; None when it did not finish: its hashes are unknown), the keyed digest of its
    cache salt and the salt's offset, and its rendered text (only with --request-log-prompts)."""

    tokens: int
    cached: int
    completion: int
    blocks: tuple[str, ...] | None
    salt: str | None = None
    salt_offset: int = 0
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.tokens, "cached": self.cached, "completion": self.completion,
                               "blocks": None if self.blocks is None else list(self.blocks), "salt": self.salt}
        if self.salt is not None:
            out["salt_offset"] = self.salt_offset
        if self.text is not None:
            out["text"] = self.text
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "prefix[0].") -> PrefixEntry:
        """Raises LogRowError."""
        e = _field({"entry": obj}, "entry", lambda x: isinstance(x, dict), "an object", REPLAYED, where=where)

        def get(name: str, ok: Callable[[Any], bool], what: str, default: Any = _MISSING) -> Any:
            return _field(e, name, ok, what, REPLAYED, default, where, MAX_TOKENS if ok is _count else None)

        blocks = get("blocks", lambda x: x is None or _hex_list(x), "null or a list of hex digests", None)
        return cls(_field(e, "tokens", _positive, "an integer >= 1", REPLAYED, where=where, most=MAX_TOKENS),
                   get("cached", _count, "an integer >= 0", 0), get("completion", _count, "an integer >= 0", 0),
                   None if blocks is None else tuple(blocks),
                   get("salt", lambda x: x is None or isinstance(x, str), "null or a string", None),
                   get("salt_offset", _count, "an integer >= 0", 0), get("text", lambda x: isinstance(x, str),
                                                                         "a string", None))


@dataclass(frozen=True)
class LogRow:
    """One finished request (see the module doc). kv and prefix: with prefix caching only."""

    time: float
    request_id: str
    endpoint: str
    model: str
    user: str | None
    status: LogStatus
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    finish_reason: str | None
    kv: KVShape | None = None
    prefix: tuple[PrefixEntry, ...] | None = None

    @property
    def arrival(self) -> float:
        """When the request arrived (unix time): rows are written in the order requests end."""
        return self.time - self.latency_s

    def to_json(self) -> dict[str, Any]:
        out = {"time": self.time, "request_id": self.request_id, "endpoint": self.endpoint, "model": self.model,
               "user": self.user, "status": self.status.value, "prompt_tokens": self.prompt_tokens,
               "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
               "ttft_s": self.ttft_s, "latency_s": self.latency_s, "finish_reason": self.finish_reason}
        if self.kv is not None:
            out["kv"] = self.kv.to_json()
        if self.prefix is not None:
            out["prefix"] = [e.to_json() for e in self.prefix]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LogRow:
        """The row a JSON object holds. Raises LogRowError naming the first malformed field
        (what lint replays first: the prompts' entries, the cache, the times)."""
        entries = _field(obj, "prefix", lambda x: isinstance(x, list) and len(x) <= MAX_PROMPTS,
                         f"a list of at most {MAX_PROMPTS} prompts", REPLAYED, None)
        prefix = None if entries is None else tuple(PrefixEntry.from_json(e, f"prefix[{i}].")
                                                    for i, e in enumerate(entries))
        kv = None if obj.get("kv") is None else KVShape.from_json(obj["kv"])
        times = {name: _field(obj, name, _number, "a number", REPLAYED) for name in ("time", "latency_s")}

        def get(name: str, ok: Callable[[Any], bool], what: str) -> Any:
            return _field(obj, name, ok, what, f"`{name}`")

        def text(name: str, optional: bool = False) -> Any:
            return get(name, lambda x: isinstance(x, str) or (optional and x is None),
                       "null or a string" if optional else "a string")

        status = get("status", lambda x: x in {s.value for s in LogStatus},
                     "one of " + ", ".join(s.value for s in LogStatus))
        return cls(times["time"], text("request_id"), text("endpoint"), text("model"), text("user", True),
                   LogStatus(status), *(get(f"{k}_tokens", _count, "an integer >= 0")
                                        for k in ("prompt", "cached", "completion")),
                   get("ttft_s", lambda x: x is None or _number(x), "null or a number"), times["latency_s"],
                   text("finish_reason", True), kv, prefix)


def open_for_append(path: str) -> Any:
    """The log file opened for appending lines, after cutting a torn last row (one without
    its newline: a server killed mid-write) so that the next row starts a line of its own
    and every line stays one JSON object. Logs a warning naming the bytes dropped. Raises
    OSError as open."""
    with open(path, "ab+") as f:  # (creates it)
        end = pos = f.seek(0, os.SEEK_END)
        while pos > 0:
            step = min(pos, 1 << 16)
            f.seek(pos - step)
            cut = f.read(step).rfind(b"\n")
            if cut >= 0:
                pos = pos - step + cut + 1
                break
            pos -= step
        if pos < end:
            f.truncate(pos)
            log.warning("request log %s: dropped a torn last row (%d bytes without a newline: a server killed "
                        "while writing it)", path, end - pos)
    return open(path, "a", buffering=1)  # noqa: SIM115 - the caller keeps it


class RequestLog:
    """One line per finished request, to the log and optionally as JSON lines to a file;
    the newest `recent` rows are kept by request id (GET /requests/{id}: what a request
    used, for a gateway whose client went away). Event loop only."""

    def __init__(self, path: str | None, recent: int = RECENT_ROWS) -> None:
        self.file = open_for_append(path) if path else None  # lives as long as the app
        self.recent: OrderedDict[str, LogRow] = OrderedDict()
        self.capacity = recent
        self._waiters: dict[str, tuple[asyncio.Event, int]] = {}  # request id -> (its row is written, waiters)

    def write(self, row: LogRow) -> None:
        """Log and keep a finished request's row; wake whoever waits for it."""
        log.info("request %s %s: prompt=%d cached=%d completion=%d ttft=%s latency=%.3fs finish=%s",
                 row.request_id, row.status.value, row.prompt_tokens, row.cached_tokens, row.completion_tokens,
                 row.ttft_s, row.latency_s, row.finish_reason)
        if self.file is not None:  # one write of the whole line (a kill tears at most the last: open_for_append)
            self.file.write(json.dumps(row.to_json()) + "\n")
        # (what GET /requests/{id} tells: not its chains, nor the client's user, as long as a body allows)
        self.recent[row.request_id] = replace(row, kv=None, prefix=None, user=None)
        self.recent.move_to_end(row.request_id)
        while len(self.recent) > self.capacity:
            self.recent.popitem(last=False)
        if row.request_id in self._waiters:
            self._waiters[row.request_id][0].set()

    async def finished(self, request_id: str, wait_s: float = 0.0) -> LogRow | None:
        """The row of request `request_id`, waiting up to `wait_s` seconds for it to be
        written (the request still runs, or has not arrived yet); None if it is not."""
        if request_id in self.recent or wait_s <= 0:
            return self.recent.get(request_id)
        event, n = self._waiters.get(request_id, (asyncio.Event(), 0))
        self._waiters[request_id] = (event, n + 1)
        try:
            await asyncio.wait_for(event.wait(), wait_s)
        except TimeoutError:
            pass
        finally:
            event, n = self._waiters[request_id]
            if n > 1:
                self._waiters[request_id] = (event, n - 1)
            else:
                del self._waiters[request_id]
        return self.recent.get(request_id)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
