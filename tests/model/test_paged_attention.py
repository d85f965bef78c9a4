"""hp_attend (csrc/attention.c): attention straight from the KV pool, against attention
computed in float64 on gathered keys; and its batch invariance at the kernel: a row's
bits do not depend on the task it is in, on a cascade's split of its keys, or on the
build (AVX-512 through the simulated build, AVX2, plain C)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from hotprefix.model.kernels import build, ops
from hotprefix.model.kernels.abi import bind
from hotprefix.model.kernels.ops import ATT_FINAL, ATT_INIT, AttPlan, AttState
from hotprefix.model.kv_cache import LayerKV

MARCHES = [("native", ())]
if platform.machine() == "x86_64":
    if " avx2 " in build._cpu_signature() + " ":
        MARCHES += [("x86-64-v3", ()), ("x86-64-v3", ("HP_SIM512",))]
    MARCHES += [("x86-64", ())]


def _lib(march, defines=()):
    path = build.build_library(march=march, defines=defines)
    assert path is not None, f"the kernel did not build for -march={march} {defines}"
    return bind(path)


@pytest.fixture(scope="module", params=MARCHES, ids=lambda p: "+".join((p[0], *p[1])))
def lib(request):
    return _lib(*request.param)


@pytest.fixture(scope="module")
def libs():
    return [_lib(*m) for m in MARCHES]


def plan(tasks, rows, lims, slots) -> AttPlan:
    return AttPlan(torch.tensor(tasks).reshape(-1, 6), torch.tensor(rows), torch.tensor(lims).reshape(-1, 2),
                   torch.tensor(slots))


def pool(kvh=2, slots=300, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return LayerKV(0, torch.randn(kvh, slots, d, generator=gen), torch.randn(kvh, slots, d, generator=gen))


def reference(q_row, kv, head, slots, lo, hi, scale):
    """Attention of one query over positions [lo, hi) (slots: position order from 0), in float64."""
    ks = slots[lo:hi]
    scores = kv.k[head, ks].double() @ q_row.double() * scale
    return torch.softmax(scores, 0) @ kv.v[head, ks].double()


@pytest.mark.parametrize("d", [64, 80])  # 80: a head size that is not a multiple of the vector
def test_tasks_attend_their_rows_to_their_positions(lib, d):
    """A causal prefill task (rows with different ends), a windowed one, and a decode."""
    kv = pool(d=d)
    gen = torch.Generator().manual_seed(1)
    t, h = 6, 4
    q = torch.randn(t, h, d, generator=gen)
    slots = torch.randperm(300, generator=gen)[:70]  # one sequence's 70 positions, scattered
    rows = [0 * h + 0, 1 * h + 0, 2 * h + 1, 3 * h + 2, 4 * h + 3, 5 * h + 1]
    lims = [[0, 37], [0, 38], [30, 45], [0, 70], [5, 21], [64, 70]]
    heads = [0, 0, 1, 1, 1, 0]
    tasks = [[i, 1, 0, 0, heads[i], ATT_FINAL] for i in range(len(rows))]
    tasks[0:2] = [[0, 2, 0, 0, 0, ATT_FINAL]]  # two rows, two ends, one task
    out = torch.full((t, h, d), float("nan"))
    ops.attend(q, kv.k, kv.v, plan(tasks, rows, lims, slots.tolist()), 0.125, out, None, lib)
    flat, qf = out.view(t * h, d), q.view(t * h, d)
    for r, (lo, hi), j in zip(rows, lims, heads):
        assert torch.allclose(flat[r].double(), reference(qf[r], kv, j, slots, lo, hi, 0.125), atol=1e-5)
    untouched = sorted(set(range(t * h)) - set(rows))
    assert torch.isnan(flat[untouched]).all()  # only planned rows written


def test_a_row_has_the_same_bits_in_any_task_and_through_a_cascade(lib):
    """Row 5 attends positions [0, 50): alone; in a task with 7 other rows of other ends;
    and as a cascade, [0, 32) saved as state then [32, 50) continued from it."""
    kv = pool()
    q = torch.randn(8, 1, 64, generator=torch.Generator().manual_seed(2))
    slots = list(range(100, 150))
    alone = torch.zeros(8, 1, 64)
    ops.attend(q, kv.k, kv.v, plan([[0, 1, 0, 0, 0, ATT_FINAL]], [5], [0, 50], slots), 0.1, alone, None, lib)
    together = torch.zeros(8, 1, 64)
    ends = [[0, 43 + i] for i in range(8)]
    ends[5] = [0, 50]
    ops.attend(q, kv.k, kv.v, plan([[0, 8, 0, 0, 0, ATT_FINAL]], list(range(8)), ends, slots), 0.1, together,
               None, lib)
    state, split = AttState.empty(8, 64), torch.zeros(8, 1, 64)
    ops.attend(q, kv.k, kv.v, plan([[0, 1, 0, 0, 0, 0]], [5], [0, 32], slots[:32]), 0.1, split, state, lib)
    ops.attend(q, kv.k, kv.v, plan([[0, 1, 0, 32, 0, ATT_INIT | ATT_FINAL]], [5], [32, 50], slots[32:]), 0.1,
               split, state, lib)
    assert torch.equal(alone[5], together[5]) and torch.equal(alone[5], split[5])


def test_every_build_gives_the_same_bits(libs):
    """The same plan on every build of the library: bit-identical outputs (no reduction
    crosses vector lanes; exp is one polynomial)."""
    kv = pool(kvh=3, d=64, seed=5)
    q = torch.randn(20, 6, 64, generator=torch.Generator().manual_seed(6)) * 3
    rng = np.random.default_rng(0)
    slots = rng.permutation(300)[:200].tolist()
    rows, lims, tasks = [], [], []
    for i in range(20):
        hi = int(rng.integers(1, 200))
        lo = int(rng.integers(0, hi))
        tasks.append([len(rows), 2, 0, 0, i % 3, ATT_FINAL])
        rows += [i * 6 + (i % 3) * 2, i * 6 + (i % 3) * 2 + 1]
        lims += [[lo, hi], [0, hi]]
    outs = []
    for lb in libs:
        out = torch.zeros(20, 6, 64)
        ops.attend(q, kv.k, kv.v, plan(tasks, rows, lims, slots), 0.125, out, None, lb)
        outs.append(out)
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:]), len(outs)


def test_plans_the_kernel_refuses(lib):
    kv = pool()
    q, out = torch.zeros(2, 1, 64), torch.zeros(2, 1, 64)
    for tasks, lims in (([[0, 1, 0, 0, 5, ATT_FINAL]], [0, 4]),  # no KV head 5
                        ([[0, 1, 0, 2, 0, ATT_FINAL]], [0, 4]),  # a range before the slots' first position
                        ([[0, 1, 0, 0, 0, ATT_FINAL]], [3, 3])):  # an empty range
        with pytest.raises(ValueError, match="refused"):
            ops.attend(q, kv.k, kv.v, plan(tasks, [0], lims, [1, 2, 3, 4]), 1.0, out, None, lib)


def test_kv_write_stores_every_token_and_head_at_its_slot(lib):
    gen = torch.Generator().manual_seed(1)
    kvh, slots_total, d, t = 3, 64, 16, 5
    qkv = torch.randn(t, (6 + 2 * kvh) * d, generator=gen)  # k and v as strided views, as the model has them
    k = qkv[:, 6 * d:(6 + kvh) * d].view(t, kvh, d)
    v = qkv[:, (6 + kvh) * d:].view(t, kvh, d)
    slots = torch.tensor([9, 3, 40, 41, 63])
    fast = LayerKV(0, torch.zeros(kvh, slots_total, d), torch.zeros(kvh, slots_total, d))
    plain = LayerKV(0, torch.zeros(kvh, slots_total, d), torch.zeros(kvh, slots_total, d))  # torch's index_copy_
    ops.kv_write(fast.k, fast.v, slots, k, v, lib)
    plain.write(slots, k, v)
    assert torch.equal(fast.k, plain.k) and torch.equal(fast.v, plain.v)
    assert torch.equal(fast.k[:, slots].transpose(0, 1), k) and fast.k.count_nonzero() == t * kvh * d


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_writes_are_torchs_cast_and_reads_are_its_dequantization(lib, dtype):
    """hp_kv_write_fp8 stores value / scale rounded exactly as torch's cast rounds (ties,
    subnormals, the largest finite value, overflow to NaN or infinity, -0.0); hp_attend
    reads a byte as its value times the scale, as LayerKV.read does."""
    edge = [0.0, -0.0, 1.0, 0.1, -3.3, 447.9, 448.0, 464.0, 479.9, 480.0, 1e6, 57344.0, 61440.0, 1e-3, 2 ** -9,
            2 ** -10, 3 * 2 ** -11, 2 ** -16, 2 ** -17, 1.5 * 2 ** -16, float("inf"), -float("inf"), 0.7265625,
            float("nan")]
    vals = torch.cat([torch.tensor(edge), torch.randn(4000, generator=torch.Generator().manual_seed(3)) * 40,
                      torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 1e-3])
    n = vals.numel() // 16 * 16
    k = vals[:n].view(-1, 1, 16)  # [T, KVH=1, D=16]
    for scale in (1.0, 0.37):
        fast = LayerKV(0, torch.zeros(1, k.shape[0], 16, dtype=dtype), torch.zeros(1, k.shape[0], 16, dtype=dtype),
                       scale, scale)
        plain = LayerKV(0, torch.zeros(1, k.shape[0], 16, dtype=dtype), torch.zeros(1, k.shape[0], 16, dtype=dtype),
                        scale, scale)
        slots = torch.arange(k.shape[0])
        ops.kv_write(fast.k, fast.v, slots, k, -k, lib, scales=(scale, scale))
        plain.write(slots, k, -k)
        assert torch.equal(fast.k.view(torch.uint8), plain.k.view(torch.uint8))
        assert torch.equal(fast.v.view(torch.uint8), plain.v.view(torch.uint8))
    kv = pool(kvh=1, slots=64, d=64, seed=9)
    k8 = LayerKV(0, kv.k.to(dtype), kv.v.to(dtype), 0.5, 2.0)
    deq = LayerKV(0, *k8.read(torch.arange(64), torch.float32))  # what the torch path reads
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(1))
    p = plan([[0, 2, 0, 0, 0, ATT_FINAL]], [0, 1], [[0, 64], [10, 50]], list(range(64)))
    got, want = torch.zeros(1, 2, 64), torch.zeros(1, 2, 64)
    ops.attend(q, k8.k, k8.v, p, 0.125, got, None, lib, scales=(0.5, 2.0))
    ops.attend(q, deq.k.contiguous(), deq.v.contiguous(), p, 0.125, want, None, lib)
    assert torch.equal(got, want)
