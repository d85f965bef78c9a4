"""hp_paged_attention (csrc/attention.c): decode attention straight from the KV pool,
against attention computed in float64 on gathered keys."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model import qlinear
from hotprefix.model.attention import _paged_attend
from hotprefix.model.kv_cache import LayerKV

MARCHES = ["native"] + (["x86-64"] if qlinear.platform.machine() == "x86_64" else [])


@pytest.fixture(scope="module", params=MARCHES)
def lib(request):
    path = qlinear.build_library(march=request.param)
    assert path is not None, f"the kernel did not build for -march={request.param}"
    return qlinear.bind(path)


@pytest.mark.parametrize("d", [64, 80])  # 80: the vector paths' other column loop
def test_tasks_attend_their_rows_to_their_slots(lib, d):
    """Few rows per task take dot products on the keys as stored, many rows a
    transposed chunk of keys: both are checked."""
    gen = torch.Generator().manual_seed(0)
    kvh, slots_total, h, t = 2, 300, 6, 5
    g = h // kvh
    kv = LayerKV(0, torch.randn(kvh, slots_total, d, generator=gen), torch.randn(kvh, slots_total, d, generator=gen))
    q = torch.randn(t, h, d, generator=gen)
    # task 0: token 1's heads 0-2 on 70 scattered slots (over two chunks of 32 plus a tail);
    # task 1: tokens 0, 3 and 4 together (a cascade's members) on 5 slots of KV head 1;
    # task 2: token 2, KV head 0, one slot
    key_sets = [torch.randperm(slots_total, generator=gen)[:70], torch.tensor([7, 8, 9, 10, 11]), torch.tensor([42])]
    row_sets = [[1 * h + i for i in range(g)], [tt * h + g + i for tt in (0, 3, 4) for i in range(g)], [2 * h + 0]]
    heads = [0, 1, 0]
    rows = torch.tensor([r for rs in row_sets for r in rs])
    task, off_r, off_s = [], 0, 0
    for rs, ks, j in zip(row_sets, key_sets, heads):
        task.append([off_r, len(rs), off_s, ks.numel(), j])
        off_r, off_s = off_r + len(rs), off_s + ks.numel()
    out = torch.full((t * h, d), float("nan"))
    lse = torch.full((t * h,), float("nan"))
    _paged_attend(lib, q, kv, (rows, torch.tensor(task), torch.cat(key_sets)), 0.125, out, lse)
    qf = q.reshape(t * h, d).double()
    for rs, ks, j in zip(row_sets, key_sets, heads):
        for r in rs:
            scores = kv.k[j, ks].double() @ qf[r] * 0.125
            want = torch.softmax(scores, 0) @ kv.v[j, ks].double()
            assert torch.allclose(out[r].double(), want, atol=1e-5)
            assert abs(float(lse[r]) - float(torch.logsumexp(scores, 0))) < 1e-5
    untouched = sorted(set(range(t * h)) - set(rows.tolist()))
    assert torch.isnan(out[untouched]).all() and torch.isnan(lse[untouched]).all()  # only planned rows written


def test_kv_write_stores_every_token_and_head_at_its_slot(lib):
    gen = torch.Generator().manual_seed(1)
    kvh, slots_total, d, t = 3, 64, 16, 5
    qkv = torch.randn(t, (6 + 2 * kvh) * d, generator=gen)  # k and v as strided views, as the model has them
    k = qkv[:, 6 * d:(6 + kvh) * d].view(t, kvh, d)
    v = qkv[:, (6 + kvh) * d:].view(t, kvh, d)
    slots = torch.tensor([9, 3, 40, 41, 63])
    fast = LayerKV(0, torch.zeros(kvh, slots_total, d), torch.zeros(kvh, slots_total, d), kernel=lib)
    plain = LayerKV(0, torch.zeros(kvh, slots_total, d), torch.zeros(kvh, slots_total, d))  # torch's index_copy_
    fast.write(slots, k, v)
    plain.write(slots, k, v)
    assert torch.equal(fast.k, plain.k) and torch.equal(fast.v, plain.v)
    assert torch.equal(fast.k[:, slots].transpose(0, 1), k) and fast.k.count_nonzero() == t * kvh * d
