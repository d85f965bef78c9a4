"""The layers model families are made of, each built complete from a WeightSet: its
float weights, the GGUF blocks that serve its products, and the ops its small per-row
steps run on (LayerOps: torch's, or the C kernels' in int8 mode). A mixture of experts'
MLP (SparseMoe: a Router, then Experts) is one of them, for every family with experts.

Shapes: T = tokens in the flat batch, E = hidden size, N/K = a product's outputs/inputs,
H = query heads, KVH = KV heads, D = head dim.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hotprefix.model.arch import ModelArch, ModelLoadError
from hotprefix.model.kernels import ops
from hotprefix.model.kernels.scores import score_head, scores_on_head
from hotprefix.model.kernels.weights import Blocks, ExpertBlocks, PackedWeight
from hotprefix.model.parallel import Parallel
from hotprefix.model.weight_set import WeightSet


class LayerOps(Protocol):
    """The small per-row steps of a layer."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    """LayerOps in torch (float32 mode: the arithmetic transformers does)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op (the same arithmetic as below)
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, NH, D] rotated by cos, sin [T, 1, D] (a new tensor)."""
        return x * cos + rotate_half(x) * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.gelu(gate, approximate="tanh") * up


class KernelOps(TorchOps):
    """LayerOps on the C kernels where the tensors fit them (2-D float32 norms, float32
    rotations in place, silu * up and gelu_tanh * up in one pass), torch's elsewhere (int8
    mode)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and ops.rows_dense(x):
            return ops.rope_(x, cos, sin)  # in place, one call
        return super().rope(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ops.gelu_tanh_mul(gate_up)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, ops_: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.ops = ops_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T + b: on the C kernels from `blocks` (GGUF rows, their int8 form, or F32
    rows of the float weight) for 2-D inputs, else (no kernels, another device) from the
    float weight (absent where blocks alone serve: a GGUF weight on the CPU)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, blocks: Blocks | None) -> None:
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.blocks
        if p is not None and x.dim() == 2:
            y = ops.qmatmul(x, p)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A Linear over this rank's input columns: its partial outputs summed over the ranks
    (one all-reduce), so every rank has the whole y."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, blocks: Blocks | None,
                 parallel: Parallel) -> None:
        super().__init__(weight, bias, blocks)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(super().forward(x))


def take_linear(ws: WeightSet, prefix: str, n: int, k: int, bias: bool = False, blocks: bool = True,
                served_by: Blocks | None = None) -> Linear:
    """The Linear `prefix` ([n, k]: the rank's part) with its optional bias and (`blocks`)
    its blocks; `served_by`: blocks that serve it from elsewhere (the logits' head); a
    row-parallel one (the family's Sharding, over several ranks) sums its outputs over the
    ranks. Raises ModelLoadError for a weight that is neither loaded nor served by blocks."""
    name = f"{prefix}.weight"
    w = ws.take(name, (n, k))
    b = ws.blocks_for(name, w) if blocks else None
    check_served(name, w, served_by or b, ws, (n, k))
    bias_w = ws.optional(f"{prefix}.bias", (n,), bias)
    if ws.reduces(prefix):
        return RowParallelLinear(w, bias_w, b, ws.parallel)
    return Linear(w, bias_w, b)


def check_served(name: str, w: torch.Tensor | None, blocks: Blocks | None, ws: WeightSet,
                 shape: tuple[int, ...]) -> None:
    """A weight not loaded (meta) must be served by its GGUF blocks. Raises ModelLoadError."""
    if w is None and not ws.record:
        if blocks is None:
            raise ModelLoadError(f"weights neither loaded nor read as blocks: [{name!r}]")
        ws.count_served(shape)


class Embedding(nn.Module):
    """Rows of the token table: from the float table, or, without one (int8 mode), looked
    up in the GGUF rows and dequantized just those (exactly as gguf does)."""

    def __init__(self, weight: torch.Tensor | None, rows: PackedWeight | None) -> None:
        super().__init__()
        if weight is None and rows is None:
            raise ModelLoadError("the embedding is neither loaded nor kept as GGUF rows")
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        p = self.rows
        return ops.dequantize(p.rows(ids.reshape(-1))).reshape(*ids.shape, p.k)


class VocabEmbedding(Embedding):
    """A rank's rows [rank * R, (rank + 1) * R) of the token table (float, or GGUF rows): an
    id outside them looks up zeros, and the ranks' lookups are summed (each id is one
    rank's: the sum is exact)."""

    def __init__(self, weight: torch.Tensor | None, rows: PackedWeight | None, parallel: Parallel) -> None:
        super().__init__(weight, rows)
        self.parallel = parallel
        self.count = weight.shape[0] if weight is not None else rows.n
        self.start = parallel.rank * self.count

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        x = super().forward(local.clamp(0, self.count - 1)).masked_fill_(outside[..., None], 0.0)
        return self.parallel.all_reduce(x)


def block_logits(hidden: torch.Tensor, blocks: Blocks | None, out: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
    """Logits [N, n] float32 of hidden [N, E] on an output head's blocks (this rank's rows),
    into `out` where it has that shape; None where the blocks do not serve them (no blocks,
    hidden not float32): the caller multiplies by its float weight."""
    if blocks is None or hidden.dtype != torch.float32:
        return None
    fits = out is not None and out.shape == (hidden.shape[0], blocks.n)
    return ops.qmatmul(hidden, blocks, out=out if fits else None)  # [N, n]


def blocks_score(hidden: torch.Tensor, blocks: Blocks | None) -> bool:
    """Whether block_scores scores hidden on these blocks: an int8 head (kernels.scores.
    scores_on_head) and hidden float32 on the CPU."""
    return (blocks is not None and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
            and scores_on_head(blocks))


def block_scores(hidden: torch.Tensor, blocks: Blocks | None, targets: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """sampler.score_rows' scores of block_logits(hidden, blocks) with targets [N], made
    without the [N, n] logits (kernels.scores.score_head) where blocks_score(hidden, blocks):
    (lp [N], rank [N], top_ids [N, k], top_lp [N, k]); else None."""
    return score_head(hidden, blocks, targets, k) if blocks_score(hidden, blocks) else None


def take_embedding(ws: WeightSet, name: str, table: torch.Tensor | None) -> Embedding:
    """The embedding of `table` or of its GGUF rows (the rank's rows over several ranks:
    VocabEmbedding). Raises ModelLoadError when neither is there."""
    if ws.parallel.size > 1:
        return VocabEmbedding(table, ws.rows.get(name), ws.parallel)
    return Embedding(table, ws.rows.get(name))


def rope_inv_freq(arch: ModelArch, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """[D/2] inverse frequencies, with linear or Llama-3 scaling applied, on the CPU."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    if rope_freqs is not None:  # GGUF stores Llama-3's scaling as per-frequency divisors
        return (inv / rope_freqs.double()).float()
    rs = arch.rope_scaling
    if arch.rope_type == "linear":
        inv = inv / rs["factor"]
    elif arch.rope_type == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class Rotary(nn.Module):
    """cos, sin [T, 1, D] of the given positions (computed in float32)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k experts of each row of router logits [T, X]: ids [T, k] (int64, by
    descending weight) and weights [T, k], in float32: a softmax over every expert, its k
    largest, renormalised over those when `norm` (transformers' order of operations)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


class Router(nn.Module):
    """A mixture's router: x [T, E] -> (ids [T, k], weights [T, k] float32) of each
    token's chosen experts (route()); its product is a Linear (on the kernels, F32 rows)."""

    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str) -> None:
        super().__init__()
        self.proj = take_linear(ws, prefix, arch.num_experts, arch.hidden_size)
        self.k, self.norm = arch.experts_per_token, arch.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises RuntimeError, on the CPU, for a token whose scores are not finite (its
        hidden state is NaN or infinite): no expert is chosen for it, and its step fails."""
        logits = self.proj(x).float()  # [T, X]
        if logits.device.type == "cpu" and not bool(torch.isfinite(logits).all()):
            bad = int((~torch.isfinite(logits)).any(dim=-1).sum())
            raise RuntimeError(f"the router's scores are not finite for {bad} tokens (NaN or infinite hidden states)")
        return route(logits, self.k, self.norm)


def experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The experts in torch (the reference of the kernels; the path without them): each
    chosen expert over the tokens that chose it, silu(gate x) * up x then down, and each
    token's expert outputs weighted and summed in float32. x [T, E]; ids, weights [T, k];
    gate, up [X, I, E]; down [X, E, I]. Returns [T, E] in x's dtype."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the slots (token, rank) sorted by expert
    counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            slots = order[start:start + c]
            tok = slots // k
            h = x[tok]  # [c, E]
            y = F.linear(F.silu(F.linear(h, gate[e])) * F.linear(h, up[e]), down[e])  # [c, E]
            out.index_add_(0, tok, y.float() * weights.reshape(-1)[slots, None].float())
        start += c
    return out.to(x.dtype)


class Experts(nn.Module):
    """A mixture's SwiGLU experts, gate and up [X, I, E], down [X, E, I] (HF names:
    `{prefix}.{j}.gate_proj.weight` for expert j, or `{prefix}.gate_proj.weight` of all,
    as a GGUF file gives them). forward(x [T, E], ids, weights [T, k]) -> [T, E]: on the
    CPU from their blocks (ops.moe_ffn: each chosen expert's read once a step, no other's),
    on CUDA in Triton (kernels/triton_moe.py), else in torch (experts_torch). `reads`
    [X]: the bytes of each expert's blocks the kernel has read (tests, benchmarks)."""

    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str) -> None:
        super().__init__()
        x, e, i = arch.num_experts, arch.hidden_size, arch.expert_intermediate_size
        taken, blocks = [], []
        for proj, shape in (("gate_proj", (i, e)), ("up_proj", (i, e)), ("down_proj", (e, i))):
            name = f"{prefix}.{proj}.weight"
            w = ws.take_stacked(name, [f"{prefix}.{j}.{proj}.weight" for j in range(x)], shape)
            b = ws.blocks_for(name, w)
            check_served(name, w, b, ws, (x, *shape))
            taken.append(None if w is None else nn.Parameter(w, requires_grad=False))
            blocks.append(b)
        self.gate, self.up, self.down = taken
        self.kernel = ops.MoeExperts(*blocks) if all(isinstance(b, ExpertBlocks) for b in blocks) else None
        self.register_buffer("reads", torch.zeros(x, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            return ops.moe_ffn(self.kernel, x, ids, weights, self.reads)
        if self.gate is None:
            raise RuntimeError("the experts are held only as blocks, which the C kernels read on the CPU alone")
        if x.is_cuda and importlib.util.find_spec("triton") is not None:
            from hotprefix.model.kernels.triton_moe import fused_moe

            return fused_moe(x, ids, weights, self.gate, self.up, self.down)
        return experts_torch(x, ids, weights, self.gate, self.up, self.down)


class SparseMoe(nn.Module):
    """A mixture-of-experts MLP: the router (`{prefix}.gate`) picks each token's experts
    (`{prefix}.experts`), whose outputs it weights. Built as MLP is: (arch, ws, prefix, ops)."""

    def __init__(self, arch: ModelArch, ws: WeightSet, prefix: str, ops_: LayerOps) -> None:
        super().__init__()
        self.gate = Router(arch, ws, f"{prefix}.gate")
        self.experts = Experts(arch, ws, f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights)
