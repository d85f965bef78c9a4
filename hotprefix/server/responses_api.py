"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) over
the chat path: a request (responses_request.py) becomes a chat completion (messages, tools, output format),
submitted by serving.Serving.start_chat (one owner for templates, tools, constraints
and parsing); its typed answer, or its stream of typed events (server/results.py),
is written here as a Response object or Responses' typed stream events: a third wire
format beside OpenAI's completions and chat (openai_format.py).

`previous_response_id` continues a stored response: with `store` (the default) a
response's conversation (its input and its output items) is kept in memory, as its JSON
bytes (what is counted is what is held), the newest STORED_RESPONSES of them within
STORED_BYTES (evicted from the scope holding the most: ResponseStore), none larger than
STORED_RESPONSE_BYTES; an id not kept is a 404 naming it.
Nothing is kept on disk. A response is kept under its id and the cache salt of the
request that made it (`scoped`): a gateway gives each tenant its own salt, so another
tenant's id is a 404 as an unknown one is. `metadata` is bounded as OpenAI bounds it
(protocol.Metadata).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from hotprefix.errors import NotFoundError
from hotprefix.sampling_params import TokenLogprobs
from hotprefix.server.openai_format import ChatFormat
from hotprefix.server.responses_request import ResponsesRequest, to_chat
from hotprefix.server.results import Choice, Done, Failed, StreamEvent, Usage
from hotprefix.server.serving import Serving
from hotprefix.server.tool_parsers import new_item_id

STORED_RESPONSES = 1024  # conversations kept for previous_response_id (the newest)
STORED_BYTES = 64 << 20  # and at most this much of them (their JSON bytes), so that no client fills the memory
STORED_RESPONSE_BYTES = 8 << 20  # one larger conversation is answered and not kept
ENTRY_BYTES = 256  # what one kept entry holds besides its JSON (its id, the table's slot): counted too


def scoped(rid: str, salt: str | None) -> str:
    """The key a response is kept under: its id, and the cache salt of the request that
    made it (a gateway's tenant), so that only a request with the same salt reaches it."""
    return rid if salt is None else f"{rid}@{hashlib.sha256(salt.encode()).hexdigest()}"


def output_items(choice: Choice, msg_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """An answer as Responses output items: a message with its text (when it has text;
    with its tokens' logprobs when asked), and a function_call item per tool call."""
    items = []
    if choice.text:
        part = {"type": "output_text", "text": choice.text, "annotations": []}
        items.append({"type": "message", "id": msg_id or new_item_id("msg"), "status": "completed",
                      "role": "assistant", "content": [part | ({} if logprobs is None else {"logprobs": logprobs})]})
    for call in choice.calls:
        items.append({"type": "function_call", "id": new_item_id("fc"), "call_id": call.id, "name": call.name,
                      "arguments": call.arguments, "status": "completed"})
    return items


def response_object(rid: str, body: ResponsesRequest, model: str, output: list[dict[str, Any]],
                    finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
    """The Response object (status completed, or incomplete when max_output_tokens ran out)."""
    u = usage or Usage(0, 0, 0)
    incomplete = finish_reason == "length"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {}, "output": output,
            "usage": {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u.total_tokens}}


class ResponseStore:
    """The newest STORED_RESPONSES conversations, by response id and cache scope (event
    loop only): each the chat messages a continuation starts from and its Response object,
    held as their compact JSON bytes; `bytes` counts them (and ENTRY_BYTES each). When the
    count or the bytes run over, the scope holding the most (of what ran over) loses its
    oldest: one tenant storing many responses evicts its own, never a smaller tenant's
    (with one scope, a direct server's, this is the newest kept overall)."""

    def __init__(self, capacity: int = STORED_RESPONSES, max_bytes: int = STORED_BYTES,
                 max_entry_bytes: int = STORED_RESPONSE_BYTES) -> None:
        self.capacity, self.max_bytes, self.max_entry_bytes = capacity, max_bytes, max_entry_bytes
        self._items: dict[str, bytes] = {}
        self._scopes: dict[str | None, OrderedDict[str, None]] = {}  # salt -> its keys, least recently used first
        self._scope_bytes: dict[str | None, int] = {}
        self.bytes = 0

    def _size(self, data: bytes) -> int:
        return len(data) + ENTRY_BYTES

    def _get(self, rid: str, salt: str | None) -> bytes | None:
        key = scoped(rid, salt)
        kept = self._items.get(key)
        if kept is not None:
            self._scopes[salt].move_to_end(key)
        return kept

    def history(self, rid: str | None, salt: str | None) -> list[dict[str, Any]]:
        """The messages of stored response `rid` kept under `salt` ([] for None). Raises NotFoundError."""
        if rid is None:
            return []
        kept = self._get(rid, salt)
        if kept is None:
            raise NotFoundError(f"previous response {rid!r} is not kept here (stored responses are kept in "
                                f"memory, the newest {self.capacity})", "previous_response_id")
        return json.loads(kept)[0]

    def response(self, rid: str, salt: str | None) -> dict[str, Any] | None:
        """The Response object of a stored response (None when it is not kept under `salt`)."""
        kept = self._get(rid, salt)
        return None if kept is None else json.loads(kept)[1]

    def keep(self, rid: str, salt: str | None, messages: list[dict[str, Any]], response: dict[str, Any]) -> bool:
        """Keep a conversation under its id and salt (whether it was: one larger than
        max_entry_bytes or max_bytes is not); then evict as the class says."""
        data = json.dumps([messages, response], ensure_ascii=False, separators=(",", ":")).encode()
        if self._size(data) > min(self.max_entry_bytes, self.max_bytes):
            return False
        self.delete(rid, salt)
        key = scoped(rid, salt)
        self._items[key] = data
        self._scopes.setdefault(salt, OrderedDict())[key] = None
        self._scope_bytes[salt] = self._scope_bytes.get(salt, 0) + self._size(data)
        self.bytes += self._size(data)
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            over_count = len(self._items) > self.capacity
            victim = max(self._scopes, key=lambda sc: len(self._scopes[sc]) if over_count else self._scope_bytes[sc])
            self._drop(victim, next(iter(self._scopes[victim])))
        return True

    def delete(self, rid: str, salt: str | None) -> bool:
        key = scoped(rid, salt)
        if key not in self._items:
            return False
        self._drop(salt, key)
        return True

    def _drop(self, salt: str | None, key: str) -> None:
        size = self._size(self._items.pop(key))
        self.bytes -= size
        self._scope_bytes[salt] -= size
        del self._scopes[salt][key]
        if not self._scopes[salt]:
            del self._scopes[salt], self._scope_bytes[salt]


class ResponsesStream:
    """A chat's stream of typed events as Responses' stream events (serving.StreamWriter):
    response.created and in_progress, the message's text deltas, a function_call item
    per tool call, then response.completed (or incomplete); `on_done(choice, response)`
    gets the whole answer first. A failure is one `error` event. logprobs: writes a
    choice's token logprobs as Responses' entries (None: not asked)."""

    def __init__(self, rid: str, body: ResponsesRequest, model: str, on_done: Callable[[Choice, dict[str, Any]], None],
                 logprobs: Callable[[tuple[TokenLogprobs, ...]], list[dict[str, Any]]] | None = None) -> None:
        self.rid, self.body, self.model, self.on_done, self.logprobs = rid, body, model, on_done, logprobs
        self.seq, self.msg_id, self.opened = 0, new_item_id("msg"), False
        self.text, self.calls, self.finish, self.entries = "", [], None, []

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"

    def start(self) -> list[str]:
        head = response_object(self.rid, self.body, self.model, [], None, None) | {"status": "in_progress"}
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def write(self, ev: StreamEvent) -> list[str]:
        if isinstance(ev, Failed):
            return [self.event("error", code=str(400 if ev.own else 500), message=ev.message, param=None)]
        if isinstance(ev, Done):
            return self._done(ev.usage)
        out = []
        for c in ev.choices:  # (one: a Responses request has one sample)
            self.finish = c.finish_reason or self.finish
            self.calls += c.calls
            entries = self.logprobs(c.logprobs) if self.logprobs and c.logprobs else []
            self.entries += entries
            if c.text:
                out += self._text(c.text, entries)
        return out

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        out = []
        if not self.opened:
            self.opened = True
            item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
            out += [self.event("response.output_item.added", output_index=0, item=item),
                    self.event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]
        self.text += delta
        return out + [self.event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                 content_index=0, delta=delta, logprobs=logprobs)]

    def _done(self, usage: Usage) -> list[str]:
        choice = Choice(0, self.text or None, tuple(self.calls), finish_reason=self.finish)
        output = output_items(choice, self.msg_id, self.entries if self.logprobs else None)
        out = []
        if self.opened:
            out += [self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                               text=self.text, logprobs=self.entries),
                    self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                               part=output[0]["content"][0]),
                    self.event("response.output_item.done", output_index=0, item=output[0])]
        for i, item in enumerate(output[1 if self.opened else 0:], 1 if self.opened else 0):
            out += [self.event("response.output_item.added", output_index=i, item=item | {"status": "in_progress"}),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=i, item=item)]
        final = response_object(self.rid, self.body, self.model, output, self.finish, usage)
        self.on_done(choice, final)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=final)]


async def create(serving: Serving, store: ResponseStore, body: ResponsesRequest, raw: Request, model: str) -> Any:
    """POST /v1/responses: the answer as a Response object, or its stream of events.
    Raises InvalidRequestError (NotFoundError: a previous response not kept, or not this
    request's cache salt's)."""
    body.check()
    serving.note_ignored(body)
    history = store.history(body.previous_response_id, body.cache_salt)
    chat = to_chat(body, history)
    rid = new_item_id("resp")
    keep_from = bool(body.operator_instructions) + bool(body.instructions)  # per request: not carried on
    fmt = ChatFormat(serving.token_text, body.top_logprobs or 0)
    logprobs = (lambda lps: fmt.logprob_block(lps, 0)["content"]) if body.wants_logprobs() else None

    def done(choice: Choice, response: dict[str, Any]) -> None:
        if body.store:
            msgs = [m.model_dump(exclude_none=True) for m in chat.messages][keep_from:]
            answer: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if choice.calls:
                answer["tool_calls"] = [c.openai() for c in choice.calls]
            store.keep(rid, body.cache_salt, msgs + [answer], response)

    run = await serving.start_chat(chat, model)
    if body.stream:
        return serving.stream(run, ResponsesStream(rid, body, model, done, logprobs))
    answer = await serving.answer(run, raw)
    (choice,) = answer.choices
    entries = logprobs(choice.logprobs or ()) if logprobs else None
    response = response_object(rid, body, model, output_items(choice, logprobs=entries), choice.finish_reason,
                               answer.usage)
    done(choice, response)
    return JSONResponse(response)
