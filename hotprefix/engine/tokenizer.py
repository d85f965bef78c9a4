"""Text <-> token ids and chat templates, shared by the engine and the tools (`hotprefix lint`).

HF tokenizers are not safe to call from two threads at once, and one lock
around a shared tokenizer let a long tokenization on one thread (a client's
prompt) stall decoding on another (the engine thread's detokenizer, every
request's next token). So every thread that uses a PromptEncoder gets its own
copy of the tokenizer, made once (about 0.1 s for the default model's).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from hotprefix.errors import InvalidRequestError


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

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raises InvalidRequestError for text that is not valid Unicode (a lone surrogate)."""
        _check_text(text)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None) -> str:
        """The prompt text for a conversation. Raises InvalidRequestError when the
        tokenizer has no template or the template rejects the messages."""
        if chat_template is None and not getattr(self._original, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; give one with --chat-template")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template)
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
            return self.tokenize(self.apply_chat_template(msgs, True, False, chat_template), False)
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
