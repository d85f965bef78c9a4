"""Request and response models of the OpenAI-compatible API.

Requests forbid unknown fields, and fields we cannot honour are refused by
name: a parameter is either honoured or answered with a 400, never ignored,
except the few that cannot change a result (OpenAI's `metadata`, `store`,
`service_tier`, `prompt_cache_key`, `safety_identifier`, and vLLM's
`enable_prompt_tokens_details`-style bookkeeping), which common SDKs send and
which are accepted and not acted on.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import SamplingParams, StructuredKind, StructuredOutput
from hotprefix.server.metadata import Metadata


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    """response_format.json_schema (OpenAI's): the schema is enforced as given."""

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(Strict):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _structured_from(kind: StructuredKind, value: Any) -> StructuredOutput:
    """A constraint with its spec as text: schemas (unless already text) and choices as JSON."""
    return StructuredOutput(kind, value if isinstance(value, str) else json.dumps(value))


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
    request_id: str | None = Field(None, min_length=1, max_length=256)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob (and this many alternatives)
    # accepted, not acted on: they cannot change what the model returns (IGNORED; the server
    # logs each once)
    metadata: Metadata = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = Field(None, max_length=32)  # no model served here reasons before answering
    IGNORED: ClassVar[tuple[str, ...]] = ("metadata", "store", "service_tier", "prompt_cache_key",
                                          "safety_identifier", "reasoning_effort")
    # SGLang's, sent at their defaults by routers built for both engines (vllm-router's render
    # calls): accepted there, refused otherwise (not honoured here)
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    @field_validator("request_id")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        """A request id goes into logs and headers: printable characters only (no line breaks,
        no terminal escapes)."""
        if v is not None and not v.isprintable():
            raise ValueError("request_id must be printable characters (no control characters or line breaks)")
        return v

    def ignored(self) -> list[str]:
        """The fields of IGNORED this request set."""
        return [name for name in self.IGNORED if getattr(self, name) is not None]

    def prompt_logprobs_needed(self) -> int | None:
        """Alternatives per prompt token the engine must compute (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def structured(self) -> StructuredOutput | None:
        """The one output constraint the request asks for (response_format,
        structured_outputs or a guided_* field), or None. Raises InvalidRequestError
        when it asks for several."""
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput(StructuredKind.JSON_OBJECT)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequestError("response_format json_schema needs its json_schema", "response_format")
            found.append(("response_format", _structured_from(StructuredKind.JSON_SCHEMA, rf.json_schema.schema_)))
        so = self.structured_outputs
        pairs = [(so.json_ if so else None, StructuredKind.JSON_SCHEMA, "structured_outputs"),
                 (so.regex if so else None, StructuredKind.REGEX, "structured_outputs"),
                 (so.choice if so else None, StructuredKind.CHOICE, "structured_outputs"),
                 (so.grammar if so else None, StructuredKind.GRAMMAR, "structured_outputs"),
                 (True if so and so.json_object else None, StructuredKind.JSON_OBJECT, "structured_outputs"),
                 (self.guided_json, StructuredKind.JSON_SCHEMA, "guided_json"),
                 (self.guided_regex, StructuredKind.REGEX, "guided_regex"),
                 (self.guided_choice, StructuredKind.CHOICE, "guided_choice"),
                 (self.guided_grammar, StructuredKind.GRAMMAR, "guided_grammar")]
        for value, kind, name in pairs:
            if value is not None:
                found.append((name, StructuredOutput(kind) if kind is StructuredKind.JSON_OBJECT
                              else _structured_from(kind, value)))
        if len(found) > 1:
            raise InvalidRequestError(f"give one output constraint, not {len(found)} "
                                      f"({', '.join(n for n, _ in found)})", found[1][0])
        return found[0][1] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's sampling parameters; unset ones come from `defaults` (the
        model's generation config), then the API's defaults. Raises
        InvalidRequestError naming the offending field."""
        for name in ("no_stop_trim", "return_hidden_states"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported here (only false)", name)
        d = defaults or {}
        structured = self.structured()

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
                logprobs=logprobs, prompt_logprobs=self.prompt_logprobs_needed(),
                skip_special_tokens=self.skip_special_tokens, logit_bias=bias,
                structured=structured)
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
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs is not supported with stream", "prompt_logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens 0 needs echo (the prompt alone, with its logprobs)", "max_tokens")

    def prompt_logprobs_needed(self) -> int | None:
        """prompt_logprobs's, or logprobs's when the echoed prompt comes with its logprobs."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

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


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = Field(None, max_length=256)  # tool turns: which call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (a call's arguments as an object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # hotprefix: the first this many messages are the operator's (a gateway's forced system
    # prompt): tools render after them, never inside them (tenants cannot set it through the gateway)
    operator_messages: int = Field(0, ge=0, le=1024)

    def check(self) -> None:
        """Refuse, by name, fields we cannot honour. Raises InvalidRequestError."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.limit() == 0:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only on completions, with echo)", "max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs is not supported with stream", "prompt_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequestError("two tools have the same name", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                      "tool_choice")
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")
        if self.calls_tools() and self.structured() is not None:
            raise InvalidRequestError("tools and an output constraint (response_format, structured_outputs) "
                                      "cannot both shape the answer; set tool_choice to 'none'", "tool_choice")

    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given and tool_choice not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    operator_messages: int = Field(0, ge=0, le=1024)
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
