"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) over
the chat path: a request becomes a chat completion (messages, tools, output format),
served by serving.Serving.chat (one owner for templates, tools, constraints and
parsing), and its answer or its stream of chunks becomes a Response object or
Responses' typed stream events.

`previous_response_id` continues a stored response: with `store` (the default) a
response's conversation (its input and its output items) is kept in memory, the newest
STORED_RESPONSES of them within STORED_BYTES; an id not kept is a 400 naming it. Nothing
is kept on disk.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from hotprefix.errors import InvalidRequestError
from hotprefix.server.protocol import ChatCompletionRequest, Strict
from hotprefix.server.responses import ClosingStreamingResponse
from hotprefix.server.tool_parsers import new_item_id

STORED_RESPONSES = 1024  # conversations kept for previous_response_id (the newest)
STORED_BYTES = 64 << 20  # and at most this much of them (their JSON), so that no client fills the memory


class ResponsesRequest(Strict):
    """The fields of OpenAI's Responses request that hotprefix honours; the others
    that cannot change a result (metadata, store, user, reasoning on a model without
    it, service_tier, truncation "disabled") are accepted; anything else is a 400."""

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
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = None
    top_logprobs: int | None = None


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
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": str(item.get("output", ""))})
        else:
            raise InvalidRequestError(f"input[{i}]: items of type {kind!r} are not supported", "input")
    return messages


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion a Responses request stands for. Raises InvalidRequestError."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history \
        + to_messages(items)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "seed": body.seed, "user": body.user,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.top_logprobs:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    if body.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    if isinstance(body.tool_choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = (body.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    elif fmt and fmt.get("type") in ("json_object", "text"):
        chat["response_format"] = {"type": fmt["type"]}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValueError as e:
        raise InvalidRequestError(f"the request cannot be served: {str(e).splitlines()[0]}", "input") from None


def _chat_tool(t: dict[str, Any], i: int) -> dict[str, Any]:
    if t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise InvalidRequestError(f"tools[{i}]: only function tools (with a name) are supported", "tools")
    fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Responses output items: a message with its text, and
    a function_call item per tool call."""
    items = []
    if message.get("content"):
        items.append({"type": "message", "id": new_item_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or ():
        items.append({"type": "function_call", "id": new_item_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response_object(rid: str, body: ResponsesRequest, model: str, output: list[dict[str, Any]],
                    finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Response object (status completed, or incomplete when max_output_tokens ran out)."""
    u = usage or {}
    incomplete = finish_reason == "length"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {}, "output": output,
            "usage": {"input_tokens": u.get("prompt_tokens", 0),
                      "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get(
                          "cached_tokens", 0)},
                      "output_tokens": u.get("completion_tokens", 0),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u.get("total_tokens", 0)}}


class ResponseStore:
    """The newest STORED_RESPONSES conversations, by response id (event loop only):
    each the chat messages a continuation starts from."""

    def __init__(self, capacity: int = STORED_RESPONSES, max_bytes: int = STORED_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any], int]] = OrderedDict()
        self.bytes = 0

    def history(self, rid: str | None) -> list[dict[str, Any]]:
        """The messages of stored response `rid` ([] for None). Raises InvalidRequestError."""
        if rid is None:
            return []
        if rid not in self._items:
            raise InvalidRequestError(f"previous response {rid!r} is not kept here (stored responses are kept in "
                                      f"memory, the newest {self.capacity})", "previous_response_id")
        self._items.move_to_end(rid)
        return [dict(m) for m in self._items[rid][0]]

    def response(self, rid: str) -> dict[str, Any] | None:
        """The Response object of a stored response (None when it is not kept)."""
        kept = self._items.get(rid)
        return None if kept is None else kept[1]

    def keep(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        """Keep a conversation; the oldest go while more than `capacity` or `max_bytes`
        are kept (one larger than max_bytes is not kept at all)."""
        size = len(json.dumps([messages, response]))
        self._items[rid] = (messages, response, size)
        self.bytes += size
        while self._items and (len(self._items) > self.capacity or self.bytes > self.max_bytes):
            self.bytes -= self._items.popitem(last=False)[1][2]

    def delete(self, rid: str) -> bool:
        kept = self._items.pop(rid, None)
        self.bytes -= kept[2] if kept is not None else 0
        return kept is not None


async def stream_events(chunks: AsyncIterator[str], rid: str, body: ResponsesRequest, model: str,
                        on_done: Any) -> AsyncIterator[str]:
    """The chat stream's chunks (`data: {...}` lines) as Responses stream events."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"

    head = response_object(rid, body, model, [], None, None) | {"status": "in_progress"}
    yield event("response.created", response=head)
    yield event("response.in_progress", response=head)
    try:
        async for ev in _translated(chunks, rid, body, model, on_done, event):
            yield ev
    finally:
        await chunks.aclose()  # (the chat stream's own cleanup runs now, not when collected)


async def _translated(chunks: Any, rid: str, body: ResponsesRequest, model: str, on_done: Any,
                      event: Any) -> AsyncIterator[str]:
    msg_id, text, calls, finish, usage = new_item_id("msg"), "", [], None, None
    opened = False
    async for raw in chunks:
        if not raw.startswith("data: {"):
            continue
        chunk = json.loads(raw[6:])
        if "error" in chunk:
            err = chunk["error"]
            yield event("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))
            return
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or ():
            delta = c.get("delta") or {}
            finish = c.get("finish_reason") or finish
            if delta.get("content"):
                if not opened:
                    opened = True
                    item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                            "content": []}
                    yield event("response.output_item.added", output_index=0, item=item)
                    yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                text += delta["content"]
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=delta["content"])
            calls += delta.get("tool_calls") or []
    message = {"content": text or None, "tool_calls": [{"id": c["id"], "type": "function", "function": c["function"]}
                                                       for c in calls] or None}
    output = output_items(message)
    if opened:
        output[0]["id"] = msg_id
        yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text)
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0,
                    part=output[0]["content"][0])
        yield event("response.output_item.done", output_index=0, item=output[0])
    for i, item in enumerate(output[1 if opened else 0:], 1 if opened else 0):
        yield event("response.output_item.added", output_index=i, item=item | {"status": "in_progress"})
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                    arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    final = response_object(rid, body, model, output, finish, usage)
    on_done(message, final)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


async def create(serving: Any, store: ResponseStore, body: ResponsesRequest, raw: Request, model: str) -> Any:
    """POST /v1/responses: the answer as a Response object, or its stream of events."""
    chat = to_chat(body, store.history(body.previous_response_id))
    rid = new_item_id("resp")
    keep_from = 1 if body.instructions else 0  # the instructions are per request: not carried on

    def done(message: dict[str, Any], response: dict[str, Any]) -> None:
        if body.store:
            msgs = [m.model_dump(exclude_none=True) for m in chat.messages][keep_from:]
            answer = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                answer["tool_calls"] = message["tool_calls"]
            store.keep(rid, msgs + [answer], response)

    answer = await serving.chat(chat, raw, model)
    if not body.stream:
        data = json.loads(answer.body)
        choice = data["choices"][0]
        response = response_object(rid, body, model, output_items(choice["message"]), choice["finish_reason"],
                                   data.get("usage"))
        done(choice["message"], response)
        return JSONResponse(response)
    return ClosingStreamingResponse(stream_events(answer.body_iterator, rid, body, model, done), answer.on_close,
                                    media_type="text/event-stream")
