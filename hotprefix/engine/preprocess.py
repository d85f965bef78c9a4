"""Preprocessing workers: render chat templates, tokenize and compile output constraints
off the event loop, within a time budget, each tenant within its share of the workers.

Every worker thread works on its own tokenizer copy (tokenizers/prompt_encoder.py),
made when the pool starts, so no request pays for one. The shares live on the event
loop: a tenant (RequestOptions.tenant) holds at most half of the workers, so that one
tenant's slow requests (constraints to compile) never hold every worker; and at most all
workers but one compile a new output constraint at once, whoever sends them, so that
many tenants' new constraints never hold every worker either.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hotprefix.config import AdmissionConfig
from hotprefix.engine.prepare import PreparedRequest
from hotprefix.engine.requests import ChatPrompt, Prompt, RequestOptions
from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hotprefix.engine.llm_engine import LLMEngine


class TenantShares:
    """How many workers each tenant holds now, and how many compile a new output constraint
    (event loop only; `busy` has no entry for a tenant that holds none)."""

    def __init__(self, workers: int, timeout: float) -> None:
        self.workers = workers
        self.timeout = timeout
        self.busy: dict[str, int] = {}
        self.compiling = 0
        self.compile_cap = max(1, workers - 1)  # the global compile budget: one worker stays for the rest
        self._freed = asyncio.Condition()

    def cap(self, tenant: str | None) -> int:
        """Workers one tenant may hold at a time: half of them (at least one); all of them
        for a request that is no tenant's."""
        return max(1, self.workers // 2) if tenant else self.workers

    def _blocked(self, tenant: str | None, counted: bool, compiles: bool) -> str | None:
        """Why the request may not take a worker now (None: it may)."""
        if counted and self.busy.get(tenant, 0) >= self.cap(tenant):
            return "this tenant's other requests held its share of the preprocessing workers"
        if compiles and self.compiling >= self.compile_cap:
            return "other requests' new output constraints held the workers that may compile one"
        return None

    async def take(self, tenant: str | None, compiles: bool = False) -> Callable[[], None] | None:
        """Wait for a worker within the tenant's share (and, for a request whose output
        constraint is not compiled yet, within the compile budget: at most all workers but
        one compile at once) and count it; returns what frees it (None where nothing is
        counted: the request just queues for a thread). Raises InvalidRequestError when the
        wait outlasts --preprocess-timeout."""
        counted = tenant is not None and self.cap(tenant) < self.workers
        if not counted and not compiles:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        async with self._freed:
            while (why := self._blocked(tenant, counted, compiles)) is not None:
                try:
                    await asyncio.wait_for(self._freed.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise InvalidRequestError(f"{why} for {self.timeout:g}s (--preprocess-timeout); send fewer "
                                              "at once") from None
            if counted:
                self.busy[tenant] = self.busy.get(tenant, 0) + 1
            self.compiling += compiles
        return lambda: self.give(tenant if counted else None, compiles)

    def give(self, tenant: str | None, compiled: bool = False) -> None:
        """The tenant's worker (and its compile slot) is free again (when its thread
        finishes, even after its request timed out); wakes the waiters."""
        if tenant is not None:
            left = self.busy.pop(tenant) - 1
            if left:
                self.busy[tenant] = left
        self.compiling -= compiled

        async def notify() -> None:
            async with self._freed:
                self._freed.notify_all()

        asyncio.get_running_loop().create_task(notify())


class Preprocessor:
    """The worker pool and the shares. `prepare` and `run` are called on the event loop;
    what they run reads only what never changes after the engine's start-up."""

    def __init__(self, engine: LLMEngine, limits: AdmissionConfig) -> None:
        self._engine = engine
        self._timeout = limits.preprocess_timeout
        self._max_scoring = limits.max_scoring_tokens
        self._pool = ThreadPoolExecutor(limits.preprocess_workers, thread_name_prefix="hotprefix-prep")
        self.shares = TenantShares(limits.preprocess_workers, limits.preprocess_timeout)
        self._copy_tokenizers(limits.preprocess_workers)

    def _copy_tokenizers(self, n: int) -> None:
        """Make every worker's own tokenizer copy now (PromptEncoder: about 0.1-0.3 s
        each), not during the first requests: each task holds its thread at a barrier
        until all have started, so that every worker thread takes one."""
        barrier = threading.Barrier(n)

        def copy() -> None:
            _ = self._engine.encoder.tokenizer
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:  # a worker slow to start: it copies on first use
                pass

        for f in [self._pool.submit(copy) for _ in range(n)]:
            f.result()

    async def prepare(self, base_id: str, prompts: Sequence[Prompt], params: SamplingParams,
                      options: RequestOptions) -> list[PreparedRequest]:
        """Render, tokenize and validate each prompt (engine request ids base_id-0, -1, ...)
        in a worker within the tenant's share and the time budget. Raises InvalidRequestError."""
        def work() -> list[PreparedRequest]:
            return [self._engine.prepare_request(f"{base_id}-{i}", self.render(p), params, options)
                    for i, p in enumerate(prompts)]

        so = params.structured
        compiles = so is not None and so.grammar is None and self._engine.grammars.compiles(so)
        release = await self.shares.take(options.tenant, compiles)
        states = await self.run(work, release)
        self._check_scoring(states, params)
        return states

    def _check_scoring(self, states: list[PreparedRequest], params: SamplingParams) -> None:
        """A request asking for its prompts' logprobs carries them in each of its n choices:
        its prompt tokens times n stay within --max-scoring-tokens. Raises InvalidRequestError."""
        if params.prompt_logprobs is None:
            return
        tokens = sum(len(st.prompt_token_ids) for st in states)
        if tokens * params.n > self._max_scoring:
            raise InvalidRequestError(
                f"prompt logprobs over {tokens} prompt tokens x n={params.n} = {tokens * params.n} tokens is more "
                f"than --max-scoring-tokens {self._max_scoring}; send a shorter prompt or a smaller n",
                "n" if params.n > 1 else "prompt")

    def render(self, prompt: Prompt) -> str | list[int]:
        """A prompt as the engine takes it: a conversation's token ids, else as given. Raises
        InvalidRequestError. Worker threads."""
        if isinstance(prompt, ChatPrompt):
            return self._engine.encode_chat(prompt.messages, prompt.add_generation_prompt,
                                            prompt.continue_final_message, prompt.chat_template,
                                            prompt.template_kwargs, prompt.tools, prompt.operator_messages)
        return prompt

    async def run(self, fn: Callable[[], Any], done: Callable[[], None] | None = None) -> Any:
        """fn() on a worker; done() (on the event loop) once the thread has finished it.
        Raises InvalidRequestError when it takes longer than the budget (the thread
        finishes its bounded work, and its result is dropped)."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        if done is not None:
            fut.add_done_callback(lambda _: done())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self._timeout)  # fut runs on
        except asyncio.TimeoutError:
            raise InvalidRequestError(f"preparing the prompt took longer than {self._timeout:g}s "
                                      "(--preprocess-timeout); send a shorter prompt") from None

    def close(self) -> None:
        """Stop taking work (a running task finishes; queued ones are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
