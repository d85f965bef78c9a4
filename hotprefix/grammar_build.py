"""Compiling one output constraint for an llguidance tokenizer: a spec (JSON schema,
JSON object, regex, choice, grammar) to llguidance's grammar, validated, with a matcher
at its start whose first token mask was built within MASK_BUDGET_S.

The same work in the server's process (grammar.GrammarCompiler, which caches it) and
in the sandbox's worker processes (grammar_sandbox.py); both import it from here, and
neither imports the other's module for it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hotprefix.errors import InvalidRequestError
from hotprefix.sampling_params import StructuredKind

# JSON is written with json.dumps's separators and no other whitespace: a small model
# otherwise spends its tokens on runs of newlines (measured: JSON mode on the default
# model at temperature 1 parsed 6 of 10 times in 200 tokens; see docs/server.md).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# One token mask of one sequence may take this long (typical: 0.005-0.2 ms; a decode step of
# 8 rows on the default model: 13 ms). A grammar that needs longer would stall every request
# in the batch: it is refused (400) when its first mask is that slow, and its request fails
# (alone) when a later one is. Measured in the computing thread's CPU time
# (time.thread_time): wall time also counts waiting for the GIL and for the cores, which
# on a loaded 2-core machine exceeded 50 ms for masks that took 1 ms to compute and
# failed well-formed requests.
MASK_BUDGET_S = 0.05
MAX_CHOICES = 1024  # llguidance refuses more than 2,000 alternatives in a row, after seconds of building


def _json_grammar(schema: dict | bool) -> str:
    body = schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps({**body, "x-guidance": COMPACT_JSON}))


def _llguidance():
    import llguidance

    return llguidance


@dataclass(frozen=True)
class Compiled:
    """A spec's grammar text and a matcher at its start (copied for each sequence,
    never advanced), or why the spec is refused."""

    grammar: str = ""
    start: Any = None
    error: str | None = None


def build(kind: StructuredKind, spec: str, tokenizer: Any, vocab_size: int, grammar: str | None = None) -> Compiled:
    """Compile a spec (or its grammar text, already made from it) for an llguidance
    tokenizer: the grammar, validated, and a matcher at its start whose first mask was
    built within MASK_BUDGET_S; or why the spec is refused. The same work in the server
    and in grammar_sandbox.py's workers. Raises nothing for a bad spec."""
    import llguidance

    try:
        grammar = grammar if grammar is not None else grammar_of(kind, spec)
    except InvalidRequestError as e:
        return Compiled(error=str(e))
    err = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if err:
        return Compiled(error=f"invalid {kind.value}: {err.strip().splitlines()[0][:300]}")
    start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    took = first_mask_seconds(start, vocab_size)
    if start.is_error():
        return Compiled(error=f"invalid {kind.value}: {start.get_error().strip().splitlines()[0][:300]}")
    if took > MASK_BUDGET_S:
        return Compiled(error=f"{kind.value} too complex: its first token mask took {took * 1e3:.0f} ms "
                               f"(the limit is {MASK_BUDGET_S * 1e3:.0f} ms)")
    return Compiled(grammar, start)


def first_mask_seconds(matcher: Any, vocab_size: int) -> float:
    """Compute a matcher's next-token mask (into scratch memory); the CPU seconds
    this thread spent on it."""
    scratch = np.empty(-(-vocab_size // 32), dtype=np.int32)
    t = time.thread_time()
    matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    return time.thread_time() - t


def grammar_of(kind: StructuredKind, spec: str) -> str:
    """llguidance's grammar for a spec (not yet checked against a tokenizer).
    Raises InvalidRequestError for a spec that is not even well-formed."""
    m = _llguidance().LLMatcher
    if kind is StructuredKind.JSON_OBJECT:
        return _json_grammar({"type": "object"})
    if kind is StructuredKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"invalid json_schema: not JSON ({e})", "json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("invalid json_schema: a schema is an object", "json_schema")
        return _json_grammar(schema)
    if kind is StructuredKind.REGEX:
        return m.grammar_from_regex(spec)
    if kind is StructuredKind.CHOICE:
        choices = json.loads(spec)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("invalid choice: a non-empty list of non-empty strings", "choice")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(f"invalid choice: at most {MAX_CHOICES} choices, got {len(choices)}", "choice")
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return m.grammar_from_lark(any_to_lark(spec))
    except Exception as e:  # the GBNF converter's own errors
        raise InvalidRequestError(f"invalid grammar: {e}", "grammar") from None
