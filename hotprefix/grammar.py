"""Structured outputs: a request's constraint (JSON schema, JSON object, regex, choice,
grammar) compiled for the model's tokenizer by llguidance, the grammar library
hotprefix uses (docs/server.md says why: no dependencies beyond its wheel, JSON
schema, regex and Lark/GBNF grammars, and a token mask in about 0.2 ms on the
default model's 49k vocabulary).

The compiler is thread-safe and caches each distinct spec (and each refusal):
preprocessing workers compile before a request reaches the engine, and so validate
it (a bad schema is a 400 naming the problem) and pay for building its matcher and
its first token mask there, off the engine thread; a grammar whose first mask takes
longer than MASK_BUDGET_S is refused as too complex. Before that, a spec is checked
against the size limits (grammar_limits.py) and, with a sandbox, compiled first in a
worker process that is killed when it runs over its CPU budget (grammar_sandbox.py). The runner copies the compiled
matcher for each sequence (model/structured.py) and holds every later mask to the
same budget. Torch-free: it sits beside sampling_params.py, below the engine and
the model.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from hotprefix.errors import InvalidRequestError
from hotprefix.grammar_limits import GrammarLimits
from hotprefix.sampling_params import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    from hotprefix.config import StructuredConfig
    from hotprefix.grammar_sandbox import CompileSandbox

GRAMMAR_CACHE = 256  # distinct specs kept compiled
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
class _Compiled:
    """A spec's grammar text and a matcher at its start (copied for each sequence,
    never advanced), or why the spec is refused."""

    grammar: str = ""
    start: Any = None
    error: str | None = None


class GrammarCompiler:
    """Compiles StructuredOutput specs for one tokenizer (an HF tokenizer whose model
    has `vocab_size` logits). `tokenizer` is llguidance's view of it, made at first use
    (about 0.3 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None,
                 sandbox: CompileSandbox | None = None) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.sandbox = sandbox  # compiles each new spec first where it can be stopped (None: in process only)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compile = lru_cache(maxsize=GRAMMAR_CACHE)(self._compile_uncached)

    @property
    def tokenizer(self) -> Any:
        """llguidance's LLTokenizer of the model (made once, under a lock)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(tokenizer_json(self._hf), n_vocab=self.vocab_size,
                                                         eos_token=getattr(self._hf, "eos_token_id", None))
            return self._tokenizer

    def compile(self, so: StructuredOutput) -> StructuredOutput:
        """`so` with its grammar compiled and validated (cached per spec). Raises
        InvalidRequestError naming what is wrong with the spec, or saying it is too
        complex to enforce."""
        return StructuredOutput(so.kind, so.spec, self._compiled(so).grammar)

    def new_matcher(self, so: StructuredOutput) -> Any:
        """A fresh llguidance matcher at the start of `so`'s grammar (a copy of the
        compiled one). Raises InvalidRequestError as `compile` does."""
        return self._compiled(so).start.deep_copy()

    def _compiled(self, so: StructuredOutput) -> _Compiled:
        """The cached compilation of a spec. Raises InvalidRequestError for a refused one."""
        compiled = self._compile(so.kind, so.spec)
        if compiled.error is not None:
            raise InvalidRequestError(compiled.error, so.kind.value)
        return compiled

    def close(self) -> None:
        """Stop the sandbox's worker processes (if any); compiling starts new ones."""
        if self.sandbox is not None:
            self.sandbox.close()

    def _compile_uncached(self, kind: StructuredKind, spec: str) -> _Compiled:
        try:
            self.limits.check(kind.value, spec)
            grammar = self.sandbox.grammar(kind, spec) if self.sandbox is not None else None
        except InvalidRequestError as e:
            return _Compiled(error=str(e))
        return build(kind, spec, self.tokenizer, self.vocab_size, grammar)


def compiler_for(hf_tokenizer: Any, vocab_size: int, eos: set[int], sc: StructuredConfig) -> GrammarCompiler:
    """The output-constraint compiler with the size limits and compile budget of `sc`
    (a sandbox of worker processes when the budget is > 0 and the tokenizer is a fast
    one; its workers start at the first constraint)."""
    limits = GrammarLimits(sc.max_grammar_bytes, sc.max_grammar_properties, sc.max_grammar_enum_values,
                           sc.max_grammar_depth, sc.max_grammar_repeat)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if sc.max_grammar_compile_seconds <= 0 or backend is None:
        return GrammarCompiler(hf_tokenizer, vocab_size, limits)
    from hotprefix.grammar_sandbox import CompileSandbox, SandboxConfig

    sandbox = CompileSandbox(SandboxConfig(tokenizer_json(hf_tokenizer), vocab_size, tuple(sorted(eos)),
                                           sc.max_grammar_compile_seconds))
    return GrammarCompiler(hf_tokenizer, vocab_size, limits, sandbox)


def tokenizer_json(tokenizer: Any) -> str:
    """A fast tokenizer's Rust model as JSON, without padding or truncation (what
    llguidance reads; as llguidance.hf makes it, without importing transformers)."""
    from copy import copy

    b = copy(tokenizer.backend_tokenizer)
    b.no_padding()
    b.no_truncation()
    return b.to_str()


def build(kind: StructuredKind, spec: str, tokenizer: Any, vocab_size: int, grammar: str | None = None) -> _Compiled:
    """Compile a spec (or its grammar text, already made from it) for an llguidance
    tokenizer: the grammar, validated, and a matcher at its start whose first mask was
    built within MASK_BUDGET_S; or why the spec is refused. The same work in the server
    and in grammar_sandbox.py's workers. Raises nothing for a bad spec."""
    import llguidance

    try:
        grammar = grammar if grammar is not None else grammar_of(kind, spec)
    except InvalidRequestError as e:
        return _Compiled(error=str(e))
    err = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if err:
        return _Compiled(error=f"invalid {kind.value}: {err.strip().splitlines()[0][:300]}")
    start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    took = first_mask_seconds(start, vocab_size)
    if start.is_error():
        return _Compiled(error=f"invalid {kind.value}: {start.get_error().strip().splitlines()[0][:300]}")
    if took > MASK_BUDGET_S:
        return _Compiled(error=f"{kind.value} too complex: its first token mask took {took * 1e3:.0f} ms "
                               f"(the limit is {MASK_BUDGET_S * 1e3:.0f} ms)")
    return _Compiled(grammar, start)


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
