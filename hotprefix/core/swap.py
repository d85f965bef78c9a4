"""Host-memory blocks for swap-mode preemption (ids only; the runner owns the tensors)."""

from __future__ import annotations


class SwapSpace:
    """A free list of host block ids. `allocate` is all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int] | None:
        """n host block ids, or None (and no change) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        """Return ids. Raises ValueError on a double free."""
        if set(ids) & set(self._free) or len(set(ids)) != len(ids):
            raise ValueError(f"double free of host blocks {ids}")
        self._free.extend(reversed(ids))
