"""The async engine: the step loop on a background thread, outputs streamed to asyncio.

Threads and what they own:
- the engine thread owns the LLMEngine: it alone queues, aborts and steps, and
  runs `call()`ed functions between steps;
- preprocessing workers (a small pool) render chat templates and tokenize client
  input, within a time budget, so nothing slow runs on the event loop;
- the event loop owns admission (how many sequences wait for their first token:
  the one queue limit) and the streams; it reads only what never changes after
  start-up (vocabulary, block size, max_model_len) and tokenizes nothing itself
  beyond single tokens.

Every tokenizer call runs on a per-thread copy (tokenizers.prompt_encoder.PromptEncoder),
so no thread waits on another's tokenization. Engine request ids are made here
and never reused, so an output can never reach a stream it does not belong to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hotprefix.config import AdmissionConfig, SchedulingPolicy
from hotprefix.engine.counters import EngineCounters, LiveStats
from hotprefix.engine.llm_engine import LLMEngine, PreparedRequest, RequestOutput, check_token_ids
from hotprefix.engine.requests import ChatPrompt, Prompt, RequestOptions, RequestStream
from hotprefix.errors import InvalidRequestError, QueueFullError
from hotprefix.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "ChatPrompt", "EngineDeadError", "Prompt", "RequestOptions", "RequestStream"]

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


# -- commands to the engine thread ---------------------------------------------------------------
@dataclass(frozen=True)
class _Add:
    states: list[PreparedRequest]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass(frozen=True)
class _Wake:
    pass


_Command = _Add | _Abort | _Call | _Wake


class AsyncEngine:
    """Drives an LLMEngine on a background thread; the facade HTTP handlers use.

    Start it from the event loop that will consume its streams. `thread`/`go`
    come from `load()`: a thread that built the engine and waits for `go` to
    run the step loop."""

    def __init__(self, engine: LLMEngine, limits: AdmissionConfig | None = None,
                 thread: threading.Thread | None = None, go: threading.Event | None = None) -> None:
        self._engine = engine
        self.limits = limits or AdmissionConfig()
        self.counters = EngineCounters()
        self.live = LiveStats()  # replaced (never mutated) by the engine thread
        self.num_queued = 0  # sequences admitted with no output yet (event loop only)
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread
        self._go = go or threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()  # set once the engine thread has warmed the model up
        self._workers = ThreadPoolExecutor(self.limits.preprocess_workers, thread_name_prefix="hotprefix-prep")
        self._owner_busy: dict[str, int] = {}  # workers each owner (a tenant's cache salt) holds (event loop)
        self._owner_freed = asyncio.Condition()
        self._copy_tokenizers()
        self.dead: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------
    def _copy_tokenizers(self) -> None:
        """Make every preprocessing worker's own tokenizer copy now (PromptEncoder: about
        0.1-0.3 s each), not during the first requests: each task holds its thread at a
        barrier until all have started, so that every worker thread takes one."""
        n = self.limits.preprocess_workers
        barrier = threading.Barrier(n)

        def copy() -> None:
            _ = self._engine.encoder.tokenizer
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:  # a worker slow to start: it copies on first use
                pass

        for f in [self._workers.submit(copy) for _ in range(n)]:
            f.result()

    @classmethod
    def load(cls, build: Callable[[], LLMEngine], limits: AdmissionConfig | None = None) -> AsyncEngine:
        """Build the engine on the engine thread itself and return once it is built
        (re-raising what `build` raised); `start()` then runs the loop on that thread.

        Torch work on one thread only: OpenMP keeps a team of threads per thread
        that starts parallel regions, and on two cores a second, idle team (the
        main thread's, had it loaded or warmed the model) made every step on the
        engine thread about 2x slower (decode 37 ms -> 16 ms a token without it).
        """
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
            me: AsyncEngine = box["self"]
            if not me._stop.is_set():
                me._run()

        thread = threading.Thread(target=bootstrap, name="hotprefix-engine", daemon=True)
        thread.start()
        built.wait()
        if "error" in box:
            raise box["error"]
        box["self"] = cls(box["engine"], limits, thread, go)
        return box["self"]

    def start(self) -> None:
        """Start the step loop on the engine thread (call from the running event loop)."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hotprefix-engine", daemon=True)
            self._thread.start()
        self._go.set()

    async def shutdown(self) -> None:
        """Stop the thread after the current step; unfinished requests end with EngineDeadError."""
        self._stop.set()
        self._go.set()
        self._cmds.put(_Wake())
        if self._thread is not None and self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._engine is not None:  # the disk tier's queued writes (the engine thread has stopped)
            await asyncio.get_running_loop().run_in_executor(None, self._engine.close)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._fail_streams(EngineDeadError("the server is shutting down"))

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

    # -- what never changes after start-up (safe from any thread) -------------------------------------
    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.arch.vocab_size

    @property
    def block_size(self) -> int:
        return self._engine.kv.block_size

    @property
    def default_sampling(self) -> dict[str, float | int]:
        """Sampling defaults from the model's generation config (see ModelConfig)."""
        return self._engine.default_sampling

    @property
    def scheduling_policy(self) -> SchedulingPolicy:
        return self._engine.config.scheduler.scheduling_policy

    def cache_info(self) -> dict[str, str]:
        """The KV cache's configuration, as labels of hotprefix:cache_config_info."""
        plan, cc = self._engine.runner.plan, self._engine.config.cache
        return {"block_size": str(plan.block_size), "num_gpu_blocks": str(plan.num_blocks),
                "cache_dtype": plan.dtype_name, "enable_prefix_caching": str(cc.enable_prefix_caching),
                "prefix_caching_hash_algo": cc.prefix_caching_hash_algo,  # host tier blocks, as vLLM's CPU blocks:
                "num_cpu_blocks": str(self._engine.kv.tiers.host.num_slots if self._engine.kv.tiers else 0)}

    # -- requests -------------------------------------------------------------
    async def submit(self, request_id: str, prompts: Sequence[Prompt], params: SamplingParams,
                     options: RequestOptions | None = None) -> list[RequestStream]:
        """Admit, preprocess (off the loop) and queue one engine request per prompt;
        returns their streams, which the caller must close (iterating to the end
        closes them). Raises before anything is queued: InvalidRequestError (bad
        input, or more sequences than the queue ever holds), QueueFullError (the
        queue limit is reached now) or EngineDeadError."""
        options = options or RequestOptions()
        self._check_alive()
        weight = len(prompts) * params.n
        self._admit(weight)
        self.num_queued += weight
        try:
            states = await self._preprocess(request_id, prompts, params, options)
            if options.pin_prefix:
                for st in states:  # early 400; enqueue checks again on the engine thread
                    await self.call(lambda e, st=st: e.check_pin_room(st.prompt_token_ids, options.cache_salt,
                                                                      options.cache_salt_offset))
            self._check_alive()
        except BaseException:
            self.num_queued -= weight
            raise
        streams = [RequestStream(self._forget, st.request_id, st.prompt_token_ids, len(st.children))
                   for st in states]
        for s in streams:
            self._streams[s.request_id] = s
        self._cmds.put(_Add(states))
        return streams

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       options: RequestOptions | None = None) -> AsyncIterator[RequestOutput]:
        """submit() one prompt, then its outputs; cancelling the consumer aborts the request."""
        (stream,) = await self.submit(request_id, [prompt], params, options)
        async for out in stream:
            yield out

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")

    def _admit(self, weight: int) -> None:
        limit = self.limits.max_num_queued_requests
        if weight > limit:
            raise InvalidRequestError(f"this request asks for {weight} sequences (prompts x n), more than the "
                                      f"{limit} the server queues at once (--max-num-queued-requests)", "n")
        if self.num_queued + weight > limit:
            raise QueueFullError(f"the server has {self.num_queued} sequences waiting for their first token, and "
                                 f"this request would exceed the limit of {limit} (--max-num-queued-requests); "
                                 "try again later")

    async def _preprocess(self, request_id: str, prompts: Sequence[Prompt], params: SamplingParams,
                          options: RequestOptions) -> list[PreparedRequest]:
        """Render and tokenize in a worker thread, within the time budget."""
        base = f"{request_id}-{next(self._ids):x}"

        def work() -> list[PreparedRequest]:
            return [self._engine.prepare_request(f"{base}-{i}", self._render(p), params, options.priority,
                                                options.add_special_tokens, options.cache_salt,
                                                options.cache_salt_offset, options.pin_prefix,
                                                options.split_special_tokens, options.truncate_prompt_tokens)
                    for i, p in enumerate(prompts)]

        owner = options.cache_salt or ""
        if self._share_cap(owner) >= self.limits.preprocess_workers:  # no share to keep: queue for a thread
            return await self._in_worker(work)
        await self._take_share(owner)
        return await self._in_worker(work, lambda: self._give_share(owner))

    def _share_cap(self, owner: str) -> int:
        """Preprocessing workers one owner may hold at a time: half of them (at least one)
        for an owner with a cache salt (a gateway tenant), so that one tenant's slow
        requests (constraints to compile) never hold every worker; all for the rest."""
        n = self.limits.preprocess_workers
        return max(1, n // 2) if owner else n

    async def _take_share(self, owner: str) -> None:
        """Wait for a worker within the owner's share. Raises InvalidRequestError when the
        wait outlasts --preprocess-timeout."""
        cap = self._share_cap(owner)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.preprocess_timeout
        async with self._owner_freed:
            while self._owner_busy.get(owner, 0) >= cap:
                try:
                    await asyncio.wait_for(self._owner_freed.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise InvalidRequestError(f"this tenant's other requests held its share of the preprocessing "
                                              f"workers for {self.limits.preprocess_timeout:g}s "
                                              "(--preprocess-timeout); send fewer at once") from None
            self._owner_busy[owner] = self._owner_busy.get(owner, 0) + 1

    def _give_share(self, owner: str) -> None:
        """The owner's worker is free again (when its thread finishes, even after its
        request timed out). Event loop."""
        left = self._owner_busy.pop(owner) - 1
        if left:
            self._owner_busy[owner] = left

        async def notify() -> None:
            async with self._owner_freed:
                self._owner_freed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    def _render(self, prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, ChatPrompt):
            return self._engine.encode_chat(prompt.messages, prompt.add_generation_prompt,
                                           prompt.continue_final_message, prompt.chat_template,
                                           prompt.template_kwargs, prompt.tools, prompt.operator_messages)
        return prompt

    async def _in_worker(self, fn: Callable[[], Any], done: Callable[[], None] | None = None) -> Any:
        """fn() on a preprocessing thread; done() (on the event loop) once the thread has
        finished it. Raises InvalidRequestError when it takes longer than the budget (the
        thread finishes its bounded work, and its result is dropped)."""
        fut = asyncio.get_running_loop().run_in_executor(self._workers, fn)
        if done is not None:
            fut.add_done_callback(lambda _: done())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.limits.preprocess_timeout)  # fut runs on
        except asyncio.TimeoutError:
            raise InvalidRequestError(f"preparing the prompt took longer than {self.limits.preprocess_timeout:g}s "
                                      "(--preprocess-timeout); send a shorter prompt") from None

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request in any state (a no-op once it finished)."""
        self._cmds.put(_Abort(request_id))

    def _forget(self, stream: RequestStream, abort: bool) -> None:
        """A stream is closed: stop counting it as queued, drop it, abort it if it runs."""
        if self._streams.pop(stream.request_id, None) is not None:
            self._mark_started(stream)
        if abort:
            stream.ended = True
            self.abort(stream.request_id)

    def check_chat_template(self, template: str) -> None:
        """Render a tiny conversation with `template` (at start-up, so a broken
        --chat-template fails the start, not the first request). Raises InvalidRequestError."""
        self._engine.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result or raise its error."""
        self._check_alive()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._cmds.put(_Call(fn, fut))
        return await fut

    # -- facade for handlers (event loop) -------------------------------------------------------------
    async def tokenize(self, prompt: str | ChatPrompt, add_special_tokens: bool = True,
                       split_special_tokens: bool = False) -> list[int]:
        """Token ids of text (or of a conversation, rendered), in a worker. Raises InvalidRequestError."""
        if isinstance(prompt, ChatPrompt):
            return await self._in_worker(lambda: list(self._render(prompt)))
        return await self._in_worker(lambda: self._engine.tokenize(prompt, add_special_tokens, split_special_tokens))

    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids, in a worker. Raises InvalidRequestError for an id out of range."""
        check_token_ids(ids, self.vocab_size, "tokens")
        return await self._in_worker(lambda: self._engine.detokenize(ids))

    def prompt_text(self, ids: list[int]) -> str:
        """A prompt's text, special tokens kept (the request log), on this thread's tokenizer copy."""
        return self._engine.detokenize(ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token (cheap; for logprobs), on this thread's tokenizer copy."""
        return self._engine.detokenize([token_id])

    def prefix_hashes(self, ids: list[int], cache_salt: str | None = None, cache_salt_offset: int = 0) -> list:
        """The block hashes of a prompt's full blocks (pure: no engine state)."""
        return self._engine.prefix_hashes(ids, cache_salt, cache_salt_offset)

    async def pin(self, ids: list[int], cache_salt: str | None, cache_salt_offset: int) -> int:
        return await self.call(lambda e: e.pin(ids, cache_salt, cache_salt_offset))

    async def unpin(self, ids: list[int], cache_salt: str | None, cache_salt_offset: int) -> int:
        return await self.call(lambda e: e.unpin(ids, cache_salt, cache_salt_offset))

    async def reset_prefix_cache(self) -> int:
        return await self.call(lambda e: e.reset_prefix_cache())

    # -- the engine thread ----------------------------------------------------------
    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """On the loop: hand an output to its stream (if it is still open)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._mark_started(stream)
        if isinstance(item, BaseException) or item.finished:
            stream.ended = True
            del self._streams[request_id]
        stream.queue.put_nowait(item)

    def _mark_started(self, stream: RequestStream) -> None:
        """The stream no longer waits for its first output (it has it, or it closed):
        its sequences leave the queued count, once. The one place that count goes down."""
        if not stream.started:
            stream.started = True
            self.num_queued -= stream.weight

    def _fail_streams(self, error: BaseException) -> None:
        """On the loop: end every open stream with `error`."""
        for rid in list(self._streams):
            self._deliver(rid, error)

    def _set_future(self, fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(done)

    def _handle(self, cmd: _Command) -> None:
        match cmd:
            case _Add(states):
                for st in states:
                    try:
                        self._engine.enqueue(st)
                    except Exception as e:  # the pin limit filled up since admission
                        self._post(st.request_id, e)
            case _Abort(request_id):
                self._engine.abort_request(request_id)
            case _Call(fn, fut):
                try:
                    self._set_future(fut, fn(self._engine), None)
                except Exception as e:
                    self._set_future(fut, None, e)
            case _Wake():
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
        """On the engine thread: a new LiveStats from the scheduler."""
        sched = self._engine.scheduler
        self.live = LiveStats(len(sched.running), len(sched.waiting), len(sched.swapped), sched.kv.usage(),
                              sched.num_preemptions, self._engine.tier_gauges())

    def _run(self) -> None:
        try:
            self._engine.warmup()  # here, not on the main thread: see load()
            _ = self._engine.encoder.tokenizer  # this thread's copy (detokenizing), before the first request
            self._ready.set()
            while not self._stop.is_set():
                self._drain(block=not self._engine.has_unfinished_requests())
                if not self._engine.has_unfinished_requests():
                    continue
                try:
                    outs = self._engine.step(self._publish)
                except Exception as e:  # a bug in scheduling: fail what is in flight, keep serving
                    log.exception("engine step failed; failing the requests in flight")
                    self.counters.step_errors += 1
                    outs = self._engine.fail_all(e)
                self.counters.add(self._engine.scheduler.make_stats())
                self._publish()
                for out in outs:
                    self._post(out.request_id, out)
        except BaseException as e:  # pragma: no cover - the loop itself broke
            self.dead = e
            log.exception("the engine thread died")
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_streams, EngineDeadError(str(e)))
