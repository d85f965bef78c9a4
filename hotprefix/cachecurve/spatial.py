"""Spatial sampling of a log's blocks (SHARDS: Waldspurger et al., FAST '15).

A `Sample` keeps the blocks whose hash falls in a range of the hash space. A block's
hash names its whole prefix, so the blocks a sample keeps of a chain are the same in
every request that has them, and kept blocks keep their order; a cache of `rate` times
the size, fed the sample, behaves as the whole cache fed the whole log, and depths in
the sample, divided by the rate, estimate depths in the log. Blocks that have no hash
(a partial block, a block the log names no hash of) are kept as a share: `Share`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Key = bytes | str  # a block's hash, or its keyed digest as a log writes it (hex): both uniform
SPACE = 1 << 16  # a sample is a range of the first 16 bits of the hashes


@dataclass(frozen=True)
class Sample:
    """The blocks whose hash's first 16 bits fall in [lo, hi) (the whole log: 0, SPACE).
    Raises ValueError for an empty or out-of-range range."""

    lo: int = 0
    hi: int = SPACE

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi <= SPACE:
            raise ValueError(f"a sample is a range within [0, {SPACE}), got [{self.lo}, {self.hi})")

    @classmethod
    def shards(cls, rate: float, count: int) -> list[Sample]:
        """`count` disjoint samples that together keep `rate` of the blocks (at least one
        hash value each)."""
        width = max(1, int(rate * SPACE) // count)
        return [cls(i * width, (i + 1) * width) for i in range(count)]

    @property
    def rate(self) -> float:
        return (self.hi - self.lo) / SPACE

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == SPACE

    def keep(self, keys: Sequence[Key]) -> list[Key]:
        """The keys in the sample, in their order (bytes compare by their first two
        bytes, hex text by its first four digits)."""
        if self.whole or not keys:
            return list(keys)
        text = isinstance(keys[0], str)
        lo = f"{self.lo:04x}" if text else self.lo.to_bytes(2, "big")
        if self.hi == SPACE:
            return [k for k in keys if lo <= k]
        hi = f"{self.hi:04x}" if text else self.hi.to_bytes(2, "big")
        return [k for k in keys if lo <= k < hi]


class Share:
    """How many of a run of unhashed blocks a sample keeps: `rate` of them, carried over
    from request to request so the total is right (mutates its carry)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._seen = 0.0

    def take(self, n: int) -> int:
        before = self._seen
        self._seen += n * self.rate
        return math.floor(self._seen) - math.floor(before)
