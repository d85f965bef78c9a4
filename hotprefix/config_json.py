"""The flags whose value is a structure, given as vLLM gives them, in JSON:
--speculative-config and --kv-events-config; and `as_mode`, how every mode flag's text
becomes its Enum."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from hotprefix.flags import ConfigError, Unit


def as_mode(cls: type[Enum], name: str, value: object) -> Enum:
    """value as a member of the mode Enum cls. Raises ConfigError naming the flag."""
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"{name} must be one of {', '.join(m.value for m in cls)}, got {value!r}") from None


def json_object(value: Any, name: str) -> dict[str, Any]:
    """A flag's JSON text (or a dict already: an LLM keyword, --config) as a dict. Raises
    ConfigError naming the flag for text that is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ConfigError(f"{name} must be a JSON object, got {value[:200]!r}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {str(value)[:200]!r}")
    return value


class SpecMethod(str, Enum):
    """How draft tokens are proposed: ngram (vLLM's prompt lookup) finds the longest
    suffix n-gram of the request's own tokens earlier in them and proposes what followed;
    suffix also looks in the tokens of earlier requests of the same cache scope (a
    tenant's: core/suffix_table.py) where the request's own offer nothing."""

    NGRAM = "ngram"
    SUFFIX = "suffix"


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config: vLLM's JSON ({"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": .., "prompt_lookup_min": ..}); one of the two lookup bounds
    stands for both when the other is missing, and both default to 5 as in vLLM."""

    method: SpecMethod = SpecMethod.NGRAM
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    suffix_decoding_max_cached_requests: int = 10_000  # suffix: earlier requests kept per scope

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", as_mode(SpecMethod, "--speculative-config method", self.method))
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be in [1, 64], got "
                              f"{self.num_speculative_tokens}")
        if self.suffix_decoding_max_cached_requests < 1:
            raise ConfigError("--speculative-config: suffix_decoding_max_cached_requests must be >= 1, got "
                              f"{self.suffix_decoding_max_cached_requests}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ConfigError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from vLLM's JSON (text or a dict); None stays None. Raises ConfigError
        naming what is wrong: not JSON, an unknown key, a method other than ngram, a bound."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, "--speculative-config")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        known |= {"suffix_decoding_max_cached_requests"} if value.get("method") == "suffix" else set()
        if unknown := sorted(set(value) - known):
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: "
                              f"{', '.join(sorted(known))})")
        if value.get("method") not in {m.value for m in SpecMethod}:
            raise ConfigError(f"--speculative-config: method {value.get('method')!r} is not supported here "
                              "(supported: ngram and suffix, which need no draft model)")
        if "num_speculative_tokens" not in value:
            raise ConfigError("--speculative-config: num_speculative_tokens is required")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
        try:
            return cls(SpecMethod(value["method"]), int(value["num_speculative_tokens"]), int(hi), int(lo),
                       int(value.get("suffix_decoding_max_cached_requests", 10_000)))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--speculative-config: {e}") from None

    @property
    def max_draft_tokens(self) -> int:
        """The longest draft (and so the positions of the accepted-per-position counter):
        a constrained request drafts its grammar's forced tokens (up to k) before its
        n-gram tokens (up to k); an unconstrained request's drafts stay within k."""
        return 2 * self.num_speculative_tokens

    def to_json(self) -> str:
        out = {"method": self.method.value, "num_speculative_tokens": self.num_speculative_tokens,
               "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        if self.method is SpecMethod.SUFFIX:
            out["suffix_decoding_max_cached_requests"] = self.suffix_decoding_max_cached_requests
        return json.dumps(out)


SPECULATIVE = Unit(SpeculativeConfig.parse, lambda c: c.to_json(), "JSON")


class EventEncoding(str, Enum):
    """How each KV event is written in a batch: tagged, a map with its "type" (vLLM's
    msgspec structs since mid-2026); positional, an array led by its type (vLLM's earlier
    array_like structs, which llm-d's kv-cache indexer of June 2026 still reads). The
    batch itself is an array either way."""

    TAGGED = "tagged"
    POSITIONAL = "positional"


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config, the same keys with the same defaults, and hotprefix's
    `encoding`: what goes into the cache (and leaves it) is published on a ZMQ PUB socket
    (engine/kv_events.py), with a ROUTER socket that replays the last buffer_steps
    batches from a sequence number."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when enabled (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: EventEncoding = EventEncoding.TAGGED

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        object.__setattr__(self, "encoding", as_mode(EventEncoding, "--kv-events-config encoding", self.encoding))
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"--kv-events-config publisher must be zmq or null, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"--kv-events-config {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.endpoint, str) or not isinstance(self.topic, str):
            raise ConfigError("--kv-events-config endpoint and topic must be strings")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig) -> KVEventsConfig:
        """The config from its JSON text (the flag), a dict (an LLM keyword, --config) or
        itself. Raises ConfigError for bad JSON or a key vLLM's config does not have."""
        if isinstance(value, cls):
            return value
        value = json_object(value, "--kv-events-config")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ConfigError(f"--kv-events-config has no key {', '.join(unknown)} (keys: {', '.join(sorted(known))})")
        return cls(**value)
