"""Preprocessing workers: render chat templates, tokenize and compile output constraints
off the event loop, within a time budget, each tenant within its share of the workers.

Every worker thread works on its own tokenizer copy (tokenizers/prompt_encoder.py),
made when the pool starts, so no request pays for one. The shares live on the event
loop: a tenant (RequestOptions.tenant) holds at most half of the workers, so that one
tenant's slow requests (constraints to compile) never hold every worker.
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
    """How many workers each tenant holds now (event loop only; `busy` has no entry for a
    tenant that holds none)."""

    def __init__(self, workers: int, timeout: float) -> None:
        self.workers = workers
        self.timeout = timeout
        self.busy: dict[str, int] = {}
        self._freed = asyncio.Condition()

    def cap(self, tenant: str | None) -> int:
        """Workers one tenant may hold at a time: half of them (at least one); all of them
        for a request that is no tenant's."""
        return max(1, self.workers // 2) if tenant else self.workers

    async def take(self, tenant: str | None) -> Callable[[], None] | None:
        """Wait for a worker within the tenant's share and count it; returns what frees it
        (None where the share is every worker: nothing to count, the request just queues
        for a thread). Raises InvalidRequestError when the wait outlasts --preprocess-timeout."""
        cap = self.cap(tenant)
        if tenant is None or cap >= self.workers:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        async with self._freed:
            while self.busy.get(tenant, 0) >= cap:
                try:
                    await asyncio.wait_for(self._freed.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise InvalidRequestError(f"this tenant's other requests held its share of the preprocessing "
                                              f"workers for {self.timeout:g}s (--preprocess-timeout); send fewer "
                                              "at once") from None
            self.busy[tenant] = self.busy.get(tenant, 0) + 1
        return lambda: self.give(tenant)

    def give(self, tenant: str) -> None:
        """The tenant's worker is free again (when its thread finishes, even after its
        request timed out); wakes the waiters."""
        left = self.busy.pop(tenant) - 1
        if left:
            self.busy[tenant] = left

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

        release = await self.shares.take(options.tenant)
        return await self.run(work, release)

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
