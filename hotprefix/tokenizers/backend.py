"""The Rust `tokenizers.Tokenizer` of a tokenizer.json, built in less memory, and the
same tokenizer with special-token text kept as text, sharing its model.

`Tokenizer.from_file` parses the whole file with serde: the vocabulary's strings are
allocated between the parser's temporaries, whose freed holes glibc cannot hand back.
For a 262,144-token BPE (the Gemma 3 shaped GGUFs') that left +74 MiB after
malloc_trim where the same model built from the parsed vocabulary holds +53. So a BPE
is built here as the deserializer builds it, in its order (model; normalizer,
pre-tokenizer, post-processor and decoder; then each added token, special ones by
add_special_tokens, as tokenizer.json lists them), from the vocabulary parsed by Python;
anything else (another model, padding or truncation set) is read by
`Tokenizer.from_str`. Both give the same tokenizer: the same `to_str()`, byte for byte
(tests/model/test_tokenizer_backend.py checks it).

`Tokenizer(model)` shares the model (an Arc in the Rust binding) rather than copying
it, so the splitting twin costs the added tokens' tables, not a second vocabulary (+72
MiB at 262,144 tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models

# the parts a Tokenizer holds beside its model and added tokens, set by attribute
PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
# the BPE fields tokenizer.json stores beside vocab and merges (BPE()'s keyword arguments)
BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
               "byte_fallback", "ignore_merges")
BPE_FIELDS = frozenset(("type", "vocab", "merges", *BPE_OPTIONS))
ADDED_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _assemble(model: models.Model, parts: Tokenizer, added: list[AddedToken]) -> Tokenizer:
    """A Tokenizer over `model` (shared, not copied) with `parts`' normalizer,
    pre-tokenizer, post-processor and decoder, and `added` added in order, as the
    deserializer adds them (ids: the model's for its own tokens, else the next free)."""
    tok = Tokenizer(model)
    for name in PARTS:
        setattr(tok, name, getattr(parts, name))
    for t in added:
        (tok.add_special_tokens if t.special else tok.add_tokens)([t])
    return tok


def _added_token(spec: dict[str, Any]) -> AddedToken:
    """An added_tokens entry of tokenizer.json, every flag as the file spells it. Raises
    KeyError or TypeError for an entry tokenizer.json's writer would not make (then
    from_str reads the file, and decides)."""
    flags = {k: spec[k] for k in ADDED_FLAGS}
    if not isinstance(spec["content"], str) or not all(isinstance(v, bool) for v in flags.values()):
        raise TypeError(f"an added token as tokenizer.json does not write one: {spec!r}")
    return AddedToken(spec["content"], **flags)


def _build_bpe(spec: dict[str, Any]) -> Tokenizer | None:
    """tokenizer.json's BPE tokenizer built part by part, or None for one this does not
    build (another model, padding, truncation, another version). Raises what the
    tokenizers library raises for a malformed BPE (and KeyError, TypeError: _added_token)."""
    model = spec.get("model")
    if (spec.get("version") != "1.0" or not isinstance(model, dict) or model.get("type") != "BPE"
            or not BPE_FIELDS.issuperset(model)  # a field this does not know: from_str's to read
            or spec.get("padding") is not None or spec.get("truncation") is not None
            or not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list)
            or not all(type(i) is int for i in model["vocab"].values())):  # (bools are ints to Python)
        return None
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    bpe = models.BPE(model["vocab"], merges, **{k: model[k] for k in BPE_OPTIONS if model.get(k) is not None})
    del merges
    shell = Tokenizer.from_str(json.dumps({**spec, "added_tokens": [],
                                           "model": {"type": "BPE", "vocab": {}, "merges": []}}))
    return _assemble(bpe, shell, [_added_token(t) for t in spec.get("added_tokens") or []])


def load_backend(path: Path) -> Tokenizer:
    """The tokenizer of a tokenizer.json file. Raises OSError, ValueError (JSON) and the
    tokenizers library's Exception, as Tokenizer.from_str does for the same file."""
    text = path.read_text(encoding="utf-8")
    spec = json.loads(text)
    try:
        tok = _build_bpe(spec) if isinstance(spec, dict) else None
    except Exception:  # a malformed file: from_str below raises its own error for it
        tok = None
    return tok if tok is not None else Tokenizer.from_str(text)


def special_text_twin(backend: Tokenizer) -> Tokenizer:
    """`backend` with encode_special_tokens set (text spelling a special token is
    tokenized as text), sharing its model and parts; a full copy when the shared one
    would not get the same added tokens."""
    added = backend.get_added_tokens_decoder()
    twin = _assemble(backend.model, backend, [added[i] for i in sorted(added)])
    if twin.get_added_tokens_decoder() != added:
        twin = Tokenizer.from_str(backend.to_str())
    twin.encode_special_tokens = True
    return twin
