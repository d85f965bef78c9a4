"""A Responses request (OpenAI's `POST /v1/responses` body) and the chat completion it
stands for.

Every field of OpenAI's Responses request is taken (the `openai` package's
types.responses.response_create_params lists them; tests/server/test_responses_fields.py
walks that list): honoured; or, where it cannot change the tokens, accepted and ignored
as chat's ignored fields are (IGNORED, logged once per field by the server); or refused
with a 400 naming it where ignoring it would change the answer (`check`). The request
becomes a chat completion (`to_chat`): the operator's instructions (a gateway's forced
prompt), the request's instructions, the stored conversation, then the input items as
chat messages; function tools as chat tools, rendered after the operator's turn.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from hotprefix.errors import InvalidRequestError
from hotprefix.server.protocol import ChatCompletionRequest, Metadata, Strict

LOGPROBS = "message.output_text.logprobs"  # the one `include` value that adds to what is returned here
INCLUDABLE = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]


class ResponsesRequest(Strict):
    """OpenAI's Responses request. Honoured: model, input, instructions, max_output_tokens,
    temperature, top_p, stream, tools (function tools), tool_choice (none, auto, required,
    a function, allowed_tools), parallel_tool_calls, previous_response_id, store, text
    (its format), metadata (returned), user, top_logprobs and `include`'s output
    logprobs; hotprefix's seed, and for a gateway cache_salt (which also scopes the stored
    responses), cache_salt_offset, request_id and operator_instructions. Ignored (IGNORED,
    and what `ignored` adds): they cannot change the tokens here. Refused by `check`."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    text: dict[str, Any] | None = None
    metadata: Metadata = None
    user: str | None = None
    seed: int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[INCLUDABLE] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # accepted and ignored: they cannot change the tokens here
    reasoning: dict[str, Any] | None = None  # no model served here reasons before answering
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # every prompt's prefix is cached here, keyed by its tokens
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: padding, not tokens
    max_tool_calls: int | None = Field(None, ge=0)  # counts built-in tools' calls; none run here
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None  # image inputs are refused (input)
    background_options: dict[str, Any] | None = None
    # refused when set (check): ignoring them would change the answer
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    # hotprefix's (vLLM's names where vLLM has them)
    cache_salt: str | None = None
    cache_salt_offset: int = 0
    request_id: str | None = Field(None, max_length=256)
    operator_instructions: str | None = None  # a gateway's forced prompt: first, tools after it, never stored

    IGNORED: ClassVar[tuple[str, ...]] = ("reasoning", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                                          "prompt_cache_options", "safety_identifier", "stream_options",
                                          "max_tool_calls", "access_programs", "image", "background_options")

    def ignored(self) -> list[str]:
        """The fields this request set that change nothing here: IGNORED's, `include`'s
        values other than the output logprobs, truncation "auto" (a conversation longer
        than the context is refused, never cut) and text.verbosity."""
        names = [name for name in self.IGNORED if getattr(self, name) is not None]
        if set(self.include or ()) - {LOGPROBS}:
            names.append("include")
        if self.truncation == "auto":
            names.append("truncation")
        if (self.text or {}).get("verbosity") is not None:
            names.append("text.verbosity")
        return names

    def check(self) -> None:
        """Refuse, by name, what would change the answer if it were ignored. Raises InvalidRequestError."""
        refusals = (
            (self.background, "background", "background responses (run later, then polled) are not supported: the "
                                            "answer comes with this request"),
            (self.conversation is not None, "conversation", "conversations are not kept here: continue one with "
                                                            "previous_response_id"),
            (self.prompt is not None, "prompt", "stored prompt templates are not kept here: send the instructions "
                                                "and the input"),
            (self.context_management, "context_management", "context compaction is not run here"),
            (self.moderation is not None, "moderation", "moderation is not run here"))
        for given, name, why in refusals:
            if given:
                raise InvalidRequestError(why, name)

    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or input_text/output_text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"{where}: content must be a string or input_text parts (no images or files here)",
                              "input")


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, function_call items (an
    assistant's tool calls) and function_call_output items (tool answers). Raises
    InvalidRequestError naming an item it cannot take."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise InvalidRequestError(f"input[{i}]: role must be system, developer, user or assistant", "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else _text_of(output, f"input[{i}]")})
        else:
            raise InvalidRequestError(f"input[{i}]: items of type {kind!r} are not supported", "input")
    return messages


def _chat_tool(t: dict[str, Any], i: int) -> dict[str, Any]:
    """A function tool as chat's. Raises InvalidRequestError for another kind of tool, or
    one that could not be called as given (deferred, asynchronous, not directly callable)."""
    if t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise InvalidRequestError(f"tools[{i}]: only function tools (with a name) are supported", "tools")
    callers = t.get("allowed_callers")
    if callers is not None and not isinstance(callers, list):
        raise InvalidRequestError(f"tools[{i}]: allowed_callers must be a list", "tools")
    if t.get("defer_loading") or t.get("async") or "direct" not in (["direct"] if callers is None else callers):
        raise InvalidRequestError(f"tools[{i}]: deferred, asynchronous or programmatic-only function tools are not "
                                  "supported (a function is called directly)", "tools")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any] | None,
                 tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """(chat's tool_choice, the tools the model sees) for a Responses tool_choice:
    none/auto/required, a function, or allowed_tools (the tools the model may call: the
    others are left out). Raises InvalidRequestError for a hosted tool's choice."""
    if not isinstance(choice, dict):
        return choice, tools
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}, tools
    if choice.get("type") == "allowed_tools" and not isinstance(choice.get("tools") or [], list):
        raise InvalidRequestError("tool_choice: allowed_tools' tools must be a list", "tool_choice")
    if choice.get("type") == "allowed_tools" and choice.get("mode", "auto") in ("auto", "required"):
        names = {t.get("name") for t in choice.get("tools") or () if isinstance(t, dict)}
        return choice.get("mode", "auto"), [t for t in tools if t["function"]["name"] in names]
    raise InvalidRequestError(f"tool_choice of type {choice.get('type')!r} is not supported (function tools only)",
                              "tool_choice")


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion a Responses request stands for, after `history` (a stored
    conversation's messages). Raises InvalidRequestError."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    lead = [{"role": "system", "content": text} for text in (body.operator_instructions, body.instructions) if text]
    chat: dict[str, Any] = {
        "model": body.model, "messages": lead + history + to_messages(items),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "seed": body.seed, "user": body.user, "parallel_tool_calls": body.parallel_tool_calls,
        "cache_salt": body.cache_salt, "cache_salt_offset": body.cache_salt_offset, "request_id": body.request_id,
        "operator_messages": 1 if body.operator_instructions else 0}
    if body.wants_logprobs():
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    tools = [_chat_tool(t, i) for i, t in enumerate(body.tools or ())]
    chat["tool_choice"], chat["tools"] = _tool_choice(body.tool_choice, tools)
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object (type text, json_object or json_schema)", "text")
    if fmt and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    elif fmt and fmt.get("type") in ("json_object", "text"):
        chat["response_format"] = {"type": fmt["type"]}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None and v != []})
    except ValueError as e:
        raise InvalidRequestError(f"the request cannot be served: {str(e).splitlines()[0]}", "input") from None
