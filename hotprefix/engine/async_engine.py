"""The async engine's facade: what HTTP handlers call, on the event loop.

It puts together, each in its own module:
- admission.Admission: the one queue limit (sequences waiting for their first token);
- preprocess.Preprocessor: the worker threads that render chat templates, tokenize and
  compile constraints within a time budget, each tenant within its share;
- engine_loop.EngineLoop: the engine thread, which alone queues, aborts and steps the
  LLMEngine and runs `call()`ed functions between steps;
- streams.StreamTable: the RequestStreams the engine thread's outputs reach.

The event loop reads only what never changes after start-up (vocabulary, block size,
max_model_len) and tokenizes nothing itself beyond single tokens. Every tokenizer call
runs on a per-thread copy (tokenizers.prompt_encoder.PromptEncoder), so no thread waits
on another's tokenization. Engine request ids are made here and never reused.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hotprefix.config import AdmissionConfig, SchedulingPolicy
from hotprefix.core.hashing import UNSALTED
from hotprefix.engine.admission import Admission
from hotprefix.engine.counters import EngineCounters, LiveStats
from hotprefix.engine.engine_loop import Abort, Add, EngineDeadError, EngineLoop
from hotprefix.engine.llm_engine import LLMEngine, RequestOutput
from hotprefix.engine.prepare import check_token_ids
from hotprefix.engine.preprocess import Preprocessor
from hotprefix.engine.requests import DEFAULT_OPTIONS, CacheScope, ChatPrompt, Prompt, RequestOptions
from hotprefix.engine.streams import RequestStream, StreamTable
from hotprefix.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "CacheScope", "ChatPrompt", "EngineDeadError", "Prompt", "RequestOptions",
           "RequestStream"]


class AsyncEngine:
    """Drives an LLMEngine on a background thread; the facade HTTP handlers use.

    Start it from the event loop that will consume its streams. `loop` comes from
    `load()`: an engine thread that built the engine and waits for `start()`."""

    def __init__(self, engine: LLMEngine, limits: AdmissionConfig | None = None,
                 loop: EngineLoop | None = None) -> None:
        self._engine = engine
        self.limits = limits or AdmissionConfig()
        self._core = loop or EngineLoop(engine)
        self._admission = Admission(self.limits.max_num_queued_requests)
        self._streams = StreamTable(self._admission, self.abort)
        self._prep = Preprocessor(engine, self.limits)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token_texts: dict[int, str] = {}  # token_text's answers (at most the vocabulary)

    # -- lifecycle ----------------------------------------------------------
    @classmethod
    def load(cls, build: Callable[[], LLMEngine], limits: AdmissionConfig | None = None) -> AsyncEngine:
        """Build the engine on the engine thread itself and return once it is built
        (re-raising what `build` raised); `start()` then runs the loop on that thread.

        Torch work on one thread only: OpenMP keeps a team of threads per thread
        that starts parallel regions, and on two cores a second, idle team (the
        main thread's, had it loaded or warmed the model) made every step on the
        engine thread about 2x slower (decode 37 ms -> 16 ms a token without it).
        """
        core = EngineLoop.load(build)
        return cls(core.engine, limits, core)

    def start(self) -> None:
        """Start the step loop on the engine thread (call from the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._core.start(self._loop, self._streams)

    async def shutdown(self) -> None:
        """Stop the thread after the current step; unfinished requests end with EngineDeadError."""
        await self._core.stop()
        # the disk tier's queued writes (the engine thread has stopped)
        await asyncio.get_running_loop().run_in_executor(None, self._engine.close)
        self._prep.close()
        self._streams.fail_all(EngineDeadError("the server is shutting down"))

    @property
    def counters(self) -> EngineCounters:
        return self._core.counters

    @property
    def live(self) -> LiveStats:
        """What the scheduler holds now (replaced by the engine thread after each step)."""
        return self._core.live

    @property
    def dead(self) -> BaseException | None:
        """What killed the engine thread, if it died."""
        return self._core.dead

    @property
    def num_queued(self) -> int:
        """Sequences admitted with no output yet."""
        return self._admission.num_queued

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        """Started and not dead: requests are accepted (queued during the warm-up)."""
        return self._core.is_alive

    def wait_dead(self, timeout: float | None = None) -> bool:
        """Block until the engine thread dies (a lost tensor-parallel rank, a broken loop)
        or `timeout` passes; whether it died. Any thread."""
        return self._core.died.wait(timeout)

    @property
    def is_running(self) -> bool:
        """Alive and warmed up (what /health reports)."""
        return self.is_alive and self._core.is_ready

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
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block (all layers, K and V)."""
        return self._engine.runner.plan.bytes_per_block

    @property
    def kv_groups(self) -> tuple[tuple[int | None, ...], int]:
        """The pool's KV-cache groups' windows ((None,): one group; core/kv_groups.py) and its
        window retention interval (--kv-window-retain-interval)."""
        return self._engine.runner.plan.windows, self._engine.config.cache.kv_window_retain_interval

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
                     options: RequestOptions = DEFAULT_OPTIONS) -> list[RequestStream]:
        """Admit, preprocess (off the loop) and queue one engine request per prompt;
        returns their streams, which the caller must close (iterating to the end
        closes them). Raises before anything is queued: InvalidRequestError (bad
        input, or more sequences than the queue ever holds), QueueFullError (the
        queue limit is reached now) or EngineDeadError."""
        self._check_alive()
        weight = len(prompts) * params.n
        self._admission.admit(weight)
        try:
            states = await self._prep.prepare(f"{request_id}-{next(self._ids):x}", prompts, params, options)
            if options.pin_prefix:
                for st in states:  # early 400; enqueue checks again on the engine thread
                    await self.call(lambda e, st=st: e.check_pin_room(st.prompt_token_ids, options.cache_scope))
            self._check_alive()
        except BaseException:
            self._admission.release(weight)
            raise
        streams = self._streams.open(states)
        self._core.put(Add(states))
        return streams

    async def render(self, prompts: Sequence[Prompt], params: SamplingParams,
                     options: RequestOptions = DEFAULT_OPTIONS) -> list[list[int]]:
        """The token ids each prompt would run as: rendered, tokenized, truncated and checked
        as `submit` does it (in a worker, within the tenant's share), queuing nothing.
        Raises InvalidRequestError."""
        self._check_alive()
        states = await self._prep.prepare(f"render-{next(self._ids):x}", prompts, params, options)
        return [st.prompt_token_ids for st in states]

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       options: RequestOptions = DEFAULT_OPTIONS) -> AsyncIterator[RequestOutput]:
        """submit() one prompt, then its outputs; cancelling the consumer aborts the request."""
        (stream,) = await self.submit(request_id, [prompt], params, options)
        async for out in stream:
            yield out

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request in any state (a no-op once it finished)."""
        self._core.put(Abort(request_id))

    def check_chat_template(self, template: str) -> None:
        """Render a tiny conversation with `template` (at start-up, so a broken
        --chat-template fails the start, not the first request). Raises InvalidRequestError."""
        self._engine.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result or raise its error."""
        self._check_alive()
        return await self._core.call(fn)

    # -- facade for handlers (event loop) -------------------------------------------------------------
    async def tokenize(self, prompt: str | ChatPrompt, add_special_tokens: bool = True,
                       split_special_tokens: bool = False) -> list[int]:
        """Token ids of text (or of a conversation, rendered), in a worker. Raises InvalidRequestError."""
        if isinstance(prompt, ChatPrompt):
            return await self._prep.run(lambda: list(self._prep.render(prompt)))
        return await self._prep.run(lambda: self._engine.tokenize(prompt, add_special_tokens, split_special_tokens))

    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids, in a worker. Raises InvalidRequestError for an id out of range."""
        check_token_ids(ids, self.vocab_size, "tokens")
        return await self._prep.run(lambda: self._engine.detokenize(ids))

    def prompt_text(self, ids: list[int]) -> str:
        """A prompt's text, special tokens kept (the request log), on this thread's tokenizer copy."""
        return self._engine.detokenize(ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token (for logprobs: an echoed prompt asks for every one of its
        tokens), decoded once per token id on this thread's tokenizer copy."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._engine.detokenize([token_id])
        return text

    def prefix_hashes(self, ids: list[int], scope: CacheScope = UNSALTED) -> list:
        """The block hashes of a prompt's full blocks (pure: no engine state). Raises
        InvalidRequestError for a token id out of range."""
        return self._engine.prefix_hashes(ids, scope)

    async def pin(self, ids: list[int], scope: CacheScope) -> int:
        """Pin a cached prompt's full blocks (see LLMEngine.pin); the blocks newly pinned."""
        return await self.call(lambda e: e.pin(ids, scope))

    async def unpin(self, ids: list[int], scope: CacheScope) -> int:
        """Release a prompt's pin; the blocks no longer pinned."""
        return await self.call(lambda e: e.unpin(ids, scope))

    async def reset_prefix_cache(self) -> int:
        return await self.call(lambda e: e.reset_prefix_cache())
