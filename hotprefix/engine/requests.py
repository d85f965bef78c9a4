"""What callers hand the engine besides sampling: options and prompts.

RequestOptions reaches LLMEngine whole (AsyncEngine.submit, LLMEngine.add_request and
prepare_request all take it); its CacheScope and its priority are checked when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotprefix.core.hashing import UNSALTED, CacheScope
from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import INT64_MAX, INT64_MIN

__all__ = ["CacheScope", "ChatPrompt", "Prompt", "RequestOptions"]


@dataclass(frozen=True)
class RequestOptions:
    """Per-request engine options besides sampling. Raises InvalidRequestError (param
    priority) for a priority outside int64; CacheScope checks its own salt and offset.

    tenant: whose share of the preprocessing workers the request takes (at most half of
    them for one tenant, so that one tenant's slow requests never hold them all); None:
    the operator's own request, which may use every worker."""

    priority: int = 0
    add_special_tokens: bool = True
    cache_scope: CacheScope = UNSALTED
    pin_prefix: bool = False  # once computed, pin the prompt's full blocks against eviction
    split_special_tokens: bool = False  # text prompts: special-token text stays text (chat content always does)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: what leaves room)
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.priority, int) and INT64_MIN <= self.priority <= INT64_MAX):
            raise InvalidRequestError(f"priority must be an integer in [{INT64_MIN}, {INT64_MAX}]", "priority")


DEFAULT_OPTIONS = RequestOptions()


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
