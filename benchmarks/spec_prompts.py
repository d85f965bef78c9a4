"""The speculation workloads' prompts, one owner for the in-process benchmark
(speculative.py) and the HTTP one (spec_http.py): the same chat messages, and the same
JSON schema for `json`, whichever server or engine runs them.

  quote   a ~1,500-token document (docs/engine.md's opening) and "repeat the paragraph about ..."
  edit    a 122-line Python file (hotprefix/core/fairness.py) and "rename X to Y, output the file"
  json    a schema-constrained extraction (SCHEMA)
  unique  a story, nothing to copy
  chat    a multi-turn chat: a system prompt, two earlier turns, a new question (little to copy)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("quote", "edit", "json", "unique", "chat")
SCHEMA = {"type": "object", "properties": {
    "lighthouses": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "built": {"type": "integer"}, "fuel": {"type": "string"}},
        "required": ["name", "built", "fuel"]}}}, "required": ["lighthouses"]}
LIGHTHOUSES = " ".join(
    f"The lighthouse at {name} was built in {year} and burned {fuel}." for name, year, fuel in [
        ("Carrow Point", 1871, "whale oil"), ("Dunmore Head", 1889, "kerosene"), ("Skerry Rock", 1902, "acetylene"),
        ("Hollin Bay", 1911, "kerosene"), ("Marram Ness", 1923, "electricity"), ("Gull Island", 1930, "diesel")])

CHAT = [
    {"role": "system", "content": "You are a friendly assistant who gives practical advice."},
    {"role": "user", "content": "I want to start running. How far should I go in my first week?"},
    {"role": "assistant", "content": "Start small: three runs of 15 to 20 minutes, mixing a minute of easy "
     "running with a minute of walking. Rest a day between runs, and keep the pace easy enough to talk."},
    {"role": "user", "content": "Thanks. What should I eat before a morning run?"},
    {"role": "assistant", "content": "Something light an hour before: a banana, a slice of toast with honey, "
     "or a small bowl of oats, and a glass of water. Skip heavy, fatty or very fibrous food."},
    {"role": "user", "content": "And how do I keep going when it rains all week?"},
]


def document(tokens: int, tokenize: Callable[[str], list[int]], text: str | None = None) -> str:
    """The leading paragraphs of `text` (default docs/engine.md) whose tokens (by `tokenize`)
    are at most `tokens`, each followed by a blank line."""
    out = ""
    for para in (text if text is not None else (ROOT / "docs" / "engine.md").read_text()).split("\n\n"):
        if len(tokenize(out + para)) > tokens:
            break
        out += para + "\n\n"
    return out


def prompts(tokenize: Callable[[str], list[int]]) -> dict[str, tuple[list[dict], dict | None]]:
    """Each workload's chat messages and its JSON schema (None: unconstrained), by name."""
    doc = document(1500, tokenize)
    code = (ROOT / "hotprefix" / "core" / "fairness.py").read_text()
    return {
        "quote": ([{"role": "user", "content": f"{doc}\nRepeat, word for word, the paragraph of this document "
                    "about converting a GGUF file's tokenizer."}], None),
        "edit": ([{"role": "user", "content": f"```python\n{code}```\n\nRename the function `water_fill` to "
                   "`fair_split` everywhere in this file. Output the whole file."}], None),
        "json": ([{"role": "user", "content": f"{LIGHTHOUSES}\n\nExtract every lighthouse as JSON: its name, the "
                   "year it was built, its fuel."}], SCHEMA),
        "unique": ([{"role": "user", "content": "Write a short story about a fox who learns to sail."}], None),
        "chat": (CHAT, None),
    }
