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
worker process that is killed when it runs over its CPU budget (grammar_sandbox.py);
both compile a spec with grammar_build.py. The runner copies the compiled matcher for
each sequence (model/structured.py) and holds every later mask to the same budget.
Torch-free: it sits beside sampling_params.py, below the engine and the model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Any

from hotprefix.errors import InvalidRequestError
from hotprefix.grammar_build import MASK_BUDGET_S as MASK_BUDGET_S  # (model/structured.py reads it here)
from hotprefix.grammar_build import Compiled, build
from hotprefix.grammar_limits import GrammarLimits
from hotprefix.grammar_sandbox import CompileSandbox, SandboxConfig
from hotprefix.sampling_params import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    from hotprefix.config import StructuredConfig

GRAMMAR_CACHE = 256  # distinct specs kept compiled


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
        self._cache: OrderedDict[tuple[StructuredKind, str], Compiled] = OrderedDict()  # under _cache_lock
        self._cache_lock = threading.Lock()
        self.hits = self.misses = 0  # lookups of the cache (under _cache_lock)

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

    def compiles(self, so: StructuredOutput) -> bool:
        """Whether `so` would be compiled now (it is not in the cache): what the
        preprocessing workers' compile budget counts."""
        with self._cache_lock:
            return (so.kind, so.spec) not in self._cache

    def _compiled(self, so: StructuredOutput) -> Compiled:
        """The cached compilation of a spec (the GRAMMAR_CACHE most recently used are
        kept). Raises InvalidRequestError for a refused one."""
        key = (so.kind, so.spec)
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if compiled is None:
            compiled = self._compile_uncached(so.kind, so.spec)  # (two threads may compile one spec at once)
            with self._cache_lock:
                self._cache[key] = compiled
                while len(self._cache) > GRAMMAR_CACHE:
                    self._cache.popitem(last=False)
        if compiled.error is not None:
            raise InvalidRequestError(compiled.error, so.kind.value)
        return compiled

    def close(self) -> None:
        """Stop the sandbox's worker processes (if any); compiling starts new ones."""
        if self.sandbox is not None:
            self.sandbox.close()

    def _compile_uncached(self, kind: StructuredKind, spec: str) -> Compiled:
        try:
            self.limits.check(kind.value, spec)
            grammar = self.sandbox.grammar(kind, spec) if self.sandbox is not None else None
        except InvalidRequestError as e:
            return Compiled(error=str(e))
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
    sandbox = CompileSandbox(SandboxConfig(vocab_size, tuple(sorted(eos)), sc.max_grammar_compile_seconds),
                             partial(tokenizer_json, hf_tokenizer))
    return GrammarCompiler(hf_tokenizer, vocab_size, limits, sandbox)


def tokenizer_json(tokenizer: Any) -> str:
    """A fast tokenizer's Rust model as JSON, without padding or truncation (what
    llguidance reads; as llguidance.hf makes it, without importing transformers). The
    tokenizer is copied (a second vocabulary, for a moment) only when it pads or truncates."""
    from copy import copy

    b = tokenizer.backend_tokenizer
    if b.padding is not None or b.truncation is not None:
        b = copy(b)
        b.no_padding()
        b.no_truncation()
    return b.to_str()
