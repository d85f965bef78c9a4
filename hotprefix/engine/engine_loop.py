"""The engine thread: it alone queues, aborts and steps the LLMEngine, and runs the
functions the event loop hands it (`call`) between steps.

The event loop talks to it only through commands on a queue (Add, Abort, Call, Wake);
it talks back only through loop.call_soon_threadsafe: outputs to the StreamTable, results
of calls to their futures, and a new LiveStats (replaced, never mutated) after each step
and each batch of commands.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hotprefix.engine.counters import EngineCounters, LiveStats
from hotprefix.engine.outputs import RequestOutput
from hotprefix.engine.prepare import PreparedRequest
from hotprefix.engine.streams import StreamTable
from hotprefix.errors import PeerLostError

if TYPE_CHECKING:
    from hotprefix.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


# -- commands to the engine thread ---------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    states: list[PreparedRequest]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass(frozen=True)
class Wake:
    pass


Command = Add | Abort | Call | Wake


class EngineLoop:
    """The engine thread and its command queue. `thread`/`go` come from `load()`: a
    thread that built the engine and waits for `go` to run the loop; without them,
    `start()` starts a thread. `live`, `counters` and `dead` are written by the engine
    thread and read anywhere."""

    def __init__(self, engine: LLMEngine, thread: threading.Thread | None = None,
                 go: threading.Event | None = None) -> None:
        self.engine = engine
        spec = engine.config.scheduler.speculative_config
        self.counters = EngineCounters(spec_accepted_per_pos=[0] * spec.max_draft_tokens if spec else None)
        self.live = LiveStats()  # replaced (never mutated) by the engine thread
        self.dead: BaseException | None = None
        self.died = threading.Event()  # set with `dead` (the server exits: launcher.serve)
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = thread
        self._go = go or threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()  # set once the engine thread has warmed the model up
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: StreamTable | None = None

    @classmethod
    def load(cls, build: Callable[[], LLMEngine]) -> EngineLoop:
        """Build the engine on a new thread, which then waits for `start()` to run the
        loop; returns once it is built, re-raising what `build` raised. Torch work on one
        thread only: see AsyncEngine.load."""
        built, go = threading.Event(), threading.Event()
        box: dict[str, Any] = {}

        def bootstrap() -> None:
            try:
                engine = build()
                engine.warmup()
            except BaseException as e:  # reported to the caller
                box["error"] = e
                built.set()
                return
            box["engine"] = engine
            built.set()
            go.wait()
            me: EngineLoop = box["self"]
            if not me._stop.is_set():
                me._run()

        thread = threading.Thread(target=bootstrap, name="hotprefix-engine", daemon=True)
        thread.start()
        built.wait()
        if "error" in box:
            raise box["error"]
        box["self"] = cls(box["engine"], thread, go)
        return box["self"]

    # -- the event loop's side -----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, streams: StreamTable) -> None:
        """Run the loop on the engine thread; outputs go to `streams` on `loop`."""
        self._loop, self._streams = loop, streams
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hotprefix-engine", daemon=True)
            self._thread.start()
        self._go.set()

    async def stop(self) -> None:
        """Stop the thread after the current step and wait for it."""
        self._stop.set()
        self._go.set()
        self._cmds.put(Wake())
        if self._thread is not None and self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def is_alive(self) -> bool:
        """Started and not dead."""
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def is_ready(self) -> bool:
        """The engine thread has warmed the model up."""
        return self._ready.is_set()

    def put(self, cmd: Command) -> None:
        self._cmds.put(cmd)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result or raise its error."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._cmds.put(Call(fn, fut))
        return await fut

    # -- the engine thread ---------------------------------------------------------------
    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if self._loop is not None and self._streams is not None:
            self._loop.call_soon_threadsafe(self._streams.deliver, request_id, item)

    def _set_future(self, fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(done)

    def _handle(self, cmd: Command) -> None:
        match cmd:
            case Add(states):
                for st in states:
                    try:
                        self.engine.enqueue(st)
                    except Exception as e:  # the pin limit filled up since admission
                        self._post(st.request_id, e)
            case Abort(request_id):
                self.engine.abort_request(request_id)
            case Call(fn, fut):
                try:
                    self._set_future(fut, fn(self.engine), None)
                except Exception as e:
                    self._set_future(fut, None, e)
            case Wake():
                pass

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
                self._publish()  # aborts and adds change the queues between steps
                return

    def _publish(self) -> None:
        """A new LiveStats from the scheduler."""
        sched = self.engine.scheduler
        self.live = LiveStats(len(sched.running), len(sched.waiting), len(sched.swapped), sched.kv.usage(),
                              sched.num_preemptions, self.engine.tier_gauges())

    def _step(self) -> None:
        """One step, its stats and its outputs. A failed step (a bug in scheduling) fails
        what is in flight; the loop keeps serving."""
        try:
            outs = self.engine.step(self._publish)
        except PeerLostError:
            raise  # (_run: the engine is dead)
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self.counters.step_errors += 1
            outs = self.engine.fail_all(e)
        self.counters.add(self.engine.scheduler.make_stats())
        self._publish()
        for out in outs:
            self._post(out.request_id, out)

    def _run(self) -> None:
        try:
            self.engine.warmup()  # here, not on the main thread: see AsyncEngine.load
            _ = self.engine.encoder.tokenizer  # this thread's copy (detokenizing), before the first request
            self._ready.set()
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self.engine.publish_kv_events()  # (what the disk tier wrote while idle)
        except BaseException as e:  # a lost tensor-parallel rank, or the loop itself broke
            self.dead = e
            self.died.set()
            log.exception("the engine thread died")
            if self._loop is not None and self._streams is not None:
                self._loop.call_soon_threadsafe(self._streams.fail_all, EngineDeadError(str(e)))
