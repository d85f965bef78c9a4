"""Whole-step strategies: ways to run a step other than layer by layer (the fused decode
step on the CPU, CUDA-graph replay). The runner asks each, in order, whether it serves
the step; the first that does runs it, else the model runs layer by layer. Why a step
took the path it took is answered here, once (logged at debug level).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from hotprefix.model.attention.base import AttentionPaths, StepBatch

log = logging.getLogger(__name__)


class StepRunner(Protocol):
    """A way to run a whole step. refusal: None when it serves this step (its backend's
    metadata, the paths allowed), else why not; forward: the final hidden states [T, E],
    with the step's keys and values written into the pool. Raises RuntimeError when a
    kernel fails."""

    name: str

    def refusal(self, batch: StepBatch, meta: Any, paths: AttentionPaths) -> str | None: ...

    def forward(self, batch: StepBatch, meta: Any) -> torch.Tensor: ...


def choose(runners: list[StepRunner], batch: StepBatch, meta: Any, paths: AttentionPaths) -> StepRunner | None:
    """The first runner that serves the step, or None (layer by layer)."""
    for r in runners:
        why = r.refusal(batch, meta, paths)
        if why is None:
            return r
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step of %d tokens: not %s: %s", batch.num_tokens, r.name, why)
    return None
