"""The edge of the server and the gateway: every request body is bounded, read and
checked once, before any handler (or FastAPI's own parser) sees it.

Refused, each with an OpenAI error object:
- 413: a body (by Content-Length or as read) over the limit;
- 400: a JSON body that is not UTF-8, not JSON, not an object, nested deeper than
  MAX_DEPTH, holds NaN/Infinity (not JSON, though Python's parser takes them),
  an integer of more than 4,300 digits, or a string (key or value) with a lone
  surrogate (no tokenizer, hash or database takes those).

A pure ASGI middleware (no torch, no Starlette BaseHTTPMiddleware): the checked
body is replayed to the app, and later `receive()` calls reach the client, so
handlers still see a disconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from hotprefix.server.http_errors import error_body

MAX_DEPTH = 64
BODY_METHODS = ("POST", "PUT", "PATCH")
CHECK_OFF_LOOP_BYTES = 64 << 10  # larger bodies are parsed and walked in a worker thread


class BodyRejected(ValueError):
    """Why a body is refused: status (400 or 413) and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _no_constants(name: str) -> Any:
    raise BodyRejected(400, f"invalid JSON body: {name} is not a JSON number")


def _where(path: list[str | int]) -> str:
    """A JSON path for messages (lone surrogates in keys shown escaped)."""
    out = ""
    for p in path:
        p = p if isinstance(p, int) else p.encode("utf-8", "backslashreplace").decode()
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "the body"


def _lone_surrogate(s: str) -> int | None:
    """Where `s` holds a lone surrogate (which no tokenizer, hash or database takes), or None."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_json_value(value: Any) -> None:
    """Raise BodyRejected if `value` (parsed JSON) nests deeper than MAX_DEPTH or
    holds a string (key or value) with a lone surrogate. Iterative, and only
    containers are stacked: any depth and any size are safe to walk."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise BodyRejected(400, f"the JSON body nests deeper than {MAX_DEPTH} levels")
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else [((), v)]
        for k, item in items:
            for s, where in ((k, path + (k,)), (item, path + (k,))):
                if isinstance(s, str) and (at := _lone_surrogate(s)) is not None:
                    raise BodyRejected(400, f"{_where(list(where))}: the string holds a lone surrogate at "
                                            f"character {at}; send valid Unicode")
            if isinstance(item, (dict, list)):
                stack.append((item, path + (k,)))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or BodyRejected(400) saying what is wrong with it."""
    try:
        value = json.loads(raw, parse_constant=_no_constants)
    except BodyRejected:
        raise
    except RecursionError:
        raise BodyRejected(400, f"the JSON body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, not UTF-8, an integer of > 4300 digits
        raise BodyRejected(400, f"invalid JSON body: {e}") from None
    if not isinstance(value, dict):
        raise BodyRejected(400, "the request body must be a JSON object")
    check_json_value(value)
    return value


def is_json(content_type: str) -> bool:
    """What FastAPI parses as JSON: no content type, or a */json or */*+json one."""
    main = content_type.split(";", 1)[0].strip().lower()
    return not main or main.endswith("/json") or main.endswith("+json")


Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyGuard:
    """ASGI middleware: bound, read and check request bodies (see the module doc).
    on_reject(reason) is called for each refusal ("body_too_large" or "invalid")."""

    def __init__(self, app: Any, max_bytes: int, on_reject: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            body = await self._read(headers, receive)
            if body is None:  # the client went away while sending
                return
            if body and is_json(headers.get("content-type", "")):
                if len(body) > CHECK_OFF_LOOP_BYTES:  # the walk is Python: it yields the GIL to the loop
                    await asyncio.to_thread(parse_json_object, body)
                else:
                    parse_json_object(body)
        except BodyRejected as e:
            if self.on_reject is not None:
                self.on_reject("body_too_large" if e.status == 413 else "invalid")
            await _reply(send, e.status, str(e))
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, headers: dict[str, str], receive: Any) -> bytes | None:
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise BodyRejected(400, "invalid Content-Length header")
            if int(length) > self.max_bytes:
                raise BodyRejected(413, self._too_large())
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyRejected(413, self._too_large())
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (--max-request-body-bytes)"


async def _reply(send: Send, status: int, message: str) -> None:
    type_ = "RequestEntityTooLargeError" if status == 413 else "BadRequestError"
    body = json.dumps(error_body(message, type_, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
