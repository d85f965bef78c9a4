"""What callers hand the async engine and get back: options, prompts, streams.

A RequestStream lives on the event loop; AsyncEngine fills it from the engine thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from hotprefix.engine.llm_engine import RequestOutput


@dataclass(frozen=True)
class RequestOptions:
    """Per-request engine options besides sampling (see LLMEngine.add_request)."""

    priority: int = 0
    add_special_tokens: bool = True
    cache_salt: str | None = None
    cache_salt_offset: int = 0
    pin_prefix: bool = False
    split_special_tokens: bool = False  # text prompts: special-token text stays text (chat content always does)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: what leaves room)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render with the chat template (in a preprocessing worker)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None  # a request's chat_template_kwargs
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the template
    operator_messages: int = 0  # leading messages that are the operator's: tools render after them


Prompt = str | list[int] | ChatPrompt


@dataclass(eq=False)
class RequestStream:
    """The outputs of one engine request, in step order. Iterating ends after the
    finished output (or raises the error that ended it); closing it early, or
    cancelling the consumer, aborts the request. Lives on the event loop.

    on_close(stream, abort) is its owner's (AsyncEngine's stream table): called at
    every close, with abort=True while the engine has not sent its last item."""

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
