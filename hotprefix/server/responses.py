"""A streaming response that always ends what it streams, the wait for a client that
leaves, and the error that says it left (shared by the server and the gateway)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

DISCONNECT_POLL_S = 0.1  # how often a waiting handler asks whether its client is still there


class ClientGone(Exception):
    """The client went away before its (non-streamed) answer: an ordinary end, answered
    with nothing (HTTP 499, which no one reads) and logged at INFO, never as an error."""


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone away (polled every DISCONNECT_POLL_S)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that, however it ends (finished, the client gone before
    the first byte or in the middle, an error, a server shutdown), closes its body
    iterator and then calls `on_close()` (synchronous; must not raise). Starlette
    alone abandons an iterator it never started, and one it cancels is finalized
    only when garbage collected: a request could run on with no reader."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self.on_close()
