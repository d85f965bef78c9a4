"""Builders for torch-free core tests."""

from __future__ import annotations

import itertools

from hotprefix.core.hashing import UNSALTED, CacheScope
from hotprefix.core.request import Request
from hotprefix.sampling_params import SamplingParams

_fresh = itertools.count(1)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4, start_token: int | None = None,
                 prompt: list[int] | None = None, priority: int = 0, eos: frozenset[int] = frozenset(),
                 cache_scope: CacheScope = UNSALTED, pin_prefix: bool = False,
                 **params) -> Request:
    """A request whose prompt is start_token, start_token + 1, ... (by default a
    range no other request shares) unless prompt is given."""
    if start_token is None:
        start_token = 100_000 * next(_fresh)
    ids = prompt if prompt is not None else list(range(start_token, start_token + num_prompt_tokens))
    return Request(request_id, ids, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos,
                   priority=priority, cache_scope=cache_scope, pin_prefix=pin_prefix)
