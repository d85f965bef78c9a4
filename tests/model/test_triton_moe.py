"""The fused MoE in Triton (kernels/triton_moe.py) against the torch reference
(layers.experts_torch), run by Triton's interpreter on CPU tensors (no GPU needed) and
compiled where CUDA is present: tokens sorted by expert in whole tiles, the gate/up
product with silu * up in its epilogue, the down product with the router weights in its
epilogue, each token's outputs summed."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model.kernels.triton_moe import BLOCK_M, fused_moe, moe_align
from hotprefix.model.layers import experts_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(t: int, k: int, x: int, e: int, ff: int, seed: int, skew: bool = False):
    """x [t, e], ids [t, k] (distinct a token; `skew`: every token's first expert is 0),
    weights, and gate, up [x, ff, e], down [x, e, ff]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, e, generator=g)
    ws = [torch.randn(x, ff, e, generator=g) * 0.1, torch.randn(x, ff, e, generator=g) * 0.1,
          torch.randn(x, e, ff, generator=g) * 0.1]
    ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(x - 1, generator=g)[:k - 1]]) if skew
                       else torch.randperm(x, generator=g)[:k] for _ in range(t)])
    return h, ids, torch.rand(t, k, generator=g), ws


@pytest.mark.parametrize("shape", [
    (1, 2, 4, 64, 32),     # a decode step
    (7, 2, 5, 48, 40),     # sizes no tile divides
    (40, 3, 6, 64, 96),    # experts with several tiles of slots
    (3, 2, 16, 32, 32),    # most experts unused
])
def test_fused_moe_matches_the_torch_reference(shape):
    h, ids, w, ws = case(*shape, seed=sum(shape))
    ref = experts_torch(h, ids, w, *ws)
    got = fused_moe(*(a.to(DEVICE) for a in (h, ids, w, *ws)), block_n=32, block_k=32).cpu()
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_one_expert_chosen_by_every_token():
    h, ids, w, ws = case(37, 2, 4, 32, 32, seed=3, skew=True)
    ref = experts_torch(h, ids, w, *ws)
    got = fused_moe(*(a.to(DEVICE) for a in (h, ids, w, *ws)), block_n=32, block_k=32).cpu()
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_moe_align_puts_each_experts_slots_in_whole_tiles_of_it():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2], [0, 1], [3, 0]])
    x, p = 5, ids.numel()
    slots, tile_expert = moe_align(ids, x)
    assert slots.numel() == tile_expert.numel() * BLOCK_M == -(-(p + x * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    real = slots[slots < p].tolist()
    assert sorted(real) == list(range(p))  # every slot once
    flat = ids.flatten().tolist()
    for tile, e in enumerate(tile_expert.tolist()):
        s = [v for v in slots[tile * BLOCK_M:(tile + 1) * BLOCK_M].tolist() if v < p]
        if e == x:
            assert s == []  # past the used tiles
        else:
            assert s and all(flat[v] == e for v in s) and s == sorted(s)  # its expert's, tokens in order
    assert sorted({e for e in tile_expert.tolist() if e < x}) == [0, 1, 2, 3]  # expert 4: no tile
