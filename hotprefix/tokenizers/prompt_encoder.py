"""Text <-> token ids and chat templates, shared by the engine and the tools (`hotprefix lint`).

HF tokenizers are not safe to call from two threads at once, and one lock
around a shared tokenizer let a long tokenization on one thread (a client's
prompt) stall decoding on another (the engine thread's detokenizer, every
request's next token). So every thread that uses a PromptEncoder gets its own
copy of the tokenizer, made once (about 0.1 s for the default model's).
"""

from __future__ import annotations

import copy
import re
import secrets
import threading
from functools import cached_property
from typing import Any

from hotprefix.errors import InvalidRequestError
from hotprefix.tokenizers.tool_prompt import with_tools

# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tools", "documents",
                                      "return_dict", "return_tensors", "padding", "truncation", "max_length",
                                      "tokenizer_kwargs", "return_assistant_tokens_mask"})


class PromptEncoder:
    """A tokenizer for many threads: each calling thread works on its own copy.
    The original is only ever copied, never called."""

    def __init__(self, tokenizer: Any) -> None:
        self._original = tokenizer
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._renders_tools: dict[str, bool] = {}  # per template: a dict write is atomic under the GIL

    @property
    def tokenizer(self) -> Any:
        """This thread's copy of the tokenizer."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = copy.deepcopy(self._original)
            self._local.tokenizer = tok
        return tok

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self._original, "eos_token_id", None)

    def tokenize(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of text. split_special_tokens: text that spells a special token
        ("<|im_end|>") is tokenized as the characters it is, never as the token.
        Raises InvalidRequestError for text that is not valid Unicode (a lone surrogate)."""
        _check_text(text)
        kw = {"split_special_tokens": True} if split_special_tokens else {}
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens, **kw)["input_ids"])

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special tokens (text -> id), as HF marks them."""
        decoder = getattr(self._original, "added_tokens_decoder", {}) or {}
        return {t.content: i for i, t in decoder.items() if getattr(t, "special", False) and t.content}

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, operator_messages: int = 0) -> list[int]:
        """Token ids of a conversation through the chat template. The template's own
        special tokens are special; text inside a message never becomes one: a
        message that spells "<|im_end|>\\n<|im_start|>system" gets those characters,
        not a new turn. Messages without such text are tokenized exactly as the
        rendered prompt would be. `operator_messages`: see apply_chat_template. Raises
        InvalidRequestError."""
        specials = self.special_tokens
        fields = list(_strings([{k: v for k, v in m.items() if k != "role"} for m in messages], tools))
        if not any(sp in v for v in fields for sp in specials):
            return self.tokenize(self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                          chat_template, template_kwargs, tools, operator_messages),
                                 False)
        nonce = secrets.token_hex(8)
        while any(nonce in v for v in fields):
            nonce = secrets.token_hex(8)
        literal = {sp: f"\ue000{nonce}{i}\ue001" for i, sp in enumerate(specials)}
        defused = [{k: v if k == "role" else _map_strings(v, lambda t: _replace_all(t, literal)) for k, v in m.items()}
                   for m in messages]
        tools = None if tools is None else _map_strings(tools, lambda t: _replace_all(t, literal))
        text = self.apply_chat_template(defused, add_generation_prompt, continue_final_message, chat_template,
                                        template_kwargs, tools, operator_messages)
        return self._tokenize_marked(text, {v: k for k, v in literal.items()})

    def renders_tools(self, chat_template: str | None = None) -> bool:
        """Whether the template (or the model's) renders `tools` (checked once per template)."""
        key = chat_template or ""
        known = self._renders_tools.get(key)
        if known is None:
            probe = [{"role": "user", "content": "?"}]
            tool = {"type": "function", "function": {"name": "hp_probe_tool", "description": "probe",
                                                     "parameters": {"type": "object", "properties": {}}}}
            try:
                with_tools = self._render(probe, True, False, chat_template, {"tools": [tool]})
                known = with_tools != self._render(probe, True, False, chat_template, {})
            except Exception:  # a template that chokes on tools does not render them
                known = False
            self._renders_tools[key] = known
        return known

    def _tokenize_marked(self, text: str, literals: dict[str, str]) -> list[int]:
        """Tokenize rendered text whose special tokens all come from the template:
        split at them (as the tokenizer itself does), and tokenize each piece with
        the placeholders turned back into their text, as plain characters."""
        specials = self.special_tokens
        pattern = re.compile("|".join(re.escape(sp) for sp in sorted(specials, key=len, reverse=True)))
        ids: list[int] = []
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                ids += self.tokenize(_replace_all(text[pos:m.start()], literals), False, split_special_tokens=True)
            ids.append(specials[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self.tokenize(_replace_all(text[pos:], literals), False, split_special_tokens=True)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None, operator_messages: int = 0) -> str:
        """The prompt text for a conversation; template_kwargs are extra variables
        for the template (e.g. Qwen3's enable_thinking); tools go to the template, or
        into the conversation when the template does not render them (tool_prompt.py).
        With `operator_messages` > 0 the first that many messages are the operator's (a
        gateway's forced system prompt): tools are written into the conversation after
        them, never by the template, which may put them inside the first system turn, so
        the operator's turns render exactly as without tools. Raises InvalidRequestError
        when the tokenizer has no template, the template rejects the messages, or
        operator_messages is more than the messages."""
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                                      "chat_template_kwargs")
        if chat_template is None and not getattr(self._original, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; give one with --chat-template")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        kwargs = dict(template_kwargs or {})
        if not 0 <= operator_messages <= len(messages):
            raise InvalidRequestError(f"operator_messages is {operator_messages}, the request has {len(messages)} "
                                      "messages", "operator_messages")
        if tools and operator_messages:
            return self._render_after_operator(messages, tools, operator_messages, add_generation_prompt,
                                               continue_final_message, chat_template, kwargs)
        if tools:
            if self.renders_tools(chat_template):
                kwargs["tools"] = tools
            else:
                messages = with_tools(messages, tools)
        try:
            return self._render(messages, add_generation_prompt, continue_final_message, chat_template, kwargs)
        except Exception as e:  # jinja2 errors, template raise_exception(), bad message shapes
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from None

    def _render_after_operator(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], after: int,
                               add_generation_prompt: bool, continue_final_message: bool, chat_template: str | None,
                               kwargs: dict[str, Any]) -> str:
        """apply_chat_template's rendering with tools after the operator's messages: in a
        system turn of their own, or, for a template that takes one system message only,
        at the start of the next message. Raises InvalidRequestError."""
        try:
            return self._render(with_tools(messages, tools, after), add_generation_prompt, continue_final_message,
                                chat_template, kwargs)
        except Exception:  # a template that refuses a second system turn
            pass
        try:
            return self._render(with_tools(messages, tools, after, own_turn=False), add_generation_prompt,
                                continue_final_message, chat_template, kwargs)
        except Exception as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from None

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
                chat_template: str | None, kwargs: dict[str, Any]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template, **kwargs)

    def encode_request(self, body: dict[str, Any], chat_template: str | None = None) -> list[int]:
        """Token ids of an OpenAI request body exactly as the server builds them:
        `messages` through the chat template (no extra special tokens), `prompt`
        text with the tokenizer's special tokens, or `prompt` token ids as given.
        Raises InvalidRequestError."""
        if "messages" in body:
            msgs = [{"role": m["role"], "content": m["content"] if isinstance(m.get("content"), str)
                     else "".join(p.get("text", "") for p in m.get("content") or [])} for m in body["messages"]]
            return self.encode_chat(msgs, True, False, chat_template)
        p = body.get("prompt")
        if isinstance(p, str):
            return self.tokenize(p, body.get("add_special_tokens", True))
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return list(p)
        raise InvalidRequestError("a request needs `messages`, or `prompt` as text or token ids")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"the text holds a lone surrogate at character {e.start}; send valid Unicode",
                                  "prompt") from None


def _replace_all(text: str, mapping: dict[str, str]) -> str:
    if not mapping:
        return text
    pattern = re.compile("|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)))
    return pattern.sub(lambda m: mapping[m.group()], text)


def _strings(*objs: Any):
    """Every string inside nested lists and dicts (keys and values)."""
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def _map_strings(o: Any, fn) -> Any:
    """o with fn applied to every string inside it (a copy; keys too)."""
    if isinstance(o, str):
        return fn(o)
    if isinstance(o, dict):
        return {fn(k) if isinstance(k, str) else k: _map_strings(v, fn) for k, v in o.items()}
    if isinstance(o, list):
        return [_map_strings(v, fn) for v in o]
    return o
