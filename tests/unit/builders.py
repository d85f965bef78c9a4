"""Builders for torch-free core tests."""

from __future__ import annotations

from hotprefix.core.request import Request
from hotprefix.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4, start_token: int = 100,
                 prompt: list[int] | None = None, priority: int = 0, eos: frozenset[int] = frozenset(),
                 **params) -> Request:
    """A request whose prompt is start_token, start_token + 1, ... unless prompt is given."""
    ids = prompt if prompt is not None else list(range(start_token, start_token + num_prompt_tokens))
    return Request(request_id, ids, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos,
                   priority=priority)
