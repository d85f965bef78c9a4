"""Paged attention in Triton: the KV write, prefill over a cached prefix plus the new
chunk, and split-K decode, all reading the pool in place through a block table.

A layer's pool is K, V: [KVH, slots, D] (model/kv_cache.py), slot = block * block_size
+ offset. Per step the runner gives every layer one TritonMeta: block_tables [B, W]
(int32, a row per sequence, padded), seq_lens [B] (each sequence's context after this
step's write) and query_start_loc [B + 1] (its queries' rows in the flat batch of T
tokens). Query i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys
0..position (causal within the chunk, everything cached before it), within the sliding
window if the model has one. A slot of -1 in the slot mapping writes nothing and a
sequence of length 0 reads nothing (its output is 0): CUDA-graph padding.

fp8 caches hold value / scale (one scale per layer for K and one for V) and are passed
to the kernels as uint8 views, bitcast there (e4m3 on GPUs before sm_89, which Triton
gives no e4m3 type, converted in integer arithmetic instead, to the same bytes and
values). Where there is no CUDA device the kernels run in Triton's interpreter on CPU
tensors (also when TRITON_INTERPRET=1): that is how `make test` proves them without a
GPU; tests/model/test_triton_compile.py compiles them for sm_80 and sm_90 there too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # before triton is imported: it decorates its own library then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from hotprefix.model.kv_cache import LayerKV  # noqa: E402

INTERPRETED = isinstance(tl.zeros, InterpretedFunction)
if not INTERPRETED and not torch.cuda.is_available():
    raise ImportError("Triton was imported before hotprefix.model.kernels.triton_attention without TRITON_INTERPRET=1, "
                      "and there is no CUDA device: set TRITON_INTERPRET=1 to run its kernels on the CPU")
DECODE_TOKENS_PER_SPLIT = 256  # context tokens per split-K program before splitting further
MAX_DECODE_SPLITS = 16
_FP8_KIND = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernels' FP8 (0: not fp8)
E4M3_IN_INTEGERS = 3  # FP8 for e4m3 where Triton has no fp8e4nv (before sm_89)


@dataclass
class TritonMeta:
    """One step's paged-attention inputs, shared by every layer (see the module doc)."""

    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int  # longest chunk of the step; 1 = a decode-only step
    block_size: int
    num_splits: int = 1  # split-K programs per sequence and KV head in decode
    sliding_window: int = 0  # 0: none


def decode_splits(max_context: int, max_splits: int = MAX_DECODE_SPLITS) -> int:
    """Split-K programs per (sequence, KV head) for a decode step whose longest context
    is max_context tokens: one per DECODE_TOKENS_PER_SPLIT, at most max_splits."""
    return max(1, min(max_splits, -(-max_context // DECODE_TOKENS_PER_SPLIT)))


# -- kernels ---------------------------------------------------------------------------

@triton.jit
def _round_fp8(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 x rounded to the nearest fp8 value (ties to even), still as float32, so
    that the cast to fp8 after it is exact: the same bytes as torch's cast. (Triton's
    interpreter rounds some values that carry into the next exponent down, 7.97 to 4.0.)
    The step between fp8 values at x's exponent e is 2^(max(e, MIN_EXP) - MANT); adding
    and taking away 1.5 * 2^23 steps rounds to a multiple of it in float32's own
    round-to-nearest-even; x's sign is put back, so a small negative value is -0.0."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    step = ((tl.maximum(e, MIN_EXP) - MANT + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0  # 1.5 * 2^23
    r = (x + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # x's sign (-0.0)


@triton.jit
def _e4m3_byte(x, scale, FP8: tl.constexpr):
    """float32 x / scale as its e4m3 byte (uint8), as torch casts: to the nearest value
    (ties to even), saturated at +-448, NaN 0x7F with x's sign (taken before the division:
    a GPU's division returns NaN without its sign). FP8 == 1: through Triton's fp8e4nv
    (sm_89 on); 3: in integer arithmetic, for GPUs without it (sm_80): the rounded value
    times 2^-8 is exact in fp16 (subnormals too), whose sign, exponent and top 3 mantissa
    bits are the byte's (fp16's exponent bias is e4m3's + 8)."""
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    x = x / scale
    r = _round_fp8(tl.minimum(tl.maximum(x, -448.0), 448.0), 3, -6)
    if FP8 == 1:
        b = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        h = (r * 0.00390625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        b = ((h >> 8) & 0x80) | ((h >> 7) & 0x7F)
    return tl.where(x != x, sign | 0x7F, b).to(tl.uint8)


@triton.jit
def _e4m3_float(x):
    """e4m3 bytes (uint8) as float32 in integer arithmetic (GPUs without Triton's fp8e4nv),
    as torch reads them: the byte's sign, exponent and mantissa placed in an fp16's, times
    2^8 (exact, subnormals too); 0x7F and 0xFF are NaN."""
    b = x.to(tl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    f = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), f)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ch, k_scale, v_scale, KVH, D,
                     KVH_P2: tl.constexpr, D_P2: tl.constexpr, FP8: tl.constexpr):
    """Program t stores token t's K and V ([KVH, D]) at its slot (nothing for slot < 0)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KVH_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < KVH) & (d < D) & (h * 0 + slot >= 0)  # (a scalar in the &: the interpreter makes it int32)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    dst = h.to(tl.int64) * stride_ch + slot * D + d
    if FP8 == 2:  # e5m2: 2 mantissa bits, smallest normal exponent -14
        k = _round_fp8(k.to(tl.float32) / k_scale, 2, -14).to(tl.float8e5).to(tl.uint8, bitcast=True)
        v = _round_fp8(v.to(tl.float32) / v_scale, 2, -14).to(tl.float8e5).to(tl.uint8, bitcast=True)
    elif FP8 != 0:  # e4m3, through Triton's type (1) or in integers (3)
        k = _e4m3_byte(k.to(tl.float32), k_scale, FP8)
        v = _e4m3_byte(v.to(tl.float32), v_scale, FP8)
    else:
        k = k.to(kc_ptr.dtype.element_ty)
        v = v.to(vc_ptr.dtype.element_ty)
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


@triton.jit
def _load_kv(c_ptr, base, slot, d, D, mask, scale, FP8: tl.constexpr):
    """K or V rows [N, D_P2] at slots [N] of one head (base: its offset; a slot holds D
    values), dequantised (fp8: times its scale) as float32."""
    x = tl.load(c_ptr + base + slot[:, None] * D + d[None, :], mask=mask, other=0)
    if FP8 == 1:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    elif FP8 == 2:
        return x.to(tl.float8e5, bitcast=True).to(tl.float32) * scale
    elif FP8 == 3:
        return _e4m3_float(x) * scale
    return x.to(tl.float32)


@triton.jit
def _load_keys(kc_ptr, vc_ptr, bt_ptr, n0, start, end, base, d, D, dmask, k_scale, v_scale, BLOCK_SIZE,
               BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 of a sequence (bt_ptr: its block table row), those in
    [start, end): their positions [N], which are valid [N], and K, V [N, D_P2] as float32.
    Nothing before `start` is read, not even its block id (a window group's released
    blocks are the pool's null block)."""
    kpos = n0 + tl.arange(0, BLOCK_N)
    kvalid = (kpos >= start) & (kpos < end)
    blk = tl.load(bt_ptr + kpos // BLOCK_SIZE, mask=kvalid, other=0)
    slot = blk.to(tl.int64) * BLOCK_SIZE + kpos % BLOCK_SIZE
    kvmask = kvalid[:, None] & dmask[None, :]
    k = _load_kv(kc_ptr, base, slot, d, D, kvmask, k_scale, FP8)
    v = _load_kv(vc_ptr, base, slot, d, D, kvmask, v_scale, FP8)
    return kpos, kvalid, k, v


@triton.jit
def _prefill_tile(q, k, v, kpos, kvalid, q_pos, window, scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of keys k, v [N, D_P2] (positions kpos [N], valid kvalid) into the queries'
    online softmax (q [M, D_P2] at q_pos [M]: causal, within the window): the new m_i, l_i [M]
    and acc [M, D_P2]."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    seen = kvalid[None, :] & (kpos[None, :] <= q_pos[:, None])
    if window > 0:
        seen = seen & (q_pos[:, None] - kpos[None, :] < window)
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_bt,
                    scale, k_scale, v_scale, window, G, D, BLOCK_SIZE,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_P2: tl.constexpr,
                    FP8: tl.constexpr, IEEE: tl.constexpr):
    """Program (b, h, m): queries [m * BLOCK_M, (m + 1) * BLOCK_M) of sequence b, query
    head h, against every key they may see, BLOCK_N keys at a time (online softmax)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q0
    ctx = tl.load(seq_lens_ptr + b)
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P2)
    dmask = d < D
    qmask = (i < q_len)[:, None] & dmask[None, :]
    rows = (q0 + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=qmask, other=0.0)
    q_pos = ctx - q_len + i  # [M]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    base = (h // G).to(tl.int64) * stride_ch
    hi = tl.minimum(ctx, ctx - q_len + (mb + 1) * BLOCK_M)  # keys past the tile's last query: never seen
    start = tl.where(window > 0, tl.maximum(0, ctx - q_len + mb * BLOCK_M - window + 1), 0)  # the window's start
    lo = start // BLOCK_N * BLOCK_N
    for n0 in range(lo, hi, BLOCK_N):
        kpos, kvalid, k, v = _load_keys(kc_ptr, vc_ptr, bt_ptr + b * stride_bt, n0, start, ctx, base, d, D, dmask,
                                        k_scale, v_scale, BLOCK_SIZE, BLOCK_N, FP8)
        m_i, l_i, acc = _prefill_tile(q, k.to(q.dtype), v.to(q.dtype), kpos, kvalid, q_pos, window, scale, m_i, l_i,
                                      acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qmask)


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, po_ptr, plse_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
                   stride_qt, stride_qh, stride_ch, stride_bt, scale, k_scale, v_scale, window, G, D, BLOCK_SIZE,
                   G_P2: tl.constexpr, BLOCK_N: tl.constexpr, D_P2: tl.constexpr, SPLITS: tl.constexpr,
                   FP8: tl.constexpr):
    """Program (b, kvh, s): the G query heads of KV head kvh of sequence b (one query
    each) against split s of its context; writes their partial output (normalised) and
    log-sum-exp to po [B, H, SPLITS, D_P2], plse [B, H, SPLITS] (-inf: no keys)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + b)
    row = tl.load(qsl_ptr + b).to(tl.int64)
    per = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    hi = tl.minimum(ctx, s * per + per)
    lo = tl.where(window > 0, tl.maximum(s * per, ctx - window), s * per)
    g = tl.arange(0, G_P2)
    d = tl.arange(0, D_P2)
    heads = kvh * G + g
    gmask = g < G
    dmask = d < D
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [G_P2, D_P2]
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D_P2], tl.float32)
    base = kvh.to(tl.int64) * stride_ch
    for n0 in range(lo, hi, BLOCK_N):
        kpos, kvalid, k, v = _load_keys(kc_ptr, vc_ptr, bt_ptr + b * stride_bt, n0, lo, hi, base, d, D, dmask,
                                        k_scale, v_scale, BLOCK_SIZE, BLOCK_N, FP8)  # k, v: [N, D_P2]
        sc = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # [G_P2, N]
        sc = tl.where(kvalid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    some = l_i > 0
    out = acc / tl.where(some, l_i, 1.0)[:, None]
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    part = (b * (tl.num_programs(1) * G) + heads).to(tl.int64) * SPLITS + s  # [G_P2]
    tl.store(po_ptr + part[:, None] * D_P2 + d[None, :], out, mask=gmask[:, None])
    tl.store(plse_ptr + part, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(po_ptr, plse_ptr, o_ptr, qsl_ptr, stride_ot, stride_oh, H, D,
                          SPLITS: tl.constexpr, S_P2: tl.constexpr, D_P2: tl.constexpr):
    """Program (b, h): merge the SPLITS partial outputs of sequence b, head h by their
    log-sum-exp into o (0 where the sequence has no keys)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_P2)
    d = tl.arange(0, D_P2)
    part = (b * H + h).to(tl.int64) * SPLITS + s
    lse = tl.load(plse_ptr + part, mask=s < SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)))  # [S_P2]
    po = tl.load(po_ptr + part[:, None] * D_P2 + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * po, 0) / tl.where(total > 0, total, 1.0)
    row = tl.load(qsl_ptr + b).to(tl.int64)
    tl.store(o_ptr + row * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


# -- launchers -------------------------------------------------------------------------

def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


@functools.cache
def e4m3_native(device: torch.device) -> bool:
    """Whether Triton has an e4m3 type on device: CUDA from sm_89 (Ada, Hopper) on, and
    its interpreter; elsewhere (sm_80, sm_86) the kernels convert e4m3 in integers."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _pool(kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The layer's K, V as the kernels take them (uint8 views of fp8) and the fp8 kind."""
    kind = _FP8_KIND.get(kv.k.dtype, 0)
    if kind == 1 and not e4m3_native(kv.k.device):
        kind = E4M3_IN_INTEGERS
    if kind:
        return kv.k.view(torch.uint8), kv.v.view(torch.uint8), kind
    return kv.k, kv.v, 0


def write_kv(kv: LayerKV, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, KVH, D] (rows of D contiguous) at slot_mapping [T] of the layer's
    pool, scaled and cast for fp8; slot -1 stores nothing. Mutates kv.k and kv.v."""
    t, kvh, d = k.shape
    if t == 0:
        return
    kc, vc, kind = _pool(kv)
    _kv_write_kernel[(t,)](k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kc.stride(0), kv.k_scale, kv.v_scale, kvh, d, KVH_P2=_p2(kvh), D_P2=_p2(d), FP8=kind)


def prefill_attention(q: torch.Tensor, kv: LayerKV, meta: TritonMeta, scale: float, out: torch.Tensor,
                      block_m: int = 64, block_n: int = 64) -> None:
    """Every query of the step (any chunk length, decodes included) against its
    sequence's context in the pool. q, out: [T, H, D]; writes out."""
    b = meta.seq_lens.shape[0]
    h, d = q.shape[1], q.shape[2]
    kc, vc, kind = _pool(kv)
    block_m = min(block_m, max(16, _p2(meta.max_query_len)))
    grid = (b, h, -(-meta.max_query_len // block_m))
    _prefill_kernel[grid](q, kc, vc, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0),
                          meta.block_tables.stride(0), scale, kv.k_scale, kv.v_scale, meta.sliding_window,
                          h // kv.k.shape[0], d, meta.block_size, BLOCK_M=block_m, BLOCK_N=block_n, D_P2=_p2(d),
                          FP8=kind, IEEE=q.dtype == torch.float32)


DECODE_TILE = 8192  # a decode program's [G, N, D] product in registers: keys per iteration fit this


def decode_attention(q: torch.Tensor, kv: LayerKV, meta: TritonMeta, scale: float, out: torch.Tensor,
                     block_n: int | None = None) -> None:
    """One query per sequence (a decode-only step) against its context, split-K into
    meta.num_splits programs per (sequence, KV head), then merged. q, out: [T, H, D]."""
    b = meta.seq_lens.shape[0]
    h, d = q.shape[1], q.shape[2]
    kvh = kv.k.shape[0]
    kc, vc, kind = _pool(kv)
    splits, dp, gp = meta.num_splits, _p2(d), _p2(h // kvh)
    block_n = block_n or max(16, min(64, DECODE_TILE // (gp * dp)))
    po = torch.empty(b, h, splits, dp, dtype=torch.float32, device=q.device)
    plse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(b, kvh, splits)](q, kc, vc, po, plse, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     q.stride(0), q.stride(1), kc.stride(0), meta.block_tables.stride(0), scale,
                                     kv.k_scale, kv.v_scale, meta.sliding_window, h // kvh, d, meta.block_size,
                                     G_P2=gp, BLOCK_N=block_n, D_P2=dp, SPLITS=splits, FP8=kind)
    _decode_reduce_kernel[(b, h)](po, plse, out, meta.query_start_loc, out.stride(0), out.stride(1), h, d,
                                  SPLITS=splits, S_P2=_p2(splits), D_P2=dp)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor,
                    meta: TritonMeta, scale: float) -> torch.Tensor:
    """The Triton backend's attention for one layer: write this step's k, v [T, KVH, D]
    at slot_mapping, then attend q [T, H, D] to the pool (split-K decode kernel for a
    decode-only step, else the prefill kernel for every row). Returns [T, H, D]
    (contiguous). Mutates kv's pool."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    write_kv(kv, slot_mapping, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.max_query_len == 1:
        decode_attention(q, kv, meta, scale, out)
    else:
        prefill_attention(q, kv, meta, scale, out)
    return out
