"""A Hugging Face fast tokenizer read from its files without importing transformers
(a generic one: tokenizer.json and no class of its own, as the GGUF conversions are saved).

Importing transformers and resolving AutoTokenizer took 1.2 s of a 4 s start on the
default model. A fast tokenizer's folder holds everything needed: tokenizer.json (the
Rust `tokenizers` model that PreTrainedTokenizerFast itself runs), tokenizer_config.json
and special_tokens_map.json (the named special tokens), and the chat template
(chat_template.jinja, chat_template.json or the config's field). FastTokenizer reads them
and offers the part of PreTrainedTokenizerFast's interface hotprefix and its users call,
with the same results (tests/model/test_fast_tokenizer.py compares them with transformers').

Chat templates are rendered by transformers' own renderer (render_jinja_template), so a
template sees exactly what it sees under transformers; that module is imported at the
first render, or ahead of it by preload_renderer() once the server is up.

Thread safety: the Rust tokenizers are never changed after they are made (text that must
not become special tokens goes through a second one, made at first use under a lock and
sharing the first one's model: tokenizers/backend.py), so one FastTokenizer serves every
thread; copying it returns itself. tokenizer.json is read by tokenizers/backend.py too,
in less memory than Tokenizer.from_file.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken as RustAddedToken
from tokenizers import Tokenizer

from hotprefix.tokenizers.backend import load_backend, special_text_twin

# tokenizer_config.json's tokenizer_class values whose transformers class is the tokenizers
# model and nothing more (the GGUF conversions are saved so); other classes are left to it
GENERIC_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_renderer_lock = threading.Lock()


@dataclass(frozen=True)
class AddedToken:
    """An added token as added_tokens_decoder shows it."""

    content: str
    special: bool


def _token_text(value: Any) -> str | None:
    """A special token as a config writes it: its text, or {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def mark_generic(folder: str | Path) -> None:
    """Mark a saved tokenizer whose tokenizer.json is the whole tokenizer (a GGUF file's,
    converted by transformers) as generic, so that from_folder reads it: transformers 5
    saves the architecture's class (GemmaTokenizer for gemma3 files), whose code only
    builds the backend that tokenizer.json already holds. Rewrites tokenizer_config.json;
    raises OSError when it cannot."""
    path = Path(folder) / "tokenizer_config.json"
    config = _read_json(path)
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        path.write_text(json.dumps({**config, "tokenizer_class": "TokenizersBackend"}, indent=2), encoding="utf-8")


def _chat_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template: chat_template.jinja, chat_template.json, or the config's
    (a string, or a list of named templates, given as a dict by name)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    return template if isinstance(template, (str, dict)) else None


def _add_listed_tokens(backend: Tokenizer, listed: Any) -> None:
    """Add the tokens tokenizer_config.json lists (added_tokens_decoder) that tokenizer.json
    lacks, in id order, as transformers does when it loads the folder. Mutates backend
    (before the FastTokenizer is shared)."""
    if not isinstance(listed, dict):
        return
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    for _, t in sorted(listed.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        if not isinstance(t, dict) or not isinstance(t.get("content"), str) or t["content"] in have:
            continue
        special = bool(t.get("special", False))
        token = RustAddedToken(t["content"], single_word=bool(t.get("single_word", False)),
                               lstrip=bool(t.get("lstrip", False)), rstrip=bool(t.get("rstrip", False)),
                               normalized=bool(t.get("normalized", not special)), special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
        have.add(t["content"])


def preload_renderer() -> None:
    """Import transformers' chat template renderer now (about 0.7 s, once per process)."""
    with _renderer_lock:
        from transformers.utils import chat_template_utils  # noqa: F401


class FastTokenizer:
    """PreTrainedTokenizerFast's tokenizing, decoding, special tokens and chat templates,
    over a `tokenizers.Tokenizer` (see the module doc). Immutable."""

    def __init__(self, backend: Tokenizer, config: dict[str, Any], specials: dict[str, Any],
                 chat_template: str | dict[str, str] | None, name_or_path: str = "") -> None:
        _add_listed_tokens(backend, config.get("added_tokens_decoder"))
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        named = {**specials, **{k: v for k, v in config.items() if v is not None}}  # the config's come first
        self.special_tokens_map = {k: t for k in SPECIAL_ATTRS if (t := _token_text(named.get(k))) is not None}
        self.added_tokens_decoder = {i: AddedToken(t.content, bool(t.special))
                                     for i, t in sorted(backend.get_added_tokens_decoder().items())}
        self._splitting: Tokenizer | None = None  # the same, with special-token text kept as text
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: str | Path) -> FastTokenizer | None:
        """The folder's fast tokenizer, or None when it has no tokenizer.json (a slow one:
        transformers must convert it). Raises ValueError for files that cannot be read."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            return None
        try:
            config = _read_json(folder / "tokenizer_config.json")
            if config.get("tokenizer_class") not in GENERIC_CLASSES:
                return None  # a class with code of its own (LlamaTokenizerFast...): transformers runs it
            backend = load_backend(folder / "tokenizer.json")
            specials = _read_json(folder / "special_tokens_map.json")
        except Exception as e:  # OSError, JSON errors, and the tokenizers library's own Exception
            raise ValueError(f"cannot read the tokenizer in {folder}: {e}") from None
        return cls(backend, config, specials, _chat_template(folder, config), str(folder))

    def __deepcopy__(self, memo: dict) -> FastTokenizer:
        return self  # immutable: every thread may share it

    def __copy__(self) -> FastTokenizer:
        return self

    # -- special tokens ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in SPECIAL_ATTRS:
            return self.special_tokens_map.get(name)
        if name.endswith("_token_id") and name[:-3] in SPECIAL_ATTRS:
            text = self.special_tokens_map.get(name[:-3])
            return None if text is None else self.backend_tokenizer.token_to_id(text)
        raise AttributeError(name)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for t in self.all_special_tokens if (i := self.backend_tokenizer.token_to_id(t)) is not None]

    # -- text and ids ------------------------------------------------------------------
    def _splitter(self) -> Tokenizer:
        with self._lock:
            if self._splitting is None:
                self._splitting = special_text_twin(self.backend_tokenizer)
            return self._splitting

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of text. split_special_tokens: text spelling a special token stays text."""
        tok = self._splitter() if split_special_tokens else self.backend_tokenizer
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
                 ) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens, split_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # -- chat templates ----------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template to render: a named one of several, the given text, or the model's.
        Raises ValueError when there is none."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in own else "default"
                if name not in own:
                    raise ValueError(f"this model has several chat templates and no default: {sorted(own)}")
                return own[name]
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("this tokenizer has no chat template")
        return own

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict] | None = None,
                            documents: list[dict[str, str]] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """The conversation rendered by its template as transformers renders it (the named
        special tokens and kwargs as template variables; keys whose value is None
        dropped); token ids when `tokenize` (no special tokens added). Raises ValueError
        (and the template's own errors)."""
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        with _renderer_lock:
            from transformers.utils.chat_template_utils import render_jinja_template
        conversation = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        out = render_jinja_template(conversations=[conversation], tools=tools, documents=documents,
                                    chat_template=template, continue_final_message=continue_final_message,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens_map, **kwargs})
        text = (out[0] if isinstance(out, tuple) else out)[0]  # (texts, generation indices)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
