"""A backend's answer on its way to the client: read whole and passed on, or its SSE
stream relayed, trimmed to what the client asked for. What the answer says of its usage
and finish goes into the request's Outcome; the request ends (InFlight.end) once the
answer is through. Streams always ask the backend for usage on every chunk, so a client
that disconnects is billed for exactly the tokens the gateway received."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from fastapi import Request
from fastapi.responses import Response

from hotprefix.gateway.errors import GatewayError
from hotprefix.gateway.routing import Backend
from hotprefix.gateway.store import UsageStatus
from hotprefix.gateway.usage import InFlight, Outcome
from hotprefix.server.protocol import StreamOptions
from hotprefix.server.responses import wait_disconnect


@dataclass(eq=False)
class Upstream:
    """A backend's response being read, counted in the backend's in-flight load
    until closed (once)."""

    resp: httpx.Response
    backend: Backend
    closed: bool = False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.inflight -= 1
            await self.resp.aclose()


def trim_chunk(obj: dict[str, Any], want_usage: bool, want_continuous: bool) -> dict[str, Any] | None:
    """A stream chunk as the client asked for it: the gateway always asks the
    backend for usage on every chunk; None drops the chunk."""
    if not obj.get("choices") and "usage" in obj:
        return obj if want_usage else None  # the final usage-only chunk
    if "usage" in obj and not want_continuous:
        obj = dict(obj)
        if want_usage:
            obj["usage"] = None
        else:
            del obj["usage"]
    return obj


def sse_error(message: str, status: int = 502) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": "BadGatewayError", "param": None,
                                            "code": status}}) + "\n\n"


async def answer(up: Upstream, flight: InFlight, headers: dict[str, str], timeout_s: float,
                 reader: StreamReader) -> Response:
    """A non-streamed answer, read whole and passed on (`reader` takes its usage and
    finish). Raises GatewayError (a timeout: 504, a broken answer: 502)."""
    o = flight.outcome
    try:
        data = await up.resp.aread()
    except httpx.TimeoutException:
        o.status, o.http_status = UsageStatus.TIMEOUT, 504
        raise GatewayError(504, f"the backend did not finish within {timeout_s:g}s",
                           "GatewayTimeoutError") from None
    except httpx.HTTPError as e:
        raise GatewayError(502, f"the backend failed mid-answer: {type(e).__name__}", "BadGatewayError") from None
    finally:
        await up.close()
    o.http_status = o.answered = up.resp.status_code
    o.status = UsageStatus.OK if o.http_status == 200 else UsageStatus.ERROR
    o.ttft_s = time.monotonic() - flight.t0
    try:
        parsed = json.loads(data)
        if isinstance(parsed, dict) and o.http_status == 200:
            reader.take(parsed, o)
        elif isinstance(parsed, dict):  # an error answer is charged its usage, if it has one, else nothing
            o.take_usage(parsed.get("usage"))
    except ValueError:
        pass
    await flight.end()
    return Response(data, status_code=o.http_status, headers=headers,
                    media_type=up.resp.headers.get("content-type", "application/json"))


class StreamReader(Protocol):
    """How a backend's stream reaches the client (one per request): each line as the client
    gets it (None: dropped; it takes the stream's usage and finish into the outcome), whether
    the stream ended complete, and whether it ended with the backend's own error (`failed`:
    no answer, settled by the backend's count), what is sent after it, and an error event
    of the format."""

    done: bool
    failed: bool
    end: str

    def line(self, line: str, flight: InFlight) -> str | None:
        ...

    def take(self, answer: dict[str, Any], outcome: Outcome) -> None:
        """A whole (non-streamed) answer's usage and finish into `outcome`."""

    def error(self, message: str) -> str:
        ...


class ChatReader:
    """Completions and chat chunks (`data: {...}`), trimmed to what the client asked for
    (`opts`: the gateway always asks the backend for usage on every chunk); complete at
    `data: [DONE]`, which is sent at the end."""

    end = "data: [DONE]\n\n"
    failed = False  # (a chat stream's error chunk comes after usage on every chunk)

    def __init__(self, opts: StreamOptions | None) -> None:
        self.want = (bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats))
        self.done = False

    def line(self, line: str, flight: InFlight) -> str | None:
        if line.startswith("data: ") and line[6:].strip() == "[DONE]":
            self.done = True
            return None
        return _relayed(line, flight, *self.want)

    def take(self, answer: dict[str, Any], outcome: Outcome) -> None:
        outcome.take_usage(answer.get("usage"))
        outcome.take_choices(answer.get("choices"))

    def error(self, message: str) -> str:
        return sse_error(message)


async def relay(request: Request, up: Upstream, reader: StreamReader, flight: InFlight) -> AsyncIterator[str]:
    """The backend's SSE stream as `reader` passes it on. A watcher notices a disconnect
    even while the backend sends nothing, and closes the upstream connection so that the
    backend aborts too."""
    o = flight.outcome
    o.status, o.http_status = UsageStatus.CLIENT_ABORTED, 200
    gone = asyncio.Event()

    async def watch() -> None:
        await wait_disconnect(request)
        gone.set()
        await up.close()
        flight.end_soon()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        async for line in up.resp.aiter_lines():
            if (text := reader.line(line, flight)) is not None:
                yield text
        done = reader.done
        ok = done and not reader.failed
        o.status = UsageStatus.OK if ok else UsageStatus.ERROR if done else UsageStatus.BACKEND_ERROR
        o.answered = 200 if ok else None  # a stream cut short or failed is settled by the backend's count
        await up.close()
        await flight.end()
        yield reader.end if done else reader.error("the backend ended the stream early")
    except httpx.HTTPError as e:
        if gone.is_set():  # the watcher closed the upstream under us: the client's abort
            return
        o.status = UsageStatus.TIMEOUT if isinstance(e, httpx.TimeoutException) else UsageStatus.BACKEND_ERROR
        await up.close()
        await flight.end()
        yield reader.error(f"the backend failed mid-stream: {type(e).__name__}")
    finally:
        watcher.cancel()
        await up.close()


def _relayed(line: str, flight: InFlight, want_usage: bool, want_continuous: bool) -> str | None:
    """One line of the backend's stream as the client gets it (None: dropped); the
    request's outcome takes its usage and finish reason."""
    if not line.startswith("data: "):
        return None
    try:
        obj = json.loads(line[6:])
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    o = flight.outcome
    o.take_usage(obj.get("usage"))
    o.take_choices(obj.get("choices"))
    if obj.get("choices"):
        o.chunks += 1
        o.ttft_s = o.ttft_s or time.monotonic() - flight.t0
    obj = trim_chunk(obj, want_usage, want_continuous)
    return None if obj is None else f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
