"""cpu_plan's step plans: the decodes of a step, built for all sequences at once
(add_decodes), are the plan add_sequence builds one sequence at a time; the cascades'
shared plans hold every member's query heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotprefix.model.attention import cpu_plan
from hotprefix.model.attention.base import SeqSpan, StepBatch
from hotprefix.model.attention.cpu_plan import Shape, _Builder, slots_of, window_start
from hotprefix.model.kernels.ops import ATT_FINAL, ATT_INIT

BS = 16


def _batch(spans: list[SeqSpan]) -> StepBatch:
    z = torch.zeros(sum(s.q_len for s in spans), dtype=torch.int64)
    return StepBatch(z, z, z, spans, BS)


def _decodes(seed: int, n: int) -> list[SeqSpan]:
    rng = np.random.default_rng(seed)
    shared = rng.permutation(1000)[:6].tolist()
    spans = []
    for i in range(n):
        pos = int(rng.integers(0, 300))
        need = pos // BS + 1
        lead = shared[:min(need, 6)] if i % 2 else []
        spans.append(SeqSpan(i, 1, pos, lead + rng.permutation(np.arange(1000, 2000))[:need - len(lead)].tolist()))
    return spans


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("seed", range(4))
def test_a_step_of_decodes_is_the_plan_of_each_sequence_alone(seed, window):
    batch = _batch(_decodes(seed, 1 + seed * 3))
    shape = Shape(12, 4, window)
    got, _, groups = cpu_plan.step_plans(batch, shape, with_cascades=True)
    base = {i: c.shared for c in groups for i in c.members}
    want = _Builder(shape)
    for i, span in enumerate(batch.seqs):
        b = base.get(i, 0) or window_start(span, window)
        want.add_sequence(span, slots_of(span, BS, b), b, ATT_FINAL | (ATT_INIT if i in base else 0))
    want = want.plan()
    for name in ("task", "rows", "lims", "slots"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_a_cascade_shares_its_leading_blocks_with_every_member():
    lead = list(range(100, 105))
    spans = [SeqSpan(i, 1, 5 * BS + 3 + i, lead + [200 + i]) for i in range(3)] + [SeqSpan(3, 1, 40, [7, 8, 9])]
    own, shared, groups = cpu_plan.step_plans(_batch(spans), Shape(4, 2, None), with_cascades=True)
    assert groups == [cpu_plan.Cascade((0, 1, 2), 5 * BS)]
    assert shared.rows.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]  # KV head 0's query heads, then 1's
    assert shared.task.tolist() == [[0, 6, 0, 0, 0, 0], [6, 6, 0, 0, 1, 0]]
    assert shared.lims.tolist() == [[0, 5 * BS]] * 12
    assert shared.slots.tolist() == slots_of(spans[0], BS, 0)[:5 * BS].tolist()
    assert own.task[:, 5].tolist() == [ATT_FINAL | ATT_INIT] * 6 + [ATT_FINAL] * 2
