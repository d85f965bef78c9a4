"""The streams of engine requests, on the event loop: what the engine thread's outputs reach.

A RequestStream lives on the event loop; StreamTable, its owner, fills it with what
the engine thread posts (`deliver`, called through loop.call_soon_threadsafe).
Engine request ids are fresh (AsyncEngine.submit makes them), so an output can never
reach a stream it does not belong to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hotprefix.engine.admission import Admission
from hotprefix.engine.outputs import RequestOutput
from hotprefix.engine.prepare import PreparedRequest


@dataclass(eq=False)
class RequestStream:
    """The outputs of one engine request, in step order. Iterating ends after the
    finished output (or raises the error that ended it); closing it early, or
    cancelling the consumer, aborts the request. Lives on the event loop.

    on_close(stream, abort) is its owner's (StreamTable's): called at every close,
    with abort=True while the engine has not sent its last item."""

    on_close: Callable[[RequestStream, bool], None]
    request_id: str
    prompt_token_ids: list[int]
    weight: int  # sequences it counts against the queue limit until its first output
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # the consumer has seen the end, or closed it
    started: bool = False  # a first output arrived: it no longer counts as queued
    ended: bool = False  # the engine has sent its last item

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it ended; stop counting it. Idempotent."""
        self.finished = True
        self.on_close(self, not self.ended)


class StreamTable:
    """The open streams by engine request id (event loop only). A stream leaves the
    table at its last item or when it is closed; its weight leaves the queued count
    (Admission) at its first item or its close, once. abort(request_id) asks the engine
    thread to abort a request whose stream closed before its end."""

    def __init__(self, admission: Admission, abort: Callable[[str], None]) -> None:
        self._admission = admission
        self._abort = abort
        self._open: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, states: list[PreparedRequest]) -> list[RequestStream]:
        """A stream for each prepared request, in the table (its weight: its samples)."""
        streams = [RequestStream(self._closed, st.request_id, st.prompt_token_ids, len(st.children))
                   for st in states]
        for s in streams:
            self._open[s.request_id] = s
        return streams

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand an output (or the error that ends it) to its stream, if it is still open."""
        stream = self._open.get(request_id)
        if stream is None:
            return
        self._mark_started(stream)
        if isinstance(item, BaseException) or item.finished:
            stream.ended = True
            del self._open[request_id]
        stream.queue.put_nowait(item)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with `error`."""
        for rid in list(self._open):
            self.deliver(rid, error)

    def _closed(self, stream: RequestStream, abort: bool) -> None:
        """A stream is closed: stop counting it as queued, drop it, abort it if it runs."""
        if self._open.pop(stream.request_id, None) is not None:
            self._mark_started(stream)
        if abort:
            stream.ended = True
            self._abort(stream.request_id)

    def _mark_started(self, stream: RequestStream) -> None:
        """The stream no longer waits for its first output (it has it, or it closed):
        its sequences leave the queued count, once."""
        if not stream.started:
            stream.started = True
            self._admission.release(stream.weight)
