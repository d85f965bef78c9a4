"""Request and response models of the OpenAI-compatible API.

Requests forbid unknown fields, and fields we cannot honour are refused by
name: a parameter is either honoured or answered with a 400, never ignored,
except the few that cannot change a result (OpenAI's `metadata`, `store`,
`service_tier`, `prompt_cache_key`, `safety_identifier`, and vLLM's
`enable_prompt_tokens_details`-style bookkeeping), which common SDKs send and
which are accepted and not acted on.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import SamplingParams


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's names)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    cache_salt_offset: int = 0
    pin_prefix: bool = False
    request_id: str | None = Field(None, max_length=256)
    truncate_prompt_tokens: int | None = None
    # accepted, not acted on: they cannot change what the model returns
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's sampling parameters; unset ones come from `defaults` (the
        model's generation config), then the API's defaults. Raises
        InvalidRequestError naming the offending field."""
        d = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else d.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens if max_tokens is not None else d.get("max_tokens"),
                min_tokens=self.min_tokens, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens, logit_bias=bias)
        except ValueError as e:
            raise InvalidRequestError(str(e), str(e).split(" ")[0]) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    split_special_tokens: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        """Refuse, by name, fields we cannot honour. Raises InvalidRequestError."""
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (only best_of == n)", "best_of")
        if self.echo and self.stream:
            raise InvalidRequestError("echo is not supported with stream", "echo")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        """Refuse, by name, fields we cannot honour. Raises InvalidRequestError."""
        if self.tools:
            raise InvalidRequestError("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is not supported", "tool_choice")
        if self.parallel_tool_calls:
            raise InvalidRequestError("parallel_tool_calls is not supported", "parallel_tool_calls")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequestError("response_format other than {'type': 'text'} is not supported",
                                      "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    split_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class PinRequest(Strict):
    """A prefix to pin or unpin: text (or chat messages, template applied) or token ids."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None
    cache_salt_offset: int = 0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
