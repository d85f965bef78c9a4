"""A mixture's experts in Triton (the GPU path of layers.Experts): the step's (token,
expert) slots sorted by expert, each expert's run padded to whole tiles (moe_align), then
one grouped product per projection: gate and up over every tile of every chosen expert,
silu(gate) * up in the epilogue; then down, each slot's router weight in the epilogue;
then each token's k weighted outputs summed in rank order (a fixed order: no atomics).

moe_align makes every shape from T, k and the expert count alone (the padded slot count
is at most T k + X (BLOCK_M - 1)) and never reads a device value on the host, so a CUDA
graph can capture the whole path; tiles past the used ones carry the expert id X and
return at once. Where there is no CUDA device the kernels run in Triton's interpreter on
CPU tensors (also when TRITON_INTERPRET=1): that is how `make test` proves them against
layers.experts_torch, the torch reference.

Shapes: T tokens, k experts each, P = T k slots (slot = token * k + rank), X experts,
E hidden, FF expert FFN; gate, up [X, FF, E], down [X, E, FF] (row-major, contiguous).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: it decorates its own library then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_M = 16  # slots a tile: each tile belongs to one expert


def moe_align(ids: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of ids [T, k] sorted by expert, each expert's run padded to a multiple of
    block_m with the value P (no slot): sorted_slots [S] int32, S = the most that can be
    needed; and each tile's expert, tile_expert [S / block_m] int32 (X: a tile past the
    used ones). Tokens keep their order within an expert."""
    flat = ids.reshape(-1).to(torch.int64)
    p, dev = flat.numel(), flat.device
    counts = torch.zeros(experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(p, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    s = -(-(p + experts * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.full((s,), p, dtype=torch.int32, device=dev)
    sorted_slots[(pend - padded)[e_sorted] + rank] = order.to(torch.int32)
    tiles = torch.arange(0, s, block_m, device=dev)
    tile_expert = torch.searchsorted(pend, tiles, right=True).to(torch.int32)  # X past the used tiles
    return sorted_slots, tile_expert


@triton.jit
def _tile_rows(sorted_ptr, tile_expert_ptr, P, X, BLOCK_M: tl.constexpr):
    """This program's tile: its expert (X: none), slots [M] and which of them exist."""
    pid_m = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid_m)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, slots, slots < P


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, act_ptr, sorted_ptr, tile_expert_ptr, P, X, TOP_K, E, FF,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """act[slot, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for a tile of
    one expert's slots and BLOCK_N of its FF columns."""
    e, slots, valid = _tile_rows(sorted_ptr, tile_expert_ptr, P, X, BLOCK_M)
    if e >= X:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok = tl.where(valid, slots // TOP_K, 0).to(tl.int64)
    g_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    u_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = e.to(tl.int64) * FF * E
    for k0 in range(0, E, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tok[:, None] * E + kk[None, :], mask=valid[:, None] & (kk[None, :] < E), other=0.0)
        wmask = (kk[:, None] < E) & (n[None, :] < FF)
        g = tl.load(gate_ptr + w_base + n[None, :] * E + kk[:, None], mask=wmask, other=0.0)  # [K, N]
        u = tl.load(up_ptr + w_base + n[None, :] * E + kk[:, None], mask=wmask, other=0.0)
        if IEEE:
            g_acc += tl.dot(a, g, input_precision="ieee")
            u_acc += tl.dot(a, u, input_precision="ieee")
        else:
            g_acc += tl.dot(a, g)
            u_acc += tl.dot(a, u)
    act = g_acc / (1.0 + tl.exp(-g_acc)) * u_acc
    out = act_ptr + slots.to(tl.int64)[:, None] * FF + n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < FF))


@triton.jit
def _down_kernel(act_ptr, down_ptr, w_ptr, y_ptr, sorted_ptr, tile_expert_ptr, P, X, E, FF,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """y[slot, n] = w[slot] * (act[slot] . down[e, n]) for a tile of one expert's slots and
    BLOCK_N of the E columns (float32)."""
    e, slots, valid = _tile_rows(sorted_ptr, tile_expert_ptr, P, X, BLOCK_M)
    if e >= X:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(valid, slots, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = e.to(tl.int64) * E * FF
    for k0 in range(0, FF, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows[:, None] * FF + kk[None, :], mask=valid[:, None] & (kk[None, :] < FF), other=0.0)
        d = tl.load(down_ptr + w_base + n[None, :] * FF + kk[:, None], mask=(kk[:, None] < FF) & (n[None, :] < E),
                    other=0.0)
        if IEEE:
            acc += tl.dot(a, d, input_precision="ieee")
        else:
            acc += tl.dot(a, d)
    wt = tl.load(w_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    out = y_ptr + slots.to(tl.int64)[:, None] * E + n[None, :]
    tl.store(out, acc * wt[:, None], mask=valid[:, None] & (n[None, :] < E))


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """The experts' outputs [T, E] (x's dtype) for x [T, E], each token through its experts
    ids [T, k] weighted by weights [T, k] (see the module doc for the weights' shapes)."""
    t, k = ids.shape
    x_, e = gate.shape[0], x.shape[1]
    i = gate.shape[1]
    x, gate, up, down = (a.contiguous() for a in (x, gate, up, down))
    sorted_slots, tile_expert = moe_align(ids, x_)
    p = t * k
    act = torch.empty(p, i, dtype=x.dtype, device=x.device)
    y = torch.empty(p, e, dtype=torch.float32, device=x.device)
    w = weights.reshape(-1).to(torch.float32).contiguous()
    ieee = x.dtype == torch.float32
    tiles = tile_expert.shape[0]
    _gate_up_kernel[(tiles, triton.cdiv(i, block_n))](x, gate, up, act, sorted_slots, tile_expert, p, x_, k, e, i,
                                                      BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    _down_kernel[(tiles, triton.cdiv(e, block_n))](act, down, w, y, sorted_slots, tile_expert, p, x_, e, i,
                                                   BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    return y.view(t, k, e).sum(dim=1).to(x.dtype)
