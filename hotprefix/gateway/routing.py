"""Prefix-affinity routing over several backends.

Each request has a route key: the text of its tenant's system prompt (public
prompts: the same key for every tenant that shares them, so their common KV is
computed on one backend; private prompts: the tenant too). Backends are ranked
for a key by rendezvous hashing (highest SHA-256 of key + backend URL first):
a key keeps its backend while that backend is up, and when one goes away only
its keys move. Bounded load: a backend whose in-flight count is at or above
its cap, max(`load_factor` × the mean in-flight count counting this request,
`min_cap`), is skipped for the next in the ranking, so one hot tenant cannot
pile everything onto one backend, while a few concurrent requests of one
tenant still stay together with their cache.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from enum import Enum

log = logging.getLogger("hotprefix.gateway.monitor")


class BackendKind(str, Enum):
    """What a backend is, learnt from its /version: hotprefix (salt offsets, /pin,
    /tokenize, operator_messages) or any other OpenAI-compatible server."""

    UNKNOWN = "unknown"
    HOTPREFIX = "hotprefix"
    OPENAI = "openai"


@dataclass
class Backend:
    url: str
    healthy: bool = False
    inflight: int = 0
    kind: BackendKind = BackendKind.UNKNOWN
    model: str | None = None
    max_model_len: int | None = None  # from its /v1/models, when it says
    last_error: str | None = None
    token_counts: dict[str, int] = field(default_factory=dict)  # prompt text hash -> tokens, per backend

    max_n: int | None = None  # the most samples one request may ask for, when it says (hotprefix: --max-n)

    @property
    def supports_salt(self) -> bool:
        return self.kind is BackendKind.HOTPREFIX

    @property
    def supports_lookup(self) -> bool:
        """It answers GET /requests/{id}: a request's usage by the id the gateway gave it."""
        return self.kind is BackendKind.HOTPREFIX

    def mark_down(self, why: str) -> None:
        """Out of routing until a health check finds it up (logged when it was up). The
        one place a backend goes down: the health checks and the proxy call it."""
        if self.healthy:
            log.warning("backend %s is down: %s", self.url, why)
        self.healthy, self.last_error = False, why

    def note_error(self, why: str) -> None:
        """An error that does not take it out of routing (a warm-up's): its last error, shown
        on the dashboard until the next one or its next change of health."""
        self.last_error = why

    def mark_up(self) -> None:
        """Back in routing; what was learnt of its prompts is forgotten (it may have
        restarted with another model or template)."""
        self.healthy, self.last_error = True, None
        self.token_counts.clear()


def route_key(prompt_text: str | None, public: bool, tenant: str) -> str:
    """Requests with the same key share a prefix worth keeping on one backend."""
    head = (prompt_text or "")[:4096]
    return ("public\0" if public else f"tenant\0{tenant}\0") + head


def _score(key: str, url: str) -> bytes:
    return hashlib.sha256(key.encode() + b"\0" + url.encode()).digest()


class Router:
    """Ranks healthy backends for a route key. Mutates nothing itself; callers
    count in-flight requests on the Backend objects."""

    def __init__(self, backends: list[Backend], load_factor: float = 1.25, min_cap: int = 4) -> None:
        if not backends:
            raise ValueError("at least one backend")
        if load_factor < 1 or min_cap < 1:
            raise ValueError("load_factor and min_cap must be >= 1")
        self.backends = backends
        self.load_factor = load_factor
        self.min_cap = min_cap

    def _smallest(self, limit: str) -> int | None:
        known = [getattr(b, limit) for b in self.backends if b.healthy and getattr(b, limit)]
        return min(known) if known else None

    def max_model_len(self) -> int | None:
        """The smallest context any healthy backend reports (None: none reports one)."""
        return self._smallest("max_model_len")

    def max_n(self) -> int | None:
        """The smallest samples-per-request limit any healthy backend reports (None: none reports one)."""
        return self._smallest("max_n")

    def find(self, url: str) -> Backend | None:
        return next((b for b in self.backends if b.url == url), None)

    def ranking(self, key: str, healthy_only: bool = True) -> list[Backend]:
        """Backends in rendezvous order for `key` (the first is the key's home)."""
        pool = [b for b in self.backends if b.healthy or not healthy_only]
        return sorted(pool, key=lambda b: _score(key, b.url), reverse=True)

    def order(self, key: str) -> list[Backend]:
        """The backends to try for one request, in order: the first under the load
        bound, then the rest of the ranking (for failover). Empty when none is healthy."""
        ranked = self.ranking(key)
        if not ranked:
            return []
        total = sum(b.inflight for b in ranked) + 1
        cap = max(self.min_cap, math.ceil(self.load_factor * total / len(ranked)))
        first = next((b for b in ranked if b.inflight < cap), ranked[0])
        return [first] + [b for b in ranked if b is not first]
