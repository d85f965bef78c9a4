"""The fused decode step's all-reduce over tensor-parallel ranks (hp_stack.reduce).

hp_decode_layers runs every layer in one C call; over several ranks each row-parallel
product (o, down) gives partial sums that every rank must add up before the residual.
`Reducer` is the C callback that does it: the kernel's thread that entered the call (the
caller's, with the GIL released by ctypes) calls it with its buffer's address, while the
other threads wait at a barrier; it hands the Python all-reduce a float32 tensor over
that buffer, summed in place. An exception cannot cross C: the first is kept (later
calls then do nothing, so a lost peer is not waited for twice per layer) and `check`
raises it after the C call returns.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from hotprefix.model.kernels.abi import REDUCE


class Reducer:
    """hp_stack.reduce over `reduce` (a tensor summed over the ranks in place); None: alone,
    a NULL callback. Keep it as long as a stack names it (the C pointer is its `c`)."""

    def __init__(self, reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        self.reduce = reduce
        self.error: BaseException | None = None
        self.c = REDUCE(self._call) if reduce is not None else REDUCE()  # (REDUCE(): NULL)

    def _call(self, address: int, n: int) -> None:
        if self.error is not None:
            return
        try:
            self.reduce(torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32))
        except BaseException as e:  # (nothing may propagate into C)
            self.error = e

    def check(self) -> None:
        """Raises (once) what `reduce` raised during the last C call, if it did."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error
