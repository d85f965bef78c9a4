"""FastTokenizer (tokenizers/fast_tokenizer.py) against transformers' own tokenizer on the
same files: the same ids, text, special tokens and rendered chat templates, exactly."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hotprefix.model.loader import _tokenizer_cache_dir, default_model_path, gguf_tokenizer, load_tokenizer
from hotprefix.tokenizers.fast_tokenizer import FastTokenizer
from tests.conftest import build_tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.content is defined %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>{{ c | tojson }}</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
    "{{ bos_token if false else '' }}{% if eos_token %}{% endif %}")
TEXTS = ["Hello world", "", " ", "  two  spaces ", "<|im_start|>user\nhi<|im_end|>", "a<|im_end|>b<|endoftext|>",
         "a <|tool|> b plainword c",
         "東京😀 café naïve", "def f(x):\n\treturn x * 2\n", "<|im_start", "x" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me <|im_end|> now 東京"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny"}],
    [{"role": "user", "content": "Write a"}, {"role": "assistant", "content": "Once upon a time"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=["default-model", "tiny", "named-templates", "listed-tokens", "bos-eos"])
def pair(request, tmp_path_factory):
    """(ours, transformers') on the same folder."""
    if request.param == "default-model":
        gguf_tokenizer(default_model_path())  # the converted cache
        folder = _tokenizer_cache_dir(default_model_path())
    else:
        folder = tmp_path_factory.mktemp(request.param)
        hf = build_tokenizer(folder)
        if request.param == "named-templates":  # several templates by name, specials in their own file
            hf.clean_up_tokenization_spaces = True
            hf.save_pretrained(str(folder))
            (folder / "chat_template.jinja").unlink(missing_ok=True)
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            cfg["chat_template"] = [{"name": "default", "template": hf.chat_template},
                                    {"name": "tool_use", "template": TOOL_TEMPLATE}]
            (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        if request.param == "listed-tokens":  # tokens the config lists and tokenizer.json lacks
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            n = len(hf)
            cfg["added_tokens_decoder"] = {
                str(n): {"content": "<|tool|>", "special": True, "normalized": False},
                str(n + 1): {"content": "plainword", "special": False, "normalized": True}}
            (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        if request.param == "bos-eos":  # flags the generic class does not act on (its subclasses do)
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True,
                                                                      "add_eos_token": True}))
    ours = FastTokenizer.from_folder(folder)
    assert ours is not None
    return ours, AutoTokenizer.from_pretrained(str(folder))


def test_ids_and_text_are_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            for split in (False, True):
                assert ours(text, add_special_tokens=special, split_special_tokens=split)["input_ids"] == \
                    hf(text, add_special_tokens=special, split_special_tokens=split)["input_ids"], (text, special)
        assert ours.encode(text) == hf.encode(text)
    ids = list(range(min(len(hf), 400))) + [0, 1, 2, 17, 2]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids[:50]) == hf.convert_ids_to_tokens(ids[:50])
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()


def test_special_tokens_are_transformers(pair):
    ours, hf = pair
    assert ours.special_tokens_map == hf.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(hf, name)
        assert getattr(ours, name + "_id") == getattr(hf, name + "_id")
    assert sorted(ours.all_special_tokens) == sorted(hf.all_special_tokens)
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}


def rendered(tok, conv, **kw):
    """The rendering, or the name of the error it raised (a template may refuse a conversation)."""
    try:
        return tok.apply_chat_template(conv, **kw)
    except Exception as e:
        return type(e).__name__


def test_chat_templates_render_as_transformers_renders_them(pair):
    ours, hf = pair
    cases = [dict(add_generation_prompt=True), dict(add_generation_prompt=False), dict(continue_final_message=True),
             dict(add_generation_prompt=True, tools=TOOLS), dict(add_generation_prompt=True, enable_thinking=False),
             dict(add_generation_prompt=True, chat_template=TOOL_TEMPLATE, tools=TOOLS)]
    for conv in CONVERSATIONS:
        for kw in cases:
            for tokenize in (False, True):
                want = rendered(hf, conv, tokenize=tokenize, return_dict=False, **kw)
                assert rendered(ours, conv, tokenize=tokenize, **kw) == want, (conv, kw)
    with pytest.raises(ValueError):
        ours.apply_chat_template([], tokenize=False)
    with pytest.raises(ValueError):
        ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, continue_final_message=True)


def test_one_tokenizer_serves_every_thread(pair):
    """Immutable: a copy is the same object, and threads tokenizing at once (with and without
    split special tokens) each get the answers a lone caller gets."""
    ours, _ = pair
    assert copy.deepcopy(ours) is ours
    want = {(t, s): ours.encode(t, split_special_tokens=s) for t in TEXTS for s in (False, True)}
    bad: list = []

    def work(seed: int) -> None:
        for i in range(200):
            key = list(want)[(seed + i) % len(want)]
            if ours.encode(key[0], split_special_tokens=key[1]) != want[key]:
                bad.append(key)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_a_folder_without_tokenizer_json_is_left_to_transformers(tmp_path):
    assert FastTokenizer.from_folder(tmp_path) is None
    build_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizerFast"}))
    assert FastTokenizer.from_folder(tmp_path) is None  # a class with code of its own, too
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the tokenizer"):
        FastTokenizer.from_folder(tmp_path)
    with pytest.raises(Exception, match="cannot read the tokenizer"):
        load_tokenizer(str(tmp_path))


def test_the_default_model_loads_without_importing_transformers():
    code = ("import sys; from hotprefix.model.loader import gguf_tokenizer, default_model_path; "
            "t = gguf_tokenizer(default_model_path()); t.encode('hi'); t.decode([1, 2]); "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2]).stdout.split()
    assert out == ["FastTokenizer", "False"]
