"""What `hotprefix lint` reads: OpenAI request bodies or the server's request log, one per
line, every input bounded (tools/jsonl.py: each line's bytes, the rows; request_log.LogRow:
each size a row states), every error one line naming the line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.server.request_log import MAX_TOKENS, LogRow, LogRowError, PrefixEntry
from hotprefix.tools.cache_sim import CacheSize
from hotprefix.tools.jsonl import MAX_LINE_BYTES, MAX_ROWS, iter_objects

MAX_TOKEN_ID = 1 << 31


@dataclass(frozen=True)
class LogInput:
    """What a file held: request bodies (each with its line), or the server's log rows
    (prompt entries in arrival order, and the cache the server had, if the log says)."""

    bodies: list[tuple[int, dict[str, Any]]]
    entries: list[PrefixEntry]
    block_size: int | None = None
    size: CacheSize | None = None


def body_problem(body: dict[str, Any]) -> str | None:
    """What makes `body` a request lint cannot read (None: nothing): `messages` a list of
    objects with a string role and text content, or `prompt` text or token ids; a
    `cache_salt` a string, its offset a token count."""
    salt, offset = body.get("cache_salt"), body.get("cache_salt_offset", 0)
    if not (salt is None or isinstance(salt, str)) or not (
            offset is None or (isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset <= MAX_TOKENS)):
        return "`cache_salt` must be a string and `cache_salt_offset` a token count"
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "`messages` must be a non-empty list"
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{j}] must be an object with a string `role`"
            c = m.get("content")
            if not (c is None or isinstance(c, str) or (isinstance(c, list) and all(
                    isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in c))):
                return f"messages[{j}].content must be text, a list of text parts, or null"
        return None
    p = body.get("prompt")
    if isinstance(p, str):
        return None
    if isinstance(p, list) and len(p) <= MAX_TOKENS and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in p):
        return None
    return "`prompt` must be text or a list of token ids"


def read_requests(path: Path, max_line_bytes: int = MAX_LINE_BYTES, max_rows: int = MAX_ROWS) -> LogInput:
    """OpenAI request bodies, or `hotprefix serve --request-log` rows (request_log.LogRow),
    one per line (see iter_objects for the bounds). Raises ConfigError naming the line of
    a row that is neither, or that is malformed."""
    bodies: list[tuple[int, dict[str, Any]]] = []
    rows: list[tuple[float, int, LogRow]] = []
    for i, obj in iter_objects(path, max_line_bytes, max_rows):
        if "prefix" in obj:
            try:
                row = LogRow.from_json(obj)
            except LogRowError as e:
                raise ConfigError(f"{path}:{i}: {e}") from None
            rows.append((row.arrival, i, row))
        elif "request_id" in obj and "prompt_tokens" in obj:
            raise ConfigError(f"{path}:{i}: a request-log row without block hashes (a server without prefix "
                              "caching, or older than this lint)")
        elif "messages" in obj or "prompt" in obj:
            if (problem := body_problem(obj)) is not None:
                raise ConfigError(f"{path}:{i}: a request body whose {problem}")
            bodies.append((i, obj))
        else:
            raise ConfigError(f"{path}:{i}: neither `messages` nor `prompt`")
    return _input(path, bodies, rows)


def _input(path: Path, bodies: list[tuple[int, dict[str, Any]]], rows: list[tuple[float, int, LogRow]]) -> LogInput:
    if bodies and rows:
        raise ConfigError(f"{path}: mixes request bodies and request-log rows")
    if not bodies and not rows:
        raise ConfigError(f"{path}: no requests")
    entries = [e for _, _, row in sorted(rows, key=lambda t: t[:2]) for e in row.prefix or ()
               if e.blocks is not None]
    if rows and not entries:
        raise ConfigError(f"{path}: no request-log row carries block hashes")
    kv = next((row.kv for _, _, row in rows if row.kv is not None), None)
    size = None if kv is None else CacheSize(kv.blocks, kv.host_blocks, "from the log", kv.windows or (None,),
                                             kv.retain_every)
    return LogInput(bodies, entries, kv.block_size if kv else None, size)
