"""Paged attention over a flat batch that mixes prefill chunks and decode tokens.

The batch is T tokens from B sequences laid end to end. Sequence b owns
queries [q_start_b, q_start_b + q_len_b) and, after this step's tokens are
written, has ctx_len_b tokens of KV in its blocks. Its queries sit at the last
q_len_b positions of that context.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from hotprefix.model.kv_cache import LayerKV

if TYPE_CHECKING:  # importing it imports triton
    from hotprefix.model.triton_attention import TritonMeta


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


@dataclass
class Cascade:
    """Decoding sequences that share their leading blocks: the shared prefix is
    gathered and attended once for all of them (their kv_slots then hold only
    their own suffix), and the two halves are merged by log-sum-exp."""

    shared_slots: torch.Tensor  # [S] slots of the shared prefix, position order
    members: list[int]  # indices into AttentionMetadata.seqs; each has q_len == 1
    # The prefix's K/V as gathered per layer (keyed by the layer's index): the
    # runner hands the same dict to the next step's cascade over the same blocks,
    # which cannot have changed while the group kept decoding.
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def shared_kv(self, kv: LayerKV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix's K, V ([KVH, S, D]) in this layer, gathered once."""
        got = self.gathered.get(kv.index)
        if got is None:
            got = self.gathered[kv.index] = kv.read(self.shared_slots, dtype)
        return got


class PagedPlan(NamedTuple):
    """hp_paged_attention's input: rows [R] of q to attend, tasks [N, 5], slots."""

    rows: torch.Tensor
    task: torch.Tensor
    slots: torch.Tensor


@dataclass
class PagedPlans:
    """The decode batch's kernel plans, made by the first layer of a step and used by
    all: `own` over each member's own blocks, `shared` over the cascades' prefixes."""

    own: PagedPlan | None = None
    shared: PagedPlan | None = None


@dataclass
class DecodeBatch:
    """Single-query sequences (decodes, no mask) attended together. With `kernel`
    (a float32 CPU cache and the C library), csrc/attention.c's hp_paged_attention reads
    their keys and values straight from the pool; otherwise one batched product over
    kv_slots padded to the longest, padding masked out. For cascade members kv_slots
    is their own suffix; the shared prefix is merged in after."""

    members: list[int]  # indices into AttentionMetadata.seqs
    rows: torch.Tensor  # [B] their query rows in the flat batch
    slots: torch.Tensor  # [B * L] their slots, each padded to L with its first slot
    valid: torch.Tensor  # [B, L] bool: False on padding
    length: int  # L
    kernel: ctypes.CDLL | None = None
    plans: PagedPlans = field(default_factory=PagedPlans)  # per step


@dataclass
class AttentionMetadata:
    """Built once per step, shared by every layer. The torch and cpu backends attend per
    SeqAttn (seqs, decode batch, cascades); the triton backend reads `triton` alone (its
    seqs are empty)."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes (-1: nowhere, Triton padding)
    seqs: list[SeqAttn]
    cascades: list[Cascade] = field(default_factory=list)
    decode: DecodeBatch | None = None
    triton: TritonMeta | None = None


def build_decode_batch(seqs: list[SeqAttn], min_size: int = 2, kernel: ctypes.CDLL | None = None
                       ) -> DecodeBatch | None:
    """The batch of single-query, unmasked sequences, or None when fewer than min_size.
    `kernel`: the C library, for a float32 cache on the CPU (see DecodeBatch)."""
    members = [i for i, s in enumerate(seqs) if s.q_len == 1 and s.mask is None and not s.is_causal]
    if len(members) < min_size:
        return None
    length = max(seqs[i].kv_slots.numel() for i in members)
    dev = seqs[members[0]].kv_slots.device
    slots = torch.empty(len(members), length, dtype=torch.long, device=dev)
    valid = torch.zeros(len(members), length, dtype=torch.bool, device=dev)
    for b, i in enumerate(members):
        ks = seqs[i].kv_slots
        slots[b, :ks.numel()] = ks
        slots[b, ks.numel():] = ks[0]
        valid[b, :ks.numel()] = True
    rows = torch.tensor([seqs[i].q_start for i in members], dtype=torch.long, device=dev)
    return DecodeBatch(members, rows, slots.reshape(-1), valid, length, kernel)


def build_seq_attn(q_start: int, q_len: int, ctx_len: int, block_ids: list[int], block_size: int,
                   sliding_window: int | None, device: torch.device) -> SeqAttn:
    """Slots and mask for one sequence. Block ids must cover ctx_len tokens."""
    n_blocks = -(-ctx_len // block_size)
    blocks = torch.tensor(block_ids[:n_blocks], dtype=torch.long, device=device)
    offs = torch.arange(block_size, device=device)
    slots = (blocks[:, None] * block_size + offs[None, :]).reshape(-1)[:ctx_len]
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
    return SeqAttn(q_start, q_len, ctx_len, slots, mask, is_causal, tail)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each sequence to its context.

    q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H, D].
    """
    if meta.triton is not None:  # the triton backend (the runner imported the module when it chose it)
        from hotprefix.model import triton_attention

        return triton_attention.paged_attention(q, k, v, kv, meta.slot_mapping, meta.triton, scale)
    kv.write(meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    done: set[int] = set()
    if meta.decode is not None:  # the decode batch, cascades included
        decode_attention(q, kv, meta, scale, out)
        done.update(meta.decode.members)
    for i, s in enumerate(meta.seqs):
        if i in done:
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
    return out


def attend_causal_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk after cached context: every query sees all ctx - n earlier
    keys, and the last n keys causally. Attend to the two parts separately (the
    first without a mask, on the CPU flash kernel) and merge by log-sum-exp.
    q: [H, n, D]; k, v: [KVH, ctx, D]; returns [H, n, D]."""
    h, n, d = q.shape
    kvh, ctx = k.shape[0], k.shape[1]
    g = h // kvh
    o1, l1 = _cpu_flash(q.reshape(kvh, g * n, d)[None], k[None, :, :ctx - n], v[None, :, :ctx - n], False, scale)
    o1, l1 = o1.reshape(1, h, n, d), l1.reshape(1, h, n)
    kt = k[:, ctx - n:].repeat_interleave(g, 0)[None]  # [1, H, n, D]
    vt = v[:, ctx - n:].repeat_interleave(g, 0)[None]
    return _merge(o1, l1, *_cpu_flash(q[None], kt, vt, True, scale))[0]


PAGED_ROWS_PER_TASK = 12  # a cascade's query rows per kernel task: the threads share a group's prefix


def _paged_plan(meta: AttentionMetadata, h: int, kvh: int, cascades: bool) -> PagedPlan:
    """hp_paged_attention's (rows, task, slots) for the decode batch's own keys, or
    (cascades) for each cascade's shared prefix. Rows index q viewed as [T * H, D]:
    a task is one sequence (or cascade) and one KV head, with the G query heads of
    that KV head (of every member, for a cascade)."""
    g = h // kvh
    rows: list[int] = []
    tasks: list[tuple[int, int, int, int, int]] = []
    parts: list[torch.Tensor] = []
    n_slots = 0
    if cascades:
        groups = [([meta.seqs[i].q_start for i in c.members], c.shared_slots) for c in meta.cascades]
    else:
        groups = [([meta.seqs[i].q_start], meta.seqs[i].kv_slots) for i in meta.decode.members]
    for starts, slots in groups:
        parts.append(slots)
        for j in range(kvh):
            head_rows = [t * h + j * g + i for t in starts for i in range(g)]
            for r0 in range(0, len(head_rows), PAGED_ROWS_PER_TASK):  # tasks small enough to share out
                part = head_rows[r0:r0 + PAGED_ROWS_PER_TASK]
                tasks.append((len(rows), len(part), n_slots, slots.numel(), j))
                rows.extend(part)
        n_slots += slots.numel()
    return PagedPlan(torch.tensor(rows, dtype=torch.int64), torch.tensor(tasks, dtype=torch.int64),
                     torch.cat(parts).to(torch.int64))


def paged_plan_own(meta: AttentionMetadata, h: int, kvh: int) -> PagedPlan:
    """The decode batch's plan over each member's own keys (see _paged_plan), made by
    the first caller of a step and kept in meta.decode.plans for the others."""
    plans = meta.decode.plans
    if plans.own is None:
        plans.own = _paged_plan(meta, h, kvh, cascades=False)
    return plans.own


def paged_plan_shared(meta: AttentionMetadata, h: int, kvh: int) -> PagedPlan | None:
    """The plan over the step's cascades' shared prefixes (see _paged_plan), or None
    without cascades; made by the first caller of a step and kept like paged_plan_own."""
    plans = meta.decode.plans
    if meta.cascades and plans.shared is None:
        plans.shared = _paged_plan(meta, h, kvh, cascades=True)
    return plans.shared


def _paged_attend(lib: ctypes.CDLL, q: torch.Tensor, kv: LayerKV, plan: PagedPlan, scale: float,
                  out: torch.Tensor, lse: torch.Tensor) -> None:
    """Run one hp_paged_attention plan: q [T, H, D] contiguous; writes the planned rows
    of out [T * H, D] and lse [T * H]. Raises RuntimeError if the kernel fails."""
    rows, task, slots = plan
    kh, d = kv.k, q.shape[-1]
    rc = lib.hp_paged_attention(q.data_ptr(), rows.data_ptr(), task.data_ptr(), task.shape[0], kh.data_ptr(),
                                kv.v.data_ptr(), kh.shape[1] * d, d, slots.data_ptr(), scale, out.data_ptr(),
                                lse.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"hp_paged_attention failed ({rc})")


def decode_attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """The decode batch, with each cascade's shared prefix (attended once per group)
    merged in; written into out [T, H, D]. On the C kernel when the batch has it, else
    in one gather and two batched products."""
    batch = meta.decode
    if batch.kernel is not None and kv.k.dtype == torch.float32 and q.dtype == torch.float32:
        t, h, d = q.shape
        q = q.contiguous()
        shared = paged_plan_shared(meta, h, kv.k.shape[0])  # plans: the same for every layer of the step
        o, lse = torch.empty(t * h, d), torch.empty(t * h)
        _paged_attend(batch.kernel, q, kv, paged_plan_own(meta, h, kv.k.shape[0]), scale, o, lse)
        if shared is not None:
            rows = shared.rows
            o_sh, l_sh = torch.empty(t * h, d), torch.empty(t * h)
            _paged_attend(batch.kernel, q, kv, shared, scale, o_sh, l_sh)
            o[rows] = _merge(o_sh[rows], l_sh[rows], o[rows], lse[rows])
        out[batch.rows] = o.view(t, h, d)[batch.rows]
        return
    h, d = q.shape[1], q.shape[2]
    nb, length = len(batch.members), batch.length
    k, v = kv.read(batch.slots, q.dtype)  # [KVH, B * L, D]
    kvh = k.shape[0]
    g = h // kvh
    k, v = k.view(kvh, nb, length, d), v.view(kvh, nb, length, d)
    qb = q[batch.rows].view(nb, kvh, g, d).transpose(0, 1)  # [KVH, B, G, D]
    scores = torch.matmul(qb, k.transpose(-1, -2)).mul_(scale)  # [KVH, B, G, L]
    scores.masked_fill_(~batch.valid[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [KVH, B, G]
    o = torch.matmul(torch.exp(scores - lse[..., None]), v)  # [KVH, B, G, D]
    o, lse = o.transpose(0, 1).reshape(nb, h, d), lse.transpose(0, 1).reshape(nb, h)  # [B, H, D], [B, H]
    where = {i: b for b, i in enumerate(batch.members)}
    for c in meta.cascades:  # every member is a single-query decode, so in the batch
        ks, vs = c.shared_kv(kv, q.dtype)  # [KVH, S, D], once for the group
        pos = torch.tensor([where[i] for i in c.members], device=q.device)
        m = len(c.members)
        qs = qb[:, pos].reshape(kvh, m * g, d)  # [KVH, m * G, D]
        o_sh, l_sh = _cpu_flash(qs[None], ks[None], vs[None], False, scale)  # [1, KVH, m*G, D], [1, KVH, m*G]
        o_sh = o_sh[0].view(kvh, m, g, d).transpose(0, 1).reshape(m, h, d)
        l_sh = l_sh[0].view(kvh, m, g).transpose(0, 1).reshape(m, h)
        o[pos] = _merge(o_sh, l_sh, o[pos], lse[pos])
    out[batch.rows] = o


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
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
    """
    h, n, d = q.shape
    kvh = k.shape[0]
    g = h // kvh
    cpu = q.device.type == "cpu" and q.dtype == torch.float32
    if is_causal:
        if cpu:  # CPU SDPA picks its slow math path for GQA; its flash kernel is ~3x faster
            # batch = KV heads, heads = the G query heads of each: K and V broadcast (stride 0), not copied
            kx, vx = k[:, None].expand(kvh, g, *k.shape[1:]), v[:, None].expand(kvh, g, *v.shape[1:])
            return _cpu_flash(q.view(kvh, g, n, d), kx, vx, True, scale)[0].reshape(h, n, d)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    qg = q.reshape(kvh, g * n, d)  # [KVH, G * q_len, D]
    if mask is None and cpu:
        return _cpu_flash(qg[None], k[None], v[None], False, scale)[0][0].reshape(h, n, d)
    m = None if mask is None else mask.repeat(g, 1)  # [G * q_len, ctx]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale).reshape(h, n, d)


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash-attention kernel, called directly (F.scaled_dot_product_attention
    does not choose it for these shapes): output [B, H, L, D] and log-sum-exp [B, H, L]."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    return o, lse
