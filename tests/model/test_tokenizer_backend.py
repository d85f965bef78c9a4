"""tokenizers/backend.py: the tokenizer built part by part (in less memory) is the one
Tokenizer.from_file reads, byte for byte, and the splitting twin that shares its model is
the full copy it replaces; both give the same ids for every text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hotprefix.model.loader import _tokenizer_cache_dir, default_model_path, gguf_tokenizer
from hotprefix.tokenizers.backend import _build_bpe, load_backend, special_text_twin
from tests.conftest import build_tiny_model, build_tokenizer
from tests.gguf_util import SpmVocab, write_gguf

# special-token text (whole, cut, glued to words), whitespace runs, emoji and CJK, a lone
# surrogate's escaped spelling, bytes no piece spells (byte fallback), [PADn] text
MIXED = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant<|endoftext|>x<|im_end|><|im_start"
         "   \t\t\n\n\n   end  \u3000 \r\n東京😀👩\u200d💻 café naïve \\ud83d \\\\u00e9 \x00\x7f\u0301 "
         "<mask> [PAD5] [PAD212991] <bos><eos><pad><unk><0x41> ▁hello▁world hello world!hell "
         "def f(x):\n\treturn x * 2\n" + "ab" * 200 + " Ω≈ç√∫˜µ≤≥÷ 𝕳𝖊𝖑𝖑𝖔 \U0010ffff")
TEXTS = [MIXED, "", " ", "x", "<|im_end|>", "hello", MIXED[::-1]]


def _padded(folder: Path, out: Path) -> Path:
    """folder's tokenizer.json with its vocabulary padded to 262,144 entries as the Gemma 3
    shaped bench files' is ([PADn] tokens, benchmarks/make_gguf.py) and <mask> after it."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    vocab.update({f"[PAD{i}]": n + i for i in range(262144 - n)})
    spec["added_tokens"].append({"id": 262144, "content": "<mask>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return out


@pytest.fixture(scope="module", params=["default-model", "padded-262k", "trained", "sentencepiece-gguf"])
def tokenizer_json(request, tmp_path_factory) -> Path:
    gguf_tokenizer(default_model_path())  # the converted cache
    default = _tokenizer_cache_dir(default_model_path())
    if request.param == "default-model":
        return default / "tokenizer.json"
    if request.param == "padded-262k":
        return _padded(default, tmp_path_factory.mktemp("padded") / "tok") / "tokenizer.json"
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "trained":
        build_tokenizer(folder)
        return folder / "tokenizer.json"
    hf = build_tiny_model(folder, "gemma3", seed=3)
    path = write_gguf(folder / "spm.gguf", hf, SpmVocab(("▁", "he", "ll", "hell", "hello", "▁w", "▁wor", "▁world")),
                      "F32", arch="gemma3")
    gguf_tokenizer(path)
    return _tokenizer_cache_dir(path) / "tokenizer.json"


def test_the_built_tokenizer_is_the_one_from_file_reads(tokenizer_json):
    ours, ref = load_backend(tokenizer_json), Tokenizer.from_file(str(tokenizer_json))
    assert ours.to_str() == ref.to_str()
    assert _build_bpe(json.loads(tokenizer_json.read_text(encoding="utf-8"))) is not None  # built part by part
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special).ids == ref.encode(text, add_special_tokens=special).ids
    n = ref.get_vocab_size(with_added_tokens=True)
    ids = list(range(min(n, 600))) + list(range(n - 300, n)) + [0, 1, 2, 5, 2]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_the_twin_shares_the_model_and_splits_as_a_full_copy(tokenizer_json):
    ours = load_backend(tokenizer_json)
    twin = special_text_twin(ours)
    ref = Tokenizer.from_file(str(tokenizer_json))
    ref.encode_special_tokens = True
    assert twin.to_str() == ref.to_str()
    assert twin.encode_special_tokens and not ours.encode_special_tokens
    for text in TEXTS:
        for special in (True, False):
            assert twin.encode(text, add_special_tokens=special).ids == ref.encode(text, add_special_tokens=special).ids


def test_other_files_are_read_by_from_str(tmp_path):
    """A model other than BPE (here WordLevel), a file with padding set, a BPE field or
    an added token's flags not as tokenizer.json writes them take from_str's path, and a
    malformed file raises from_str's error."""
    from tokenizers import models

    wl = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    (tmp_path / "wl.json").write_text(wl.to_str())
    assert load_backend(tmp_path / "wl.json").to_str() == wl.to_str()
    build_tokenizer(tmp_path)
    padded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    padded.enable_padding(length=8)
    (tmp_path / "padded.json").write_text(padded.to_str())
    assert load_backend(tmp_path / "padded.json").to_str() == padded.to_str()
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    assert _build_bpe(spec) is not None
    model = spec["model"]
    assert _build_bpe({**spec, "model": {**model, "cache_capacity": 5}}) is None  # a field it does not know
    assert _build_bpe({**spec, "model": {**model, "vocab": {**model["vocab"], "x": True}}}) is None
    bare = {**spec, "added_tokens": [{"id": 0, "content": "<|endoftext|>", "special": True}]}  # no other flags
    with pytest.raises(KeyError):
        _build_bpe(bare)
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    for read in (load_backend, lambda p: Tokenizer.from_file(str(p))):  # refused alike
        with pytest.raises(Exception, match="missing field `single_word`"):
            read(tmp_path / "bare.json")
    spec["model"]["merges"] = [["no-such-token", "x"]]
    (tmp_path / "bad.json").write_text(json.dumps(spec))
    with pytest.raises(Exception, match="no-such-token"):
        load_backend(tmp_path / "bad.json")
