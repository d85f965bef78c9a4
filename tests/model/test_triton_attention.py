"""The Triton paged-attention kernels against a dense torch reference, run by Triton's
interpreter on CPU tensors (no GPU needed) and compiled where CUDA is present.

Each case lays sequences' K/V out in a shuffled pool (shared prefix blocks between
sequences, partial last blocks, contexts ending on block boundaries), writes the
step's new tokens with the kernel, and compares the kernel's attention with softmax
attention computed in float64 over each sequence's dense K/V as stored (fp8: the
stored, dequantised values, so the comparison measures the kernel, not fp8 rounding)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hotprefix.model.kernels import triton_attention
from hotprefix.model.kv_cache import LayerKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    ctx: list[int]  # each sequence's context after the step
    q_len: list[int]  # its new tokens
    h: int = 4
    kvh: int = 4
    d: int = 64
    block_size: int = 16
    shared_blocks: int = 0  # leading blocks sequences 0 and 1 share (prefix caching)
    kv_dtype: torch.dtype = torch.float32
    dtype: torch.dtype = torch.float32
    window: int = 0
    splits: int = 1


def build(case: Case, seed: int = 0):
    """(q [T, H, D], k_new, v_new [T, KVH, D], layer with the cached part written,
    slot_mapping [T], meta, dense K, V per sequence as stored [ctx, KVH, D] float64)."""
    g = torch.Generator().manual_seed(seed)
    bs, b = case.block_size, len(case.ctx)
    need = [-(-c // bs) for c in case.ctx]
    n_blocks = sum(need) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables: list[list[int]] = []
    for i, n in enumerate(need):
        if i == 1 and case.shared_blocks:
            row = tables[0][:case.shared_blocks]
        else:
            row = []
        while len(row) < n:
            row.append(perm.pop())
        tables.append(row)
    scales = (0.5, 2.0) if case.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else (1.0, 1.0)
    layer = LayerKV(0, torch.zeros(case.kvh, n_blocks * bs, case.d, dtype=case.kv_dtype),
                    torch.zeros(case.kvh, n_blocks * bs, case.d, dtype=case.kv_dtype), *scales)
    dense_k, dense_v = [], []
    for i, c in enumerate(case.ctx):
        k = torch.randn(c, case.kvh, case.d, generator=g)
        v = torch.randn(c, case.kvh, case.d, generator=g)
        if i == 1 and case.shared_blocks:  # the shared blocks hold sequence 0's tokens
            n = case.shared_blocks * bs
            k[:n], v[:n] = dense_k[0][:n], dense_v[0][:n]
        dense_k.append(k)
        dense_v.append(v)
    slots = [torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(c)]) for i, c in enumerate(case.ctx)]
    for i, c in enumerate(case.ctx):  # the cached part, written by the torch path
        cached = c - case.q_len[i]
        layer.write(slots[i][:cached], dense_k[i][:cached], dense_v[i][:cached])
    new_slots = torch.cat([slots[i][c - case.q_len[i]:] for i, c in enumerate(case.ctx)])
    k_new = torch.cat([dense_k[i][c - case.q_len[i]:] for i, c in enumerate(case.ctx)])
    v_new = torch.cat([dense_v[i][c - case.q_len[i]:] for i, c in enumerate(case.ctx)])
    q = torch.randn(sum(case.q_len), case.h, case.d, generator=g)
    width = max(need) + 1
    bt = torch.zeros(b, width, dtype=torch.int32)
    for i, row in enumerate(tables):
        bt[i, :len(row)] = torch.tensor(row)
    qsl = torch.tensor([0] + torch.tensor(case.q_len).cumsum(0).tolist(), dtype=torch.int32)
    meta = triton_attention.TritonMeta(bt, torch.tensor(case.ctx, dtype=torch.int32), qsl, max(case.q_len),
                                       case.block_size, case.splits, case.window)
    stored = []  # what the pool holds for each sequence, as the reference reads it
    for i, c in enumerate(case.ctx):
        ref = LayerKV(0, torch.zeros(case.kvh, c, case.d, dtype=case.kv_dtype),
                      torch.zeros(case.kvh, c, case.d, dtype=case.kv_dtype), *scales)
        ref.write(torch.arange(c), dense_k[i], dense_v[i])
        k, v = ref.read(torch.arange(c), torch.float64)
        stored.append((k.transpose(0, 1), v.transpose(0, 1)))  # [ctx, KVH, D]
    return q.to(case.dtype), k_new.to(case.dtype), v_new.to(case.dtype), layer, new_slots, meta, stored


def reference(case: Case, q: torch.Tensor, stored, scale: float) -> torch.Tensor:
    """Dense softmax attention in float64: query i of a chunk at position ctx - q_len + i
    sees keys 0..position (within the window). Returns [T, H, D]."""
    out, row = [], 0
    g = case.h // case.kvh
    for i, c in enumerate(case.ctx):
        n = case.q_len[i]
        k, v = stored[i]
        qs = q[row:row + n].double()  # [n, H, D]
        kx = k.repeat_interleave(g, 1)  # [ctx, H, D]
        vx = v.repeat_interleave(g, 1)
        s = torch.einsum("nhd,chd->hnc", qs, kx) * scale  # [H, n, ctx]
        qpos = torch.arange(c - n, c)[:, None]
        kpos = torch.arange(c)[None, :]
        seen = kpos <= qpos
        if case.window:
            seen &= qpos - kpos < case.window
        s = s.masked_fill(~seen, float("-inf"))
        out.append(torch.einsum("hnc,chd->nhd", torch.softmax(s, -1), vx))
        row += n
    return torch.cat(out)


def on_device(layer: LayerKV, meta: triton_attention.TritonMeta):
    """build()'s pool and metadata (made on the CPU) on DEVICE, where the kernels read them."""
    dev = torch.device(DEVICE)
    return (LayerKV(0, layer.k.to(dev), layer.v.to(dev), layer.k_scale, layer.v_scale),
            triton_attention.TritonMeta(meta.block_tables.to(dev), meta.seq_lens.to(dev),
                                        meta.query_start_loc.to(dev), meta.max_query_len, meta.block_size,
                                        meta.num_splits, meta.sliding_window))


def run(case: Case, tol: float) -> None:
    q, k_new, v_new, layer, slots, meta, stored = build(case)
    expect_k, expect_v = layer.k.clone(), layer.v.clone()
    torch_layer = LayerKV(0, expect_k, expect_v, layer.k_scale, layer.v_scale)
    torch_layer.write(slots, k_new, v_new)  # what the torch path stores
    dev = torch.device(DEVICE)
    layer, meta = on_device(layer, meta)
    scale = case.d ** -0.5
    out = triton_attention.paged_attention(q.to(dev), k_new.to(dev), v_new.to(dev), layer, slots.to(dev), meta,
                                           scale).cpu()
    # the write: byte-identical with the torch path's
    assert torch.equal(layer.k.cpu().view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(layer.v.cpu().view(torch.uint8), expect_v.view(torch.uint8))
    ref = reference(case, q, stored, scale)
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, err


F32 = 2e-5

PREFILL = {
    # a cold prefill, contexts ending mid-block and on a boundary
    "cold": Case(ctx=[37, 32, 5], q_len=[37, 32, 5]),
    # chunks after a cached prefix (the prefix read from the pool), one decode among them
    "cached-prefix": Case(ctx=[70, 48, 33], q_len=[20, 16, 1], kvh=2, h=8),
    # two sequences share their first three blocks
    "shared-blocks": Case(ctx=[60, 57], q_len=[12, 9], shared_blocks=3),
    # GQA 8, head size 128, a chunk longer than one query tile
    "gqa8-d128": Case(ctx=[90], q_len=[80], h=8, kvh=1, d=128),
    "window": Case(ctx=[75, 40], q_len=[30, 40], window=24),
    "block-size-5": Case(ctx=[23, 11], q_len=[9, 11], block_size=5),
    "fp8-e4m3": Case(ctx=[45, 30], q_len=[13, 30], kv_dtype=torch.float8_e4m3fn, h=8, kvh=2),
    "fp8-e5m2": Case(ctx=[45], q_len=[13], kv_dtype=torch.float8_e5m2),
}


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill(name):
    run(PREFILL[name], F32)


DECODE = {
    "gqa1": Case(ctx=[17, 32, 1, 48], q_len=[1] * 4),
    "gqa4-split": Case(ctx=[130, 64, 3], q_len=[1] * 3, h=8, kvh=2, splits=4),
    "gqa8-d128-split": Case(ctx=[200, 33], q_len=[1, 1], h=8, kvh=1, d=128, splits=3),
    "shared-blocks": Case(ctx=[50, 66], q_len=[1, 1], shared_blocks=3, splits=2),
    "more-splits-than-blocks": Case(ctx=[5, 20], q_len=[1, 1], splits=8),
    "window": Case(ctx=[100, 30], q_len=[1, 1], window=40, splits=3),
    "fp8-e4m3": Case(ctx=[77, 16], q_len=[1, 1], kv_dtype=torch.float8_e4m3fn, h=8, kvh=2, splits=2),
}


@pytest.mark.parametrize("name", list(DECODE))
def test_decode(name):
    run(DECODE[name], F32)


def test_half_precision_queries():
    """fp16 queries and cache: within fp16's rounding of the inputs and output."""
    run(Case(ctx=[40, 19], q_len=[8, 1], kv_dtype=torch.float16, dtype=torch.float16, h=4, kvh=2), 5e-3)


def test_padding_rows_write_nothing_and_read_nothing():
    """CUDA-graph padding: slot -1 leaves the pool as it was, a sequence of length 0
    gives 0, and the real rows are unchanged by the padding beside them."""
    case = Case(ctx=[20, 9], q_len=[1, 1], splits=2)
    q, k_new, v_new, layer, slots, meta, _ = build(case)
    q, k_new, v_new, slots = (t.to(DEVICE) for t in (q, k_new, v_new, slots))
    layer, meta = on_device(layer, meta)
    scale = case.d ** -0.5
    plain = LayerKV(0, layer.k.clone(), layer.v.clone())
    want = triton_attention.paged_attention(q, k_new, v_new, plain, slots, meta, scale)
    pad = 3
    dev = {"device": DEVICE}  # (on a GPU, every tensor the kernels read must be there)
    qp = torch.cat([q, torch.randn(pad, case.h, case.d, **dev)])
    kp = torch.cat([k_new, torch.randn(pad, case.kvh, case.d, **dev)])
    vp = torch.cat([v_new, torch.randn(pad, case.kvh, case.d, **dev)])
    sp = torch.cat([slots, torch.full((pad,), -1, dtype=slots.dtype, **dev)])
    bt = torch.cat([meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32, **dev)])
    padded = triton_attention.TritonMeta(bt, torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32, **dev)]),
                                         torch.arange(len(case.ctx) + pad + 1, dtype=torch.int32, **dev), 1,
                                         case.block_size, 2)
    before = layer.k.clone(), layer.v.clone()
    got = triton_attention.paged_attention(qp, kp, vp, layer, sp, padded, scale)
    assert torch.equal(got[:2], want)
    assert torch.equal(got[2:], torch.zeros(pad, case.h, case.d, **dev))
    assert torch.equal(layer.k, plain.k) and torch.equal(layer.v, plain.v)  # only the real slots changed
    assert not torch.equal(layer.k, before[0])


def test_decode_splits():
    assert triton_attention.decode_splits(1) == 1
    assert triton_attention.decode_splits(256) == 1
    assert triton_attention.decode_splits(257) == 2
    assert triton_attention.decode_splits(100_000) == triton_attention.MAX_DECODE_SPLITS


@pytest.mark.skipif(triton_attention.INTERPRETED, reason="numpy has no bfloat16: Triton's interpreter "
                    "rounds it unlike torch and its bf16 tl.dot returns garbage (compiled kernels only)")
def test_bfloat16_queries_and_cache():
    run(Case(ctx=[40, 19], q_len=[8, 1], kv_dtype=torch.bfloat16, dtype=torch.bfloat16, h=4, kvh=2), 3e-2)


@pytest.fixture(params=["integers", *(["native"] if triton_attention.e4m3_native(torch.device(DEVICE)) else [])])
def e4m3_path(request, monkeypatch):
    """e4m3 through Triton's fp8e4nv (sm_89 on, and the interpreter: collected only where
    the device has it) or in integer arithmetic (what sm_80 runs: Triton has no e4m3 type there)."""
    if request.param == "integers":
        monkeypatch.setattr(triton_attention, "e4m3_native", lambda device: False)
    return request.param


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_fp8_e4m3_either_path(e4m3_path, name):
    run((PREFILL if name == "prefill" else DECODE)["fp8-e4m3"], F32)


EDGES = [0.0, -0.0, 1.0, -1.0, 440.0, 448.0, 460.0, 464.0, 470.0, 480.0, 1000.0, float("inf"), -float("inf"),
         float("nan"), -float("nan"), 2.0**-10, -2.0**-10, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-6 * 1.0625, 3e38,
         1e-30, 7.97, -7.97]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 3e38 / 0.5: inf, on purpose
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_fp8_e4m3_write_is_torchs_cast(e4m3_path, scale):
    """Both paths store torch's bytes: ties to even, subnormals, saturation at 448
    (infinities too), NaN with its sign. (Saturation is written into the reference: torch
    2.13's cast saturates, older ones cast values past 464 to NaN, as the lent H200's did.)"""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.tensor(EDGES), torch.randn(40, generator=g) * 10, torch.rand(64, generator=g) / 20])
    layer = LayerKV(0, torch.zeros(1, 4, 32, dtype=torch.float8_e4m3fn, device=DEVICE),
                    torch.zeros(1, 4, 32, dtype=torch.float8_e4m3fn, device=DEVICE), scale, scale)
    triton_attention.write_kv(layer, torch.arange(4, device=DEVICE), x.view(4, 1, 32).to(DEVICE),
                              (-x).view(4, 1, 32).to(DEVICE))  # (negated here: a GPU's negation drops NaN's sign)
    for stored, value in ((layer.k, x), (layer.v, -x)):
        assert torch.equal(stored.cpu().view(torch.uint8).flatten(),
                           (value / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("max_query_len", [1, 2])  # the decode kernel, the prefill kernel
def test_fp8_e4m3_read_is_torchs_value(e4m3_path, max_query_len):
    """All 256 e4m3 bytes as the V of a sequence's one key: the output is V as torch reads
    it, exactly (0x7F and 0xFF: NaN in integers; Triton's interpreter reads them as 480)."""
    v = torch.arange(256, dtype=torch.uint8).view(4, 1, 64)  # [KVH, one slot, D]
    layer = LayerKV(0, torch.zeros(4, 1, 64, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn),
                    v.to(DEVICE).view(torch.float8_e4m3fn))
    one = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    meta = triton_attention.TritonMeta(torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), one,
                                       torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), max_query_len, 16, 1)
    out = torch.empty(1, 4, 64, device=DEVICE)
    q = torch.ones(1, 4, 64, device=DEVICE)
    attend = triton_attention.decode_attention if max_query_len == 1 else triton_attention.prefill_attention
    attend(q, layer, meta, 1.0, out)
    got, want = out.cpu().flatten(), v.view(torch.float8_e4m3fn).float().flatten()
    nan = want.isnan()
    assert nan.nonzero().flatten().tolist() == [127, 255]
    assert torch.equal(got[~nan], want[~nan])
    if e4m3_path == "integers" or not triton_attention.INTERPRETED:
        assert got[nan].isnan().all()


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_a_window_never_reads_a_released_block(name):
    """A grouped pool's window group names the pool's null block where it released one,
    before the window of the step's first query (core/kv_groups.py): here that block is
    NaN, and the answer is the reference's (the keys before the window are never loaded)."""
    case = PREFILL["window"] if name == "prefill" else DECODE["window"]
    q, k_new, v_new, layer, slots, meta, stored = build(case)
    null = layer.k.shape[1] // case.block_size  # one block past the pool
    nan = torch.full((case.kvh, case.block_size, case.d), float("nan"))
    dev = torch.device(DEVICE)
    layer = LayerKV(0, torch.cat([layer.k, nan], 1).to(dev), torch.cat([layer.v, nan], 1).to(dev))
    tables = meta.block_tables.clone()
    released = 0
    for i, (c, n) in enumerate(zip(case.ctx, case.q_len)):
        first = max(0, c - n - case.window + 1) // case.block_size
        tables[i, :first] = null
        released += first
    assert released > 0
    meta = triton_attention.TritonMeta(tables.to(dev), meta.seq_lens.to(dev), meta.query_start_loc.to(dev),
                                       meta.max_query_len, meta.block_size, meta.num_splits, meta.sliding_window)
    scale = case.d ** -0.5
    out = triton_attention.paged_attention(q.to(dev), k_new.to(dev), v_new.to(dev), layer, slots.to(dev), meta,
                                           scale).cpu()
    assert (out.double() - reference(case, q, stored, scale)).abs().max().item() <= F32
