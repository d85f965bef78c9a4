"""One tensor-level wrapper per entry point of the C library: each checks what the C
side assumes (dtype, device, contiguity, sizes) once, takes the tensors' addresses and
calls it. Nothing outside hotprefix.model.kernels passes tensors to C.

`lib` arguments default to the process's library (build.library()); tests pass other
builds of it (-march=x86-64, the simulated AVX-512 build) to compare their bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from hotprefix.model.kernels.abi import (
    ACT_GELU_TANH,
    ACT_SILU,
    KINDS,
    HpAtt,
    HpLayer,
    HpMoe,
    HpPart,
    HpPlan,
    HpStack,
    HpStep,
)
from hotprefix.model.kernels.build import need
from hotprefix.model.kernels.reduce import Reducer
from hotprefix.model.kernels.weights import Blocks, ExpertBlocks, FusedWeight, PackedWeight

Lib = ctypes.CDLL | None


def _f32_cpu(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name}: float32 CPU tensors only, got {t.dtype} on {t.device}")


def qmatmul(x: torch.Tensor, w: Blocks, lib: Lib = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 (CPU) @ W^T -> [M, N] float32 (into `out`: a reused buffer), int8 activations
    when w.int8. Raises RuntimeError without the library or a refused weight, ValueError for a wrong out."""
    lib, x, m = need(lib), x.contiguous(), x.shape[0]
    _f32_cpu("qmatmul", x)
    y = torch.empty(m, w.n, dtype=torch.float32) if out is None else out
    if y.shape != (m, w.n) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"qmatmul: out must be a contiguous [{m}, {w.n}] float32 tensor")
    threads = torch.get_num_threads()
    if w.int8:
        rc = lib.hp_qmatmul_i8_parts(w.part_table, len(w.parts), x.data_ptr(), m, w.k, y.data_ptr(), threads)
    elif isinstance(w, FusedWeight):
        return torch.cat([qmatmul(x, p, lib) for p in w.parts], dim=1, out=y)
    else:
        rc = lib.hp_qmatmul(w.qtype, x.data_ptr(), m, w.k, w.raw.data_ptr(), w.n, y.data_ptr(), threads)
    if rc:
        raise RuntimeError(f"the block product failed ({rc}) for {[p.type_name for p in w.parts]}, K={w.k}")
    return y


def dequantize(w: PackedWeight, lib: Lib = None) -> torch.Tensor:
    """The weight as float32 [N, K], dequantized by the kernel's own code (as gguf does).
    Raises RuntimeError for a regrouped (int8) weight, ValueError for rows not contiguous."""
    lib = need(lib)
    if w.int8:
        raise RuntimeError("dequantize reads GGUF rows, not the regrouped form")
    if not w.raw.is_contiguous():
        raise ValueError("dequantize needs contiguous rows")
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    if lib.hp_dequantize(w.qtype, w.raw.data_ptr(), w.n, w.k, out.data_ptr()):
        raise RuntimeError(f"hp_dequantize failed for type {w.qtype}")
    return out


def int8_vectorized(lib: Lib = None) -> bool:
    """Whether this build runs int8 products on vector instructions (AVX-512 VNNI or AVX2)."""
    return bool(need(lib).hp_int8_vectorized())


def silu_mul(gate_up: torch.Tensor, lib: Lib = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2I] float32 (CPU) = [gate | up] -> [M, I], in one pass
    (exp to about one float ulp). Raises RuntimeError without the library."""
    return _act_mul("hp_silu_mul", gate_up, lib)


def gelu_tanh_mul(gate_up: torch.Tensor, lib: Lib = None) -> torch.Tensor:
    """gelu_tanh(gate) * up (GeGLU, tanh-approximated GELU) for gate_up [M, 2I] float32 (CPU)
    -> [M, I], in one pass. Raises RuntimeError without the library."""
    return _act_mul("hp_gelu_tanh_mul", gate_up, lib)


def _act_mul(fn: str, gate_up: torch.Tensor, lib: Lib) -> torch.Tensor:
    lib = need(lib)
    _f32_cpu(fn, gate_up)
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    getattr(lib, fn)(gate_up.data_ptr(), m, i, out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: Lib = None) -> torch.Tensor:
    """RMSNorm of x [M, E] float32 (rows may be apart, each contiguous) -> new [M, E]."""
    lib = need(lib)
    _f32_cpu("rms_norm", x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    m, e = x.shape
    out = torch.empty(m, e, dtype=torch.float32)
    lib.hp_rmsnorm(x.data_ptr(), m, e, x.stride(0), weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: Lib = None) -> torch.Tensor:
    """Rotate x [T, NH, D] float32 in place by cos, sin [T, 1, D] (contiguous); returns x.
    x's rows may be apart, each row's NH * D values contiguous: otherwise a rotated copy."""
    lib = need(lib)
    _f32_cpu("rope_", x, cos, sin)
    t, nh, d = x.shape
    if not (x.stride(1) == d and x.stride(2) == 1):
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.hp_rope(x.data_ptr(), t, nh, x.stride(0), d, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return x


def rows_dense(*ts: torch.Tensor) -> bool:
    """Each tensor [T, NH, D] on the CPU with each row's NH * D values contiguous (rows may be apart)."""
    return all(t.device.type == "cpu" and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in ts)


KV_TYPES = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # ops.h's KV_F32, KV_E4M3, KV_E5M2


def kv_type(pool: torch.Tensor) -> int | None:
    """The C kernels' code of a CPU pool's storage dtype, or None for one they do not read."""
    return KV_TYPES.get(pool.dtype) if pool.device.type == "cpu" else None


def kv_write(kpool: torch.Tensor, vpool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lib: Lib = None, scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Store k, v ([T, KVH, D] float32, rows_dense) at `slots` ([T] int64) of a pool's K
    and V ([KVH, S, D] contiguous): float32, or fp8 (value / scale, rounded as torch's
    cast rounds). Raises ValueError for other layouts or dtypes."""
    lib = need(lib)
    _f32_cpu("kv_write", k, v)
    kind = kv_type(kpool)
    if kind is None or not (rows_dense(k, v) and kpool.is_contiguous() and vpool.is_contiguous()):
        raise ValueError("kv_write: rows of k and v must be dense and the pool a contiguous float32 or fp8 one")
    slots = slots.to(torch.int64).contiguous()
    d = k.shape[2]
    args = (kpool.data_ptr(), vpool.data_ptr(), kpool.shape[1] * d, slots.data_ptr(), k.shape[0], k.data_ptr(),
            k.stride(0), v.data_ptr(), v.stride(0), k.shape[1], d)
    if kind == 0:
        lib.hp_kv_write(*args)
    else:
        lib.hp_kv_write_fp8(*args, kind, *scales)


ATT_INIT, ATT_FINAL = 1, 2  # a task's flags: start from the rows' saved state; write their output
TASK_FIELDS = 6  # (first row entry, entries, first slot entry, position of that slot, KV head, flags)
MAX_TASK_ROWS = 256  # csrc/hp.h's HP_MAX_TASK_ROWS
TILE = 16  # csrc/hp.h's HP_TILE: keys a tile, aligned to absolute positions


class AttPlan:
    """An attention plan for hp_attend (csrc/attention.c): task [N, 6] (first entry of
    rows, entries, first entry of slots, the position of that slot, KV head, flags);
    rows [R] (each query's row of q viewed [T * H, D]); lims [R, 2] (its key positions
    [lo, hi)); slots (pool slots, position order). All int64, contiguous, kept alive with
    the C struct that points into them."""

    def __init__(self, task: torch.Tensor, rows: torch.Tensor, lims: torch.Tensor, slots: torch.Tensor) -> None:
        self.task, self.rows, self.lims, self.slots = (t.to(torch.int64).contiguous()
                                                       for t in (task, rows, lims, slots))
        if self.task.dim() != 2 or self.task.shape[1] != TASK_FIELDS:  # (rows per task, heads, ranges: C's check)
            raise ValueError(f"attention tasks hold {TASK_FIELDS} fields, got {tuple(self.task.shape)}")
        self.c = HpPlan(self.rows.data_ptr(), self.lims.data_ptr(), self.task.data_ptr(), self.slots.data_ptr(),
                        self.task.shape[0])

    @property
    def ntasks(self) -> int:
        return self.task.shape[0]


@dataclass
class AttState:
    """The rows' online-softmax state between attention passes (a cascade's shared prefix,
    then each member's own keys): m, l [T * H], acc [T * H, D] float32."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor

    @classmethod
    def empty(cls, rows: int, d: int) -> AttState:
        return cls(torch.empty(rows), torch.empty(rows), torch.empty(rows, d))


def attend(q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, plan: AttPlan, scale: float,
           out: torch.Tensor, state: AttState | None = None, lib: Lib = None,
           scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Run one plan: q [T, H, D] contiguous float32; a pool's K and V [KVH, S, D] (float32,
    or fp8 read as value * scale); writes the rows of out [T, H, D] its ATT_FINAL tasks
    finish, and `state` for the others (read by ATT_INIT tasks). Raises ValueError for an
    invalid plan (C's check) or pool, RuntimeError if the kernel fails."""
    lib = need(lib)
    _f32_cpu("attend", q, out)
    kind = kv_type(kpool)
    if kind is None or not (q.is_contiguous() and out.is_contiguous() and kpool.is_contiguous()
                            and vpool.is_contiguous()):
        raise ValueError("attend: q, out and a float32 or fp8 pool, all contiguous")
    d = q.shape[-1]
    st = (state.m.data_ptr(), state.l.data_ptr(), state.acc.data_ptr()) if state is not None else (None,) * 3
    att = HpAtt(q.data_ptr(), kpool.data_ptr(), vpool.data_ptr(), kpool.shape[1] * d, kpool.shape[0], d, kind,
                scale, *scales, out.data_ptr(), *st)
    rc = lib.hp_attend(ctypes.byref(att), ctypes.byref(plan.c), torch.get_num_threads())
    if rc == -1:
        raise ValueError("hp_attend refused the plan (rows per task, KV head or key ranges)")
    if rc:
        raise RuntimeError(f"hp_attend failed ({rc})")


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer as hp_decode_layers reads it: norms [E] (before attention, before
    the MLP), projections as regrouped blocks (qkv of 1-3 parts, gate/up of 1-2), optional
    biases, its KV pool (float32 or fp8 with its scales); Gemma's optional stages: q/k norms
    per head [D], norms of the attention's and MLP's outputs [E] (post1, post2), GeGLU
    (gelu); kind: its attention kind in the step (decode_layers' ropes, slots and plans)."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: Blocks
    o: PackedWeight
    gate_up: Blocks
    down: PackedWeight
    b_qkv: torch.Tensor | None
    b_o: torch.Tensor | None
    kpool: torch.Tensor
    vpool: torch.Tensor
    scales: tuple[float, float] = (1.0, 1.0)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post1: torch.Tensor | None = None
    post2: torch.Tensor | None = None
    gelu: bool = False
    kind: int = 0


@dataclass(frozen=True)
class StackShape:
    """The model's shape as hp_decode_layers reads it."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecodeStack:
    """The C structs of every decoder layer (hp_stack), built once: they hold the addresses of the layers'
    tensors, which must outlive it and stay where they are, and `reducer` (tensor parallelism: o's and down's
    products summed over the ranks). Raises ValueError for a projection of more parts than the struct holds."""

    def __init__(self, layers: list[DecodeLayer], shape: StackShape, reducer: Reducer | None = None) -> None:
        self._keep, self.reducer = layers, reducer or Reducer()
        self.layers = (HpLayer * len(layers))()
        for spec, layer in zip(self.layers, layers):
            _fill_layer(spec, layer)
        pool = layers[0].kpool
        kind = kv_type(pool)
        if kind is None:
            raise ValueError(f"hp_decode_layers reads float32 or fp8 CPU pools, not {pool.dtype}")
        self.stack = HpStack(self.layers, len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                             shape.intermediate, shape.eps, shape.scale, pool.shape[1] * shape.head_dim, kind,
                             self.reducer.c)


def _fill_layer(spec: HpLayer, layer: DecodeLayer) -> None:
    _f32_cpu("decode layer", layer.norm1, layer.norm2)
    spec.norm1, spec.norm2 = layer.norm1.data_ptr(), layer.norm2.data_ptr()
    spec.nqkv = _set_parts(spec.qkv, layer.qkv)
    spec.ngu = _set_parts(spec.gu, layer.gate_up)
    _set_parts((spec.o,), layer.o)
    _set_parts((spec.down,), layer.down)
    spec.b_qkv = layer.b_qkv.data_ptr() if layer.b_qkv is not None else None
    spec.b_o = layer.b_o.data_ptr() if layer.b_o is not None else None
    spec.kpool, spec.vpool = layer.kpool.data_ptr(), layer.vpool.data_ptr()
    spec.k_scale, spec.v_scale = layer.scales
    for name in ("q_norm", "k_norm", "post1", "post2"):
        t = getattr(layer, name)
        if t is not None:
            _f32_cpu("decode layer", t)
        setattr(spec, name, None if t is None else t.data_ptr())
    spec.act, spec.kind = (ACT_GELU_TANH if layer.gelu else ACT_SILU), layer.kind
    if not 0 <= layer.kind < KINDS:
        raise ValueError(f"attention kind {layer.kind}: hp_decode_layers holds {KINDS}")


def _set_parts(slots, w: Blocks) -> int:
    """Write w's parts (regrouped weights) into the HpPart slots; returns how many."""
    parts = w.parts
    if len(parts) > len(slots):
        raise ValueError(f"{len(parts)} parts, room for {len(slots)}")
    for slot, p in zip(slots, parts):
        slot.w, slot.qtype, slot.n = p.raw.data_ptr(), p.qtype, p.n
    return len(parts)


def decode_layers(stack: DecodeStack, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                  slots: list[torch.Tensor], plans: list[tuple[AttPlan, AttPlan | None]], lib: Lib = None) -> None:
    """Run a decode step's rows x [M, E] (contiguous float32, updated in place) through
    every layer of `stack`; per attention kind (a layer's DecodeLayer.kind indexes them):
    ropes' cos, sin [M, 1, D], slots [M] where each row's key and value go, and plans'
    (own, shared): the plans over each row's keys and the cascades' shared prefixes (run
    first). Raises RuntimeError if the kernel fails or refuses a plan; what the stack's reducer raised."""
    lib = need(lib)
    if not 1 <= len(ropes) == len(slots) == len(plans) <= KINDS:
        raise ValueError(f"decode_layers takes 1 to {KINDS} attention kinds, each its ropes, slots and plans")
    keep = [(c.contiguous(), s.contiguous()) for c, s in ropes]
    _f32_cpu("decode_layers", x, *(t for pair in keep for t in pair))
    wslots = [s.to(torch.int64).contiguous() for s in slots]
    step = HpStep(x=x.data_ptr(), M=x.shape[0])
    for k, ((cos, sin), ws, (own, shared)) in enumerate(zip(keep, wslots, plans)):
        step.cos[k], step.sin[k], step.wslots[k], step.own[k] = cos.data_ptr(), sin.data_ptr(), ws.data_ptr(), own.c
        if shared is not None:
            step.shared[k] = shared.c
    rc = lib.hp_decode_layers(ctypes.byref(stack.stack), ctypes.byref(step), torch.get_num_threads())
    stack.reducer.check()
    if rc:
        raise RuntimeError(f"hp_decode_layers failed ({rc})")


class MoeExperts:
    """The C struct of a mixture's experts (hp_moe) over gate, up [X, I, E] and down
    [X, E, I] as ExpertBlocks of one form (all regrouped, or all as stored), built once:
    it holds their addresses, and keeps them. Raises ValueError for shapes or forms that
    disagree or rows that are not contiguous."""

    def __init__(self, gate: ExpertBlocks, up: ExpertBlocks, down: ExpertBlocks) -> None:
        x, i, e = gate.experts, gate.n, gate.k
        ws = (gate, up, down)
        if (up.experts, up.n, up.k, down.experts, down.n, down.k) != (x, i, e, x, e, i) \
                or len({w.int8 for w in ws}) != 1 or not all(w.raw.is_contiguous() for w in ws):
            raise ValueError("experts: gate and up [X, I, E], down [X, E, I], contiguous, of one form")
        self._keep = ws
        self.experts, self.hidden = x, e
        self.c = HpMoe(*(HpPart(w.raw.data_ptr(), w.qtype, w.n) for w in ws), *(w.expert_bytes for w in ws),
                       x, e, i, int(gate.int8))


def moe_ffn(experts: MoeExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            reads: torch.Tensor | None = None, lib: Lib = None) -> torch.Tensor:
    """The mixture's FFN of x [T, E] float32 (CPU) -> new [T, E]: token t through experts
    ids[t] ([T, k] int64) weighted by weights[t] ([T, k] float32), each chosen expert's
    blocks read once for every token that chose it, no other expert's. reads: int64 [X]
    (contiguous) to which each expert's bytes read are added, or None. Raises ValueError
    for an expert id outside the table (before anything is read), RuntimeError when the
    kernel refuses the experts or runs out of memory."""
    lib = need(lib)
    _f32_cpu("moe_ffn", x, weights)
    x, ids, weights = x.contiguous(), ids.to(torch.int64).contiguous(), weights.contiguous()
    t, k = ids.shape
    if x.shape != (t, experts.hidden) or weights.shape != (t, k):
        raise ValueError(f"moe_ffn: x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    if reads is not None and (reads.dtype != torch.int64 or not reads.is_contiguous()
                              or reads.numel() != experts.experts):
        raise ValueError("moe_ffn: reads must be a contiguous int64 tensor of one entry per expert")
    out = torch.empty(t, experts.hidden, dtype=torch.float32)
    rc = lib.hp_moe_ffn(ctypes.byref(experts.c), x.data_ptr(), t, ids.data_ptr(), weights.data_ptr(), k,
                        out.data_ptr(), None if reads is None else reads.data_ptr(), torch.get_num_threads())
    if rc == -3:
        raise ValueError(f"an expert id outside the table of {experts.experts} experts")
    if rc:
        raise RuntimeError(f"hp_moe_ffn failed ({rc}: {'refused the experts' if rc == -1 else 'out of memory'})")
    return out
