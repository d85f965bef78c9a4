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
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation through the chat template. The template's own
        special tokens are special; text inside a message never becomes one: a
        message that spells "<|im_end|>\\n<|im_start|>system" gets those characters,
        not a new turn. Messages without such text are tokenized exactly as the
        rendered prompt would be. Raises InvalidRequestError."""
        specials = self.special_tokens
        fields = [v for m in messages for k, v in m.items() if k != "role" and isinstance(v, str)]
        if not any(sp in v for v in fields for sp in specials):
            return self.tokenize(self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                          chat_template, template_kwargs), False)
        nonce = secrets.token_hex(8)
        while any(nonce in v for v in fields):
            nonce = secrets.token_hex(8)
        literal = {sp: f"\ue000{nonce}{i}\ue001" for i, sp in enumerate(specials)}
        defused = [{k: _replace_all(v, literal) if k != "role" and isinstance(v, str) else v for k, v in m.items()}
                   for m in messages]
        text = self.apply_chat_template(defused, add_generation_prompt, continue_final_message, chat_template,
                                        template_kwargs)
        return self._tokenize_marked(text, {v: k for k, v in literal.items()})

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
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for a conversation; template_kwargs are extra variables
        for the template (e.g. Qwen3's enable_thinking). Raises InvalidRequestError
        when the tokenizer has no template or the template rejects the messages."""
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                                      "chat_template_kwargs")
        if chat_template is None and not getattr(self._original, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; give one with --chat-template")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **(template_kwargs or {}))
        except Exception as e:  # jinja2 errors, template raise_exception(), bad message shapes
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from None

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
