"""Attention of one sequence in torch: its slots and mask (SeqAttn), grouped-query SDPA,
torch's CPU flash kernel called directly, and the exact merge of attention over two
disjoint key sets. The torch backend attends with these alone; the cpu backend where its
C kernels do not apply."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotprefix.model.attention.base import SeqSpan
from hotprefix.model.kv_cache import LayerKV


@dataclass
class SeqAttn:
    """One sequence's share of the batch.

    kv_slots: [ctx_len] slots holding its keys/values, position order.
    mask: [q_len, ctx_len] bool (True = may attend), or None when plain
    causal (q_len == ctx_len) or a single query sees everything.
    """

    q_start: int
    q_len: int
    ctx_len: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool
    causal_tail: bool = False  # mask is plain causal over the last q_len keys (no sliding window)


def build_seq_attn(span: SeqSpan, block_size: int, sliding_window: int | None, device: torch.device) -> SeqAttn:
    """Slots and mask for one sequence. Its block ids must cover its context from the first
    key its first query sees (with a window, the slots before are never read: a window
    group's released blocks are the pool's null block)."""
    ctx_len, q_len = span.ctx_len, span.q_len
    lo = max(0, span.start_pos - sliding_window + 1) if sliding_window else 0
    n_blocks = -(-ctx_len // block_size)
    blocks = torch.tensor(span.block_ids[lo // block_size:n_blocks], dtype=torch.long, device=device)
    offs = torch.arange(block_size, device=device)
    first = lo // block_size * block_size  # the first slot gathered holds this position
    slots = (blocks[:, None] * block_size + offs[None, :]).reshape(-1)[lo - first:ctx_len - first]
    ctx_len -= lo  # the keys read: positions lo .. ctx_len - 1
    mask = None
    is_causal = False
    windowed = sliding_window is not None and ctx_len > sliding_window
    if q_len > 1 or windowed:
        if q_len == ctx_len and not windowed:
            is_causal = True
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]  # [q_len, 1]
            k_pos = torch.arange(ctx_len, device=device)[None, :]  # [1, ctx_len]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask = mask & (q_pos - k_pos < sliding_window)
    tail = mask is not None and sliding_window is None and 1 < q_len < ctx_len
    return SeqAttn(span.q_start, q_len, ctx_len, slots, mask, is_causal, tail)


def attend_seqs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, seqs: list[SeqAttn], scale: float,
                out: torch.Tensor, skip: set[int]) -> None:
    """Each sequence of `seqs` not in `skip` attended on its own, into out [T, H, D]:
    q [T, H, D]; this step's k, v [T, KVH, D] (a full causal prefill reads them, not the
    pool, where the pool holds the compute dtype)."""
    for i, s in enumerate(seqs):
        if i in skip:
            continue
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [H, q_len, D]
        if s.is_causal and kv.k.dtype == q.dtype and q.device.type == "cpu":  # context = this step's k, v
            ks = k[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [KVH, ctx, D], strided
            vs = v[s.q_start:s.q_start + s.q_len].transpose(0, 1)
        else:
            ks, vs = kv.read(s.kv_slots, q.dtype)  # [KVH, ctx, D], contiguous
        if s.causal_tail and qs.device.type == "cpu" and qs.dtype == torch.float32:
            o = attend_causal_tail(qs, ks, vs, scale)
        else:
            o = attend(qs, ks, vs, s.mask, s.is_causal, scale)
        out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1)


def attend_causal_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk after cached context: every query sees all ctx - n earlier
    keys, and the last n keys causally. Attend to the two parts separately (the
    first without a mask, on the CPU flash kernel) and merge by log-sum-exp.
    q: [H, n, D]; k, v: [KVH, ctx, D]; returns [H, n, D]."""
    h, n, d = q.shape
    kvh, ctx = k.shape[0], k.shape[1]
    g = h // kvh
    o1, l1 = cpu_flash(q.reshape(kvh, g * n, d)[None], k[None, :, :ctx - n], v[None, :, :ctx - n], False, scale)
    o1, l1 = o1.reshape(1, h, n, d), l1.reshape(1, h, n)
    kt = k[:, ctx - n:].repeat_interleave(g, 0)[None]  # [1, H, n, D]
    vt = v[:, ctx - n:].repeat_interleave(g, 0)[None]
    return merge(o1, l1, *cpu_flash(q[None], kt, vt, True, scale))[0]


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, combined exactly from each part's
    output [..., L, D] and log-sum-exp [..., L]."""
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           scale: float) -> torch.Tensor:
    """Grouped-query attention of one sequence. q: [H, q_len, D]; k, v: [KVH, ctx, D]; returns [H, q_len, D].

    Query heads are grouped consecutively per KV head (head h reads KV head
    h // G), so the G query heads of a KV head are folded into the query
    dimension, [KVH, G * q_len, D], with the mask repeated per group: plain
    SDPA then runs without expanding K and V (enable_gqa takes a slow path on
    CPU). A full causal prefill keeps is_causal, which needs square groups.
    On a float32 CPU, torch's flash kernel is called where SDPA would not pick it.
    """
    h, n, d = q.shape
    kvh = k.shape[0]
    g = h // kvh
    cpu = q.device.type == "cpu" and q.dtype == torch.float32
    if is_causal:
        if cpu:  # CPU SDPA picks its slow math path for GQA; its flash kernel is ~3x faster
            # batch = KV heads, heads = the G query heads of each: K and V broadcast (stride 0), not copied
            kx, vx = k[:, None].expand(kvh, g, *k.shape[1:]), v[:, None].expand(kvh, g, *v.shape[1:])
            return cpu_flash(q.view(kvh, g, n, d), kx, vx, True, scale)[0].reshape(h, n, d)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    qg = q.reshape(kvh, g * n, d)  # [KVH, G * q_len, D]
    if mask is None and cpu:
        return cpu_flash(qg[None], k[None], v[None], False, scale)[0][0].reshape(h, n, d)
    m = None if mask is None else mask.repeat(g, 1)  # [G * q_len, ctx]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale).reshape(h, n, d)


def cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash-attention kernel, called directly (F.scaled_dot_product_attention
    does not choose it for these shapes): output [B, H, L, D] and log-sum-exp [B, H, L]."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    return o, lse
