"""Token masks of structured outputs, on the engine thread: one llguidance matcher
per constrained sequence, advanced by every token it samples.

The masks are computed after the forward pass, before sampling. Computing them on a
helper thread during the forward pass gained nothing measurable on 2 cores (the
forward pass uses both; benchmarks/structured_overhead.py, docs/benchmarks.md), so
there is no such thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hotprefix.grammar import MASK_BUDGET_S
from hotprefix.sampling_params import StructuredOutput


@dataclass
class StepMasks:
    """What the grammars forbid this step: `forbidden[request_id]` is a [V] bool row
    (True = the grammar forbids that token); `failed[request_id]` says why a
    request's matcher could not give a mask (it then fails alone)."""

    forbidden: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class GrammarMatchers:
    """The matchers of the running constrained sequences (by request id), for
    `vocab_size` logits. `source` is the GrammarCompiler that compiled their specs and
    copies its matchers for them. Engine thread only."""

    def __init__(self, source, vocab_size: int) -> None:
        self._source = source
        self.vocab_size = vocab_size
        self._matchers: dict[str, object] = {}

    def compute(self, requests: list[tuple[str, StructuredOutput]]) -> StepMasks:
        """The masks of `requests` (request id, its constraint); creates the matchers
        of new requests. Never raises: a matcher that cannot be made or is in an error
        state, or whose mask takes more than MASK_BUDGET_S of CPU time, lands in the result's
        `failed`."""
        import llguidance.torch as lt

        masks, live = StepMasks(), []
        for rid, so in requests:
            try:
                m = self._matcher(rid, so)
            except Exception as e:  # noqa: BLE001 - a grammar the matcher refuses fails its request alone
                masks.failed[rid] = f"the grammar matcher could not start: {e}"
                continue
            if m.is_error():
                masks.failed[rid] = f"the grammar matcher failed: {m.get_error()}"
            else:
                live.append((rid, m))
        if not live:
            return masks
        bitmask = torch.empty(len(live), -(-self.vocab_size // 32), dtype=torch.int32)  # [k, V/32] 1 = allowed
        slow: dict[int, float] = {}
        broken: dict[int, str] = {}
        for i, (_, m) in enumerate(live):
            t = time.thread_time()  # CPU time: waiting for the GIL or a core is not the grammar's cost
            lt.fill_next_token_bitmask(m, bitmask, i)
            if (took := time.thread_time() - t) > MASK_BUDGET_S:
                slow[i] = took
            if m.is_error():  # a limit hit while filling: the mask is not the grammar's (often "end only")
                broken[i] = m.get_error()
        empty = (bitmask == 0).all(dim=1).tolist()
        forbidden = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [k, 32W]
        rows = torch.from_numpy(forbidden[:, :self.vocab_size]).view(torch.bool)  # [k, V]
        for i, (rid, _) in enumerate(live):
            if i in broken:
                masks.failed[rid] = f"the grammar matcher failed: {broken[i]}"
            elif i in slow:  # one more such step would stall the whole batch again
                masks.failed[rid] = (f"the grammar is too complex to enforce: one token mask took "
                                     f"{slow[i] * 1e3:.0f} ms (the limit is {MASK_BUDGET_S * 1e3:.0f} ms)")
            elif empty[i]:  # sampling from nothing would pick an arbitrary token
                masks.failed[rid] = "the grammar allows no next token"
            else:
                masks.forbidden[rid] = rows[i]
        return masks

    def _matcher(self, request_id: str, so: StructuredOutput):
        m = self._matchers.get(request_id)
        if m is None:
            m = self._matchers[request_id] = self._source.new_matcher(so)
        return m

    def consume(self, request_id: str, token: int) -> str | None:
        """Advance a sequence's matcher by its sampled token; returns why it failed,
        or None."""
        m = self._matchers.get(request_id)
        if m is None:
            return None
        if not m.consume_token(token):
            return f"the grammar rejected token {token}: {m.get_error()}"
        return None

    def drop(self, request_id: str) -> None:
        """Forget a finished sequence's matcher."""
        self._matchers.pop(request_id, None)
