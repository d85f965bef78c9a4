"""What a tenant may send through the gateway, and the request a backend gets instead.

The gateway never forwards a body as received: it validates the client's JSON
against these models (an allow-list of the OpenAI fields users need, plus vLLM's
harmless sampling extras), then builds a new body from the validated fields,
the tenant's forced system prompt, the tenant's cache salt and an explicit
`max_tokens`. Fields that belong to the operator are refused by name; any other
unknown field is refused as unsupported; roles are OpenAI's, matched exactly.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hotprefix.errors import InvalidRequestError
from hotprefix.server.protocol import Metadata, NamedToolChoice, ResponseFormat, SamplingFields, ToolCall, ToolDef
from hotprefix.server.responses_request import ResponsesRequest, to_chat

# Fields a backend honours but only the operator may set: they change the prompt's
# construction (templates, special tokens, the forced prompt), the cache (salts,
# pins), the queue (priority), or reveal other requests (ids). `echo` is a tenant's own
# (lm-eval's loglikelihood needs it) except where a tenant prompt is in force (check_forced).
OPERATOR_FIELDS = frozenset({
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "split_special_tokens", "suffix", "priority", "pin_prefix", "request_id",
    "cache_salt", "cache_salt_offset", "documents", "mm_processor_kwargs", "return_tokens_as_token_ids",
    "truncate_prompt_tokens", "kv_transfer_params", "vllm_xargs", "operator_messages", "operator_instructions",
})


class TenantRequestError(ValueError):
    """The client's body cannot go through the gateway (HTTP 400): message and param."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class _Sampling(_Strict):
    """Sampling fields a tenant may set (OpenAI's and vLLM's harmless extras). Their
    values are checked by the server's own rules (check_sampling); the bounds here are
    the gateway's own (n, and no max_tokens 0: that needs echo, an operator field)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    response_format: ResponseFormat | None = None
    # accepted from SDKs and not forwarded: they cannot change a result
    metadata: Metadata = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = Field(None, max_length=32)

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return None


class TenantChat(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
CompletionPrompt = (Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
                    | TokenIds | Annotated[list[TokenIds], Field(min_length=1)])


class TenantCompletion(_Sampling):
    prompt: CompletionPrompt
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    echo: bool | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """Its prompts, one entry a prompt (a text, or token ids)."""
        return prompt_list(self.prompt)

    def token_ids(self) -> bool:
        """Whether its prompts are token ids (lm-eval's tokenized requests)."""
        return not isinstance(self.prompts()[0], str)

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


class TenantResponses(ResponsesRequest):
    """A Responses request as a tenant may send it: the fields of OpenAI's request
    (ALLOWED: an explicit list, so that a field the server adds stays closed to tenants
    until it is put here), checked by the server's own model and rules
    (responses_request.py). One sample; the tenant's prompt goes first, as the operator's
    instructions (backend_body)."""

    n: ClassVar[int] = 1
    user: str | None = Field(None, max_length=256)  # (as _Sampling's: it reaches the backend's log)
    ALLOWED: ClassVar[frozenset[str]] = frozenset({
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
        "tool_choice", "parallel_tool_calls", "previous_response_id", "store", "text", "metadata", "user", "seed",
        "top_logprobs", "include", "truncation", "reasoning", "service_tier", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "stream_options", "max_tool_calls",
        "access_programs", "image", "background_options", "background", "conversation", "prompt",
        "context_management", "moderation"})

    def wanted_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.wants_logprobs() else None

    def chat_view(self) -> dict[str, Any]:
        """The chat body it renders as (without a stored conversation): for counting its
        prompt tokens. Raises InvalidRequestError."""
        return to_chat(self, []).model_dump(include={"messages", "tools", "operator_messages"}, exclude_none=True)

    def check_all(self) -> None:
        """The server's checks, before anything is admitted: its refusals, then those of
        the chat it stands for (input items, tools, sampling). Raises InvalidRequestError."""
        self.check()
        chat = to_chat(self, [])
        chat.check()
        chat.sampling_params(chat.limit(), self.wanted_logprobs())


MODELS: dict[str, type[_Sampling] | type[TenantResponses]] = {"chat": TenantChat, "completions": TenantCompletion,
                                                             "responses": TenantResponses}
TenantRequest = TenantChat | TenantCompletion | TenantResponses


def parse_tenant_request(endpoint: str, raw: dict[str, Any]) -> TenantRequest:
    """The client's body as the model of its endpoint. Raises TenantRequestError
    naming an operator-only field, an unsupported one, or the first invalid value."""
    for k in raw:
        if k in OPERATOR_FIELDS:
            raise TenantRequestError(f"'{k}' is set by the operator; the gateway does not accept it from clients", k)
        if endpoint == "responses" and k not in TenantResponses.ALLOWED:
            raise TenantRequestError(f"unsupported parameter '{k}'", k)
    try:
        req = MODELS[endpoint].model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            raise TenantRequestError(f"unsupported parameter '{loc}'", loc.split(".")[0]) from None
        if err.get("type") == "prompt" or (loc.startswith("prompt") and endpoint == "completions"):
            raise TenantRequestError("'prompt' must be a non-empty string, list of strings, list of token ids or "
                                     "list of such lists", "prompt") from None
        raise TenantRequestError(f"{loc or 'body'}: {err.get('msg')}", loc.split(".")[0] if loc else None) from None
    try:
        if isinstance(req, TenantResponses):
            req.check_all()
        else:
            check_sampling(req)
    except InvalidRequestError as e:
        raise TenantRequestError(str(e), e.param) from None
    return req


def check_forced(req: TenantRequest, system: str | None) -> None:
    """What a tenant with a prompt in force may not send on completions: `echo` (the answer
    would show the operator's prompt) and token-id prompts (the prompt goes before the
    client's as text, where special-token text stays text: ids would bypass that). Raises
    TenantRequestError."""
    if not system or not isinstance(req, TenantCompletion):
        return
    if req.echo:
        raise TenantRequestError("'echo' is refused for this key: its tenant has a system prompt in force, which "
                                 "the echo would show", "echo")
    if req.token_ids():
        raise TenantRequestError("token-id prompts are refused for this key: its tenant has a system prompt in "
                                 "force, which goes before the prompt as text", "prompt")


def check_sampling(req: _Sampling) -> None:
    """The tenant's sampling values, checked by the server's one set of rules (its
    request model's sampling_params, i.e. SamplingParams.validate), so that the gateway
    refuses exactly what a hotprefix backend would. Raises TenantRequestError naming the field."""
    fields = {k: v for k, v in req.model_dump(exclude_none=True, by_alias=True).items()
              if k in SamplingFields.model_fields}
    try:
        SamplingFields.model_validate(fields).sampling_params(req.wanted_max_tokens(), req.wanted_logprobs())
    except InvalidRequestError as e:
        raise TenantRequestError(str(e), e.param) from None
    except ValidationError as e:  # (the tenant model's types are the server's: not expected)
        raise TenantRequestError(f"invalid sampling parameters: {e.errors()[0].get('msg')}", None) from None


NOT_FORWARDED = {"messages", "prompt", "max_completion_tokens", "max_tokens",  # rebuilt
                 *SamplingFields.IGNORED}  # dropped: they cannot change a result
LIMIT_FIELDS = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens"}


def join_prompt(system: str, user: str) -> str:
    """A tenant prompt before a completions prompt: a blank line between them unless
    the tenant's text already ends in whitespace."""
    return system + user if not system or system[-1].isspace() else system + "\n\n" + user


def backend_body(endpoint: str, req: TenantRequest, system: str | None, max_tokens: int) -> dict[str, Any]:
    """The body a backend gets: the validated fields the client set (nothing else),
    the tenant's prompt in force and an explicit max_tokens. The caller adds the
    cache salt. Chat: the client's system and developer messages are dropped and the
    tenant's prompt goes first; completions: each prompt is prefixed with it; Responses:
    the tenant's prompt is the operator's instructions, before the client's instructions
    and input (tools render after it)."""
    if isinstance(req, TenantResponses):
        body = req.model_dump(exclude_unset=True, exclude_none=True, exclude=set(req.IGNORED))
        return body | {LIMIT_FIELDS[endpoint]: max_tokens} | ({"operator_instructions": system} if system else {})
    body = req.model_dump(exclude_unset=True, exclude_none=True, exclude=NOT_FORWARDED, by_alias=True)
    body["max_tokens"] = max_tokens
    if isinstance(req, TenantChat):
        kept = [_forwarded(m) for m in req.messages if m.role not in ("system", "developer")]
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + kept
        if system and req.tools:  # the forced turn is the operator's: the tenant's tools render after it
            body["operator_messages"] = 1
    else:
        assert isinstance(req, TenantCompletion)
        if system:  # (check_forced: text prompts only)
            texts = [join_prompt(system, t) for t in req.prompts()]  # type: ignore[arg-type]
            body["prompt"] = texts[0] if isinstance(req.prompt, str) else texts
        else:
            body["prompt"] = req.prompt
    return body


def _forwarded(m: Message) -> dict[str, Any]:
    """A kept message as the backend gets it: role, text, name, and its tool fields."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def prompt_token_bound(body: dict[str, Any]) -> int:
    """A prompt token count no byte-level or character vocabulary exceeds: a token per
    UTF-8 byte of everything that renders into the prompt (messages with their names and
    tool calls, tool definitions), plus 16 a message for the template's own tokens and 64
    more. Admission reserves it when no backend can count the tokens (Proxy._prompt_tokens);
    the reservation is settled with the backend's real count when the request ends."""
    if "messages" in body:
        text = json.dumps([body["messages"], body.get("tools")], ensure_ascii=False)
        return len(text.encode()) + 16 * len(body["messages"]) + 64
    if (ids := token_prompts(body)) is not None:
        return sum(len(t) for t in ids)
    p = body.get("prompt")
    texts = p if isinstance(p, list) else [p or ""]
    return sum(len(str(t).encode()) + 16 for t in texts)

def prompt_list(p: Any) -> list:
    """A completions `prompt` (a text, texts, token ids or lists of them; validated), one entry a prompt."""
    if isinstance(p, str):
        return [p]
    return [p] if p and isinstance(p[0], int) else list(p)


def token_prompts(body: dict[str, Any]) -> list[list[int]] | None:
    """A completions body's token-id prompts, one list a prompt (None: its prompts are text)."""
    p = body.get("prompt")
    return None if not isinstance(p, list) or not p or isinstance(p[0], str) else prompt_list(p)


def num_sequences(req: TenantRequest) -> int:
    """Output sequences the request asks for (prompts x n): what max_tokens multiplies."""
    prompts = len(req.prompts()) if isinstance(req, TenantCompletion) else 1
    return prompts * req.n
