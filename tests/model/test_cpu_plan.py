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
from hotprefix.model.kernels import ops
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


def _warm_chunk() -> StepBatch:
    """The prefix_ttft shape: 30 new queries after 1,000 cached positions (63 blocks and 2 new)."""
    return _batch([SeqSpan(0, 30, 1000, list(range(100, 165)))])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_short_chunks_rows_of_each_kv_head_are_one_equal_task_a_thread(threads):
    one, _, _ = cpu_plan.step_plans(_warm_chunk(), Shape(9, 3, None, 1), with_cascades=False)
    got, _, _ = cpu_plan.step_plans(_warm_chunk(), Shape(9, 3, None, threads), with_cascades=False)
    per = 30 // threads * 3  # each KV head's 90 rows in `threads` tasks
    assert got.task[:, 1].tolist() == [per] * 3 * threads
    assert got.task[:, 4].tolist() == [h for h in range(3) for _ in range(threads)]
    assert got.task[:, 0].tolist() == [h * 90 + i * per for h in range(3) for i in range(threads)]
    for name in ("rows", "lims", "slots"):  # the same rows and ranges, only grouped otherwise
        assert torch.equal(getattr(got, name), getattr(one, name)), name


def test_a_chunk_longer_than_short_chunk_keeps_its_tasks_by_query_tile():
    span = SeqSpan(0, cpu_plan.SHORT_CHUNK + 1, 1000, list(range(100, 170)))
    got, _, _ = cpu_plan.step_plans(_batch([span]), Shape(9, 3, None, 2), with_cascades=False)
    assert got.task[:3, 1].tolist() == [8 * 3, 16 * 3, 16 * 3]  # positions 1000-1007, 1008-1023, 1024-1039


def test_a_short_chunks_split_changes_no_bit_of_its_attention(monkeypatch):
    torch.manual_seed(0)
    k, v = torch.randn(3, 165 * BS, 64), torch.randn(3, 165 * BS, 64)
    q = torch.randn(30, 9, 64)

    def attend(shape: Shape) -> torch.Tensor:
        own, _, _ = cpu_plan.step_plans(_warm_chunk(), shape, with_cascades=False)
        out = torch.zeros_like(q)
        ops.attend(q, k, v, own, 0.125, out)
        return out

    want = attend(Shape(9, 3, None, 1))
    assert torch.equal(attend(Shape(9, 3, None, 2)), want)
    monkeypatch.setattr(cpu_plan, "SHORT_CHUNK", 0)  # by query tile, as a long chunk's
    assert torch.equal(attend(Shape(9, 3, None, 2)), want)
