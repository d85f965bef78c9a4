"""One request as the prefix cache sees it (what a replay, a pass or a simulation reads)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    """One request as the cache sees it: the hashes of its full blocks (prompt, then
    output), its prompt length and how many tokens it generated."""

    hashes: Sequence[bytes]  # or a log's hex digests: the curve's models read either
    prompt_tokens: int
    output_tokens: int = 1

    @property
    def computed_tokens(self) -> int:
        """Tokens whose KV is written: the last sampled token never is."""
        return self.prompt_tokens + max(self.output_tokens, 1) - 1
