"""Sampling parameters: plain, validated data (no torch).

Every field is honoured by the sampler or the engine; `validate()` raises
ValueError naming the offending field, so the server can turn it into a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bounds on what one request may ask of every engine step (each list is walked per step).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 4096
MAX_TOP_K = 1 << 20
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


class StructuredKind(str, Enum):
    """What constrains a structured output: a JSON schema, any JSON object, a regular
    expression, one of a list of strings, or a grammar (Lark, or GBNF)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output, enforced by a token mask each step. `spec` is the
    schema (JSON text), the regex, the choices (a JSON list) or the grammar. `grammar`
    is its compiled form (set by the engine when it accepts the request)."""

    kind: StructuredKind
    spec: str = ""
    grammar: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to choose the next tokens and when to stop.

    temperature 0 (or below SAMPLING_EPS) means greedy. top_k 0 or -1 means no top-k cut. Penalties
    follow vLLM: repetition over prompt and output tokens (divide positive
    logits, multiply negative ones), presence and frequency over output tokens
    only (OpenAI's definition). `logprobs` asks for the sampled token's log
    probability and that many alternatives (from the raw model distribution).
    `logit_bias` adds a bias to the logits of given token ids before sampling.
    `structured` constrains the output (JSON schema, regex, choice, grammar).
    `seed` is any int64 (vLLM's range); the n samples of one request use seed,
    seed + 1, ... wrapping within int64. Token ids are checked against the
    model's vocabulary by the engine, which knows it.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (and this many alternatives); no cache hits
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in
                                                                self.logit_bias.items())))
        # Normalise list inputs so that the dataclass stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field (never echoing a whole list)."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check(math.isfinite(getattr(self, name)), name, getattr(self, name), "must be a finite number")
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.max_tokens is None or self.max_tokens >= 0, "max_tokens", self.max_tokens,
               "must be >= 0 (0: the prompt only, for its logprobs)")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or 0 <= self.top_k <= MAX_TOP_K, "top_k", self.top_k,
               f"must be -1, 0 (disabled) or in [1, {MAX_TOP_K}]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "must be in [0, 20]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               self.prompt_logprobs, "must be in [0, 20]")
        _check(self.seed is None or (isinstance(self.seed, int) and INT64_MIN <= self.seed <= INT64_MAX), "seed",
               self.seed, f"must be an integer in [{INT64_MIN}, {INT64_MAX}]")
        self._validate_lists()
        if self.structured is not None:
            _check(not self.ignore_eos, "ignore_eos", True, "cannot be used with a structured output (its end is EOS)")

    def _validate_lists(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", len(self.stop),
               f"must hold at most {MAX_STOP_STRINGS} strings")
        bad = next((s for s in self.stop if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS),
                   None)
        _check(bad is None, "stop", str(bad)[:40],
               f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", len(self.stop_token_ids),
               f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        bad = next((t for t in self.stop_token_ids if not isinstance(t, int) or t < 0), None)
        _check(bad is None, "stop_token_ids", bad, "must be non-negative token ids")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", len(self.logit_bias),
               f"must hold at most {MAX_LOGIT_BIAS} entries")
        bad = next(((t, b) for t, b in self.logit_bias if t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0)),
                   None)
        _check(bad is None, "logit_bias", bad, "must map token ids to finite biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below SAMPLING_EPS (vLLM's rule): dividing logits by a smaller
        one overflows to inf, and softmax's inf - inf is NaN (a client's 1e-40 drew the
        vocabulary's last token every time)."""
        return self.temperature < SAMPLING_EPS

    @property
    def effective_top_k(self) -> int:
        """0 when top-k is disabled (0 or -1)."""
        return max(self.top_k, 0)

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of the index-th of n samples: n=1, and a distinct derived
        seed (seed + index, wrapped into int64)."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return replace(self, n=1, seed=seed)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")


@dataclass
class Logprob:
    """One token's log probability and its rank among all tokens (1 = most likely)."""

    token_id: int
    logprob: float
    rank: int
    decoded: str = ""


@dataclass
class TokenLogprobs:
    """The sampled token's logprob plus the top alternatives at one position."""

    sampled: Logprob
    top: list[Logprob] = field(default_factory=list)
