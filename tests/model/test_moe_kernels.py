"""A mixture's expert FFNs in C (csrc/moe.c through ops.moe_ffn): every block type the
dense products take, in float32 mode (GGUF rows) and int8 mode (regrouped), against the
torch reference on the same dequantized weights; the bytes each expert's blocks gave
(the kernel's own counters): the chosen experts' whole, no other's; a token's output the
same bits whatever the tokens beside it and on every build; expert ids outside the table
refused before anything is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotprefix.model.gguf_loader import dequantize_rows
from hotprefix.model.kernels import abi, build, ops
from hotprefix.model.kernels.weights import ExpertBlocks
from hotprefix.model.layers import experts_torch
from tests.kquants import quantize
from tests.model.test_block_kernels import MARCHES

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
X, E, FF = 6, 256, 512  # K of both products a multiple of 256: every type's blocks fit


def experts(qtype: str, seed: int = 0, x: int = X, e: int = E, i: int = FF) -> list[ExpertBlocks]:
    """gate, up [x, i, e] and down [x, e, i] as GGUF blocks of qtype (F32: float rows)."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(x, i, e, generator=g) * 0.05, torch.randn(x, i, e, generator=g) * 0.05,
          torch.randn(x, e, i, generator=g) * 0.05]
    if qtype == "F32":
        return [ExpertBlocks.from_float(w) for w in ws]
    out = []
    for w in ws:
        raw = quantize(w.reshape(-1, w.shape[-1]).numpy(), qtype)
        out.append(ExpertBlocks.from_gguf(qtype, torch.from_numpy(np.ascontiguousarray(raw)), *w.shape))
    return out


def choices(t: int, k: int, seed: int, x: int = X) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [t, k] (distinct experts a token, as a top-k gives) and weights [t, k]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(x, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("qtype", TYPES)
def test_experts_match_the_torch_reference_in_every_block_type(qtype):
    """float32 mode: the dense products' arithmetic on gguf's dequantized values (float32
    rounding only, measured ~2e-7); int8 mode: activations rounded to int8 per block
    (measured 1.0-2.3 % of the largest output), as the dense int8 products."""
    bl = experts(qtype)
    ref_w = [dequantize_rows(b) for b in bl]
    x = torch.randn(9, E, generator=torch.Generator().manual_seed(1))
    ids, w = choices(9, 2, seed=2)
    ref = experts_torch(x, ids, w, *ref_w)
    assert rel(ops.moe_ffn(ops.MoeExperts(*bl), x, ids, w), ref) < 2e-6
    assert rel(ops.moe_ffn(ops.MoeExperts(*[b.regrouped() for b in bl]), x, ids, w), ref) < 0.035


@pytest.mark.parametrize("form", ["gguf", "int8", "f32"])
def test_only_the_chosen_experts_blocks_are_read(form):
    """The kernel's counters: each chosen expert's three projections read whole, once a
    step however many tokens chose it; an expert no token chose, not a byte."""
    bl = experts("F32" if form == "f32" else "Q4_K")
    if form == "int8":
        bl = [b.regrouped() for b in bl]
    m = ops.MoeExperts(*bl)
    per_expert = sum(b.expert_bytes for b in bl)
    for ids in ([[4, 1]], [[0, 3, 5], [3, 0, 1], [5, 3, 0], [1, 5, 3], [3, 5, 1]], [[2], [2]]):
        ids = torch.tensor(ids)
        reads = torch.zeros(X, dtype=torch.int64)
        ops.moe_ffn(m, torch.randn(*ids.shape[:1], E), ids, torch.rand(ids.shape), reads)
        chosen = set(ids.flatten().tolist())
        assert reads.tolist() == [per_expert if e in chosen else 0 for e in range(X)]


@pytest.mark.parametrize("qtype,int8", [("Q4_K", False), ("Q8_0", False), ("F32", False), ("Q4_K", True),
                                        ("Q8_0", True)])  # (int8 mode reads GGUF blocks: no F32 there)
def test_a_tokens_output_does_not_depend_on_the_other_tokens(qtype, int8):
    """Batch invariance: 300 tokens x 4 experts of 5 (1,200 slots: several waves, and an
    expert with more slots than a wave holds) give each token the bits it gets alone, in
    a few of them, or with the batch reversed."""
    bl = experts(qtype, x=5)
    m = ops.MoeExperts(*[b.regrouped() for b in bl] if int8 else bl)
    x = torch.randn(300, E, generator=torch.Generator().manual_seed(6))
    ids, w = choices(300, 4, seed=7, x=5)
    full = ops.moe_ffn(m, x, ids, w)
    for i in (0, 151, 299):
        assert torch.equal(ops.moe_ffn(m, x[i:i + 1], ids[i:i + 1], w[i:i + 1]), full[i:i + 1])
    assert torch.equal(ops.moe_ffn(m, x[40:47], ids[40:47], w[40:47]), full[40:47])
    assert torch.equal(ops.moe_ffn(m, x.flip(0), ids.flip(0), w.flip(0)).flip(0), full)


@pytest.fixture(scope="module")
def every_lib():
    return [abi.bind(build.build_library(march=m, defines=d)) for m, d in MARCHES]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_0", "Q5_1"])
def test_every_build_gives_the_same_bits(qtype, every_lib):
    """AVX-512 VNNI (simulated where the CPU has only AVX2), AVX2 and plain C: the same
    bits in both modes."""
    bl = experts(qtype, seed=8)
    x = torch.randn(17, E, generator=torch.Generator().manual_seed(9))
    ids, w = choices(17, 2, seed=10)
    for form in (bl, [b.regrouped() for b in bl]):
        m = ops.MoeExperts(*form)
        outs = [ops.moe_ffn(m, x, ids, w, lib=lb) for lb in every_lib]
        assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:])


def test_an_expert_id_outside_the_table_is_refused_before_anything_is_read():
    m = ops.MoeExperts(*experts("Q8_0"))
    x = torch.randn(3, E)
    reads = torch.zeros(X, dtype=torch.int64)
    for bad in (X, -1, 1 << 40):
        ids = torch.tensor([[0, 1], [2, bad], [3, 4]])
        with pytest.raises(ValueError, match="outside the table of 6 experts"):
            ops.moe_ffn(m, x, ids, torch.ones(3, 2), reads)
    assert reads.tolist() == [0] * X


@pytest.mark.parametrize("int8", [False, True])
def test_an_expert_named_twice_for_a_token_is_added_twice(int8):
    """No top-k names an expert twice, but the kernel sums whatever it is given: both
    slots of the repeated expert count (the reference's arithmetic)."""
    bl = experts("Q8_0", seed=11)
    ref_w = [dequantize_rows(b) for b in bl]
    m = ops.MoeExperts(*[b.regrouped() for b in bl] if int8 else bl)
    x = torch.randn(3, E, generator=torch.Generator().manual_seed(12))
    ids, w = torch.tensor([[3, 3, 1], [5, 2, 5], [0, 0, 0]]), torch.rand(3, 3)
    assert rel(ops.moe_ffn(m, x, ids, w), experts_torch(x, ids, w, *ref_w)) < (0.035 if int8 else 2e-6)


def test_experts_that_do_not_fit_are_refused():
    gate, up, down = experts("Q8_0")
    with pytest.raises(ValueError, match="gate and up"):
        ops.MoeExperts(gate, down, down)  # up of down's shape
    with pytest.raises(ValueError, match="one form"):
        ops.MoeExperts(gate.regrouped(), up, down)
    with pytest.raises(ValueError, match="moe_ffn"):
        ops.moe_ffn(ops.MoeExperts(gate, up, down), torch.randn(2, E + 32), *choices(2, 2, 1))
    assert ExpertBlocks.from_gguf("Q4_K", torch.zeros(X * 16 * 90, dtype=torch.uint8), X, 16, 160) is None
