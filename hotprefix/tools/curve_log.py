"""A request log (`serve --request-log`) read for its hit-rate curve: prompts as the cache
sees them, in arrival order, and little else, so that a log of a million rows fits.

Rows are read one at a time through `LogRow.from_json` (the one owner of their fields
and their errors, which name the line); of each prompt only its block digests (each
distinct digest held once, however many prompts share it), its token counts and its
tenant (the digest of its cache salt) are kept. The log's first `kv` gives the block
size, the pool and the host tier the server had; a row of another block size (two
servers' logs in one file) is refused, since digests of different block sizes never
match. Request bodies (OpenAI's, without hashes) are returned as they are: they need
the model's tokenizer (lint's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotprefix.cachecurve.request import SimRequest
from hotprefix.config import ConfigError
from hotprefix.server.request_log import KVShape, LogRow, LogRowError
from hotprefix.tools.jsonl import MAX_LINE_BYTES, MAX_ROWS, iter_objects


@dataclass
class LogTraffic:
    """What a log file held: its prompts in arrival order with their tenants, the cache
    its server had, the time from its first arrival to its last end; or request bodies."""

    reqs: list[SimRequest] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)
    kv: KVShape | None = None
    span_s: float | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)


def read_log(path: Path, max_line_bytes: int = MAX_LINE_BYTES, max_rows: int = MAX_ROWS) -> LogTraffic:
    """Read a request log or a file of request bodies (within iter_objects' bounds: lint's
    --max-line-bytes and --max-rows). Raises ConfigError naming the line of a row that is
    neither, or of one whose blocks are of another size than the first's."""
    out = LogTraffic()
    rows: list[tuple[float, int, list[SimRequest], list[str | None]]] = []
    digests: dict[str, str] = {}
    end = None
    for i, obj in iter_objects(path, max_line_bytes, max_rows):
        if "prefix" not in obj:
            if "request_id" not in obj and ("messages" in obj or "prompt" in obj):
                out.bodies.append(obj)
                continue
            raise ConfigError(f"{path}:{i}: neither a request-log row with block hashes (`prefix`; a server with "
                              "prefix caching writes them) nor a request body (`messages` or `prompt`)")
        try:
            row = LogRow.from_json(obj)
        except LogRowError as e:
            raise ConfigError(f"{path}:{i}: {e}") from None
        out.kv = out.kv or row.kv
        if row.kv is not None and out.kv is not None and row.kv.block_size != out.kv.block_size:
            raise ConfigError(f"{path}:{i}: blocks of {row.kv.block_size} tokens in a log of "
                              f"{out.kv.block_size}-token blocks (two servers' logs?): split it by server")
        entries = [e for e in row.prefix or () if e.blocks is not None]
        rows.append((row.arrival, i, [SimRequest(tuple(map(digests.setdefault, e.blocks or (), e.blocks or ())),
                                                 e.tokens, e.completion or 1) for e in entries],
                     [e.salt for e in entries]))
        end = row.time if end is None else max(end, row.time)
    if out.bodies and rows:
        raise ConfigError(f"{path}: mixes request bodies and request-log rows")
    rows.sort(key=lambda r: r[:2])
    for _, _, reqs, tenants in rows:
        out.reqs += reqs
        out.tenants += tenants
    if rows and end is not None:
        out.span_s = end - rows[0][0]
    return out
