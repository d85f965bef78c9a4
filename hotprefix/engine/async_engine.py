"""The async engine: the step loop on a background thread, outputs streamed to asyncio.

The engine thread owns the LLMEngine: it alone queues, aborts and steps. The
event loop validates and tokenizes a request (so a bad request fails at once,
before any response is started), then hands it over through a command queue;
each step's outputs come back through per-request asyncio queues. Model compute
runs off the event loop, so the server keeps answering while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hotprefix.core.scheduler import QueueFullError
from hotprefix.core.stats import SchedulerStats
from hotprefix.engine.llm_engine import LLMEngine, RequestOutput
from hotprefix.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass
class EngineCounters:
    """Totals since start, accumulated on the engine thread after every step (the
    counters /metrics exports; gauges are read live from the scheduler)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    evicted_blocks: int = 0
    step_errors: int = 0

    def add(self, st: SchedulerStats) -> None:
        self.prefix_cache_queries += st.prefix_cache.queries
        self.prefix_cache_hits += st.prefix_cache.hits
        self.evicted_blocks += st.prefix_cache.evicted_blocks


class RequestStream:
    """The outputs of one request, in step order. Iterating ends after the
    finished output; closing it early (or cancelling the consumer) aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_token_ids: list[int]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

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
        """Abort the request unless it finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        self.engine._streams.pop(self.request_id, None)


class AsyncEngine:
    """Drives an LLMEngine on a background thread. Start it from the event loop
    that will consume its streams."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.counters = EngineCounters()
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._not_started: set[str] = set()  # accepted, no token yet (touched on both threads under the GIL)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()  # set once the engine thread has warmed the model up
        self.dead: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------
    @classmethod
    def load(cls, build: Callable[[], LLMEngine], max_queued_requests: int | None = None) -> AsyncEngine:
        """Build the engine on the engine thread itself and return once it is built
        (re-raising what `build` raised); `start()` then runs the loop on that thread.

        Torch work on one thread only: OpenMP keeps a team of threads per thread
        that starts parallel regions, and on two cores a second, idle team (the
        main thread's, had it loaded or warmed the model) made every step on the
        engine thread about 2x slower (decode 37 ms -> 16 ms a token without it).
        """
        self = cls.__new__(cls)
        built = threading.Event()
        box: dict[str, Any] = {}
        self._go = threading.Event()

        def bootstrap() -> None:
            try:
                box["engine"] = build()
                box["engine"].warmup()
            except BaseException as e:  # reported to the caller
                box["error"] = e
                built.set()
                return
            built.set()
            self._go.wait()
            if not self._stop.is_set():
                self._run()

        thread = threading.Thread(target=bootstrap, name="hotprefix-engine", daemon=True)
        thread.start()
        built.wait()
        if "error" in box:
            raise box["error"]
        cls.__init__(self, box["engine"], max_queued_requests)
        self._thread = thread
        return self

    def start(self) -> None:
        """Start the step loop on the engine thread (call from the running event loop)."""
        self._loop = asyncio.get_running_loop()
        if self._thread is not None:  # built by load(): its thread waits for this
            self._go.set()
            return
        self._thread = threading.Thread(target=self._run, name="hotprefix-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the thread after the current step; unfinished requests are aborted."""
        self._stop.set()
        if getattr(self, "_go", None) is not None:
            self._go.set()
        self._cmds.put(("wake",))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for s in list(self._streams.values()):
            s.queue.put_nowait(EngineDeadError("the server is shutting down"))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        """Started and not dead: requests are accepted (queued during the warm-up)."""
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def is_running(self) -> bool:
        """Alive and warmed up (what /health reports)."""
        return self.is_alive and self._ready.is_set()

    # -- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    **kwargs: Any) -> RequestStream:
        """Validate and submit a request; returns its stream. Raises
        InvalidRequestError (bad input), QueueFullError (too many requests
        waiting for their first token) or EngineDeadError, before anything is queued."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        if request_id in self._streams:
            from hotprefix.errors import InvalidRequestError

            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        limit = self.max_queued_requests
        if limit is not None and len(self._not_started) >= limit:
            raise QueueFullError(f"the server has {len(self._not_started)} queued requests, the limit "
                                 "(--max-num-queued-requests); try again later")
        prepared = self.engine.prepare_request(request_id, prompt, params, **kwargs)
        stream = RequestStream(self, request_id, prepared.prompt_token_ids)
        self._streams[request_id] = stream
        self._not_started.add(request_id)
        self._cmds.put(("add", prepared))
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """add_request, then its outputs; cancelling the consumer aborts the request."""
        async for out in self.add_request(request_id, prompt, params, **kwargs):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request in any state (thread-safe; a no-op once it finished)."""
        self._not_started.discard(request_id)
        self._cmds.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result or raise its error."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._cmds.put(("call", fn, fut))
        return await fut

    # -- the engine thread ----------------------------------------------------------
    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _set_future(self, fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(done)

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            prepared = cmd[1]
            try:
                self.engine.enqueue(prepared)
            except Exception as e:  # queue full or duplicate id: tell the consumer
                self._not_started.discard(prepared.request_id)
                self._post(prepared.request_id, e)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fn, fut = cmd
            try:
                self._set_future(fut, fn(self.engine), None)
            except Exception as e:
                self._set_future(fut, None, e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.2) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            self.engine.warmup()  # here, not on the main thread: see load()
            self._ready.set()
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outs = self.engine.step()
                except Exception as e:  # a bug or a device error: fail the requests in flight, keep serving
                    log.exception("engine step failed; aborting the requests in flight")
                    self.counters.step_errors += 1
                    for rid in list(self._streams):
                        self.engine.abort_request(rid)
                        self._post(rid, e)
                    continue
                self.counters.add(self.engine.scheduler.make_stats())
                for out in outs:
                    self._not_started.discard(out.request_id)
                    self._post(out.request_id, out)
        except BaseException as e:  # pragma: no cover - the loop itself broke
            self.dead = e
            log.exception("the engine thread died")
            for rid in list(self._streams):
                self._post(rid, EngineDeadError(str(e)))
