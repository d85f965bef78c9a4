"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names match Hugging Face's, so a HF state dict loads as is.
Shapes: T = tokens in the flat batch, H = query heads, KVH = KV heads,
D = head dim, E = hidden size, I = MLP size, V = vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hotprefix.model.arch import ModelArch, ModelLoadError
from hotprefix.model.attention import AttentionMetadata, paged_attention
from hotprefix.model.kv_cache import KVCache
from hotprefix.model.qlinear import (
    Blocks,
    Embedding,
    Linear,
    PackedWeight,
    fuse,
    library,
    qmatmul,
    rms_norm,
    rope_,
    silu_mul,
)

Regroup = Callable[[str, PackedWeight], PackedWeight]  # (HF name, GGUF rows) -> the int8 form


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # the C library: RMSNorm of 2-D float32 rows in one call (int8 mode, see attach_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2 and x.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps, self.kernel)
        if x.dtype == torch.float32:  # one fused op (the same arithmetic as below)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(arch: ModelArch, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """[D/2] inverse frequencies, with linear or Llama-3 scaling applied, on the CPU (also
    inside a meta-device context: arange on meta imported torch._dynamo, 1.5 s a start)."""
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.h, self.kvh, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        e = arch.hidden_size
        self.q_proj = Linear(e, self.h * self.d, bias=bias)
        self.k_proj = Linear(e, self.kvh * self.d, bias=bias)
        self.v_proj = Linear(e, self.kvh * self.d, bias=bias)
        self.o_proj = Linear(self.h * self.d, e, bias=o_bias)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, arch.rms_norm_eps)
        self.scale = self.d ** -0.5
        self.qkv_packed: Blocks | None = None  # q, k and v as one block product
        self.qkv_bias: torch.Tensor | None = None
        self.kernel = None  # the C library: RoPE in place (int8 mode, see attach_blocks)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D]: one block product for small batches when fused."""
        t = x.shape[0]
        if self.qkv_packed is not None and self.qkv_packed.serves(t):
            qkv = qmatmul(x, self.qkv_packed)  # [T, (H + 2 KVH) D]
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            q, k, v = qkv.split((self.h * self.d, self.kvh * self.d, self.kvh * self.d), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(t, self.h, self.d), k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, meta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kernel is not None and q.stride(1) == k.stride(1) == self.d and q.stride(2) == k.stride(2) == 1:
            q, k = rope_(q, cos, sin, self.kernel), rope_(k, cos, sin, self.kernel)  # in place, one call each
        else:
            q = q * cos + rotate_half(q) * sin  # cos, sin: [T, 1, D]
            k = k * cos + rotate_half(k) * sin
        o = paged_attention(q, k, v, kv, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, e: int, i: int) -> None:
        super().__init__()
        self.gate_proj = Linear(e, i, bias=False)
        self.up_proj = Linear(e, i, bias=False)
        self.down_proj = Linear(i, e, bias=False)
        self.gate_up_packed: Blocks | None = None  # gate and up as one block product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_packed is not None and self.gate_up_packed.serves(x.shape[0]):
            gate_up = qmatmul(x, self.gate_up_packed)  # [T, 2I]
            if self.gate_up_packed.int8:  # already approximate: the one-pass activation
                return self.down_proj(silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, bias, o_bias)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, x, cos, sin, kv, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Inner(nn.Module):
    def __init__(self, arch: ModelArch, bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, bias, o_bias) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv, meta) -> hidden [T, E];
    compute_logits(hidden [N, E]) -> [N, V] float32."""

    def __init__(self, arch: ModelArch, bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Inner(arch, bias, o_bias)
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.logits_packed: PackedWeight | None = None

    @classmethod
    def from_weights(cls, arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, blocks: dict[str, PackedWeight] | None = None,
                     int8: bool = False, regroup: Regroup | None = None) -> LlamaForCausalLM:
        """Build the module, load HF-named weights and attach GGUF `blocks` (see
        attach_blocks). A meta tensor in `weights` (LoadedModel.model_weights) stays a
        meta parameter until release_served_weights drops it: only int8 mode, which reads
        those weights as blocks alone, is given any. Raises ModelLoadError on a missing
        or unexpected tensor, or a shape that does not match the config."""
        weights = dict(weights)
        rope_freqs = weights.pop("rope_freqs", None)
        bias = "model.layers.0.self_attn.q_proj.bias" in weights
        o_bias = "model.layers.0.self_attn.o_proj.bias" in weights
        if not arch.tie_word_embeddings and "lm_head.weight" not in weights:
            arch = _with_tied(arch)
        if arch.tie_word_embeddings:
            weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy
        with torch.device("meta"):
            m = cls(arch, bias, o_bias)
        for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
            weights.pop(name)
        expected = dict(m.named_parameters())
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        if missing or extra:
            what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise ModelLoadError(f"weights do not match the {arch.family} architecture: {what}")
        for name, p in expected.items():
            if tuple(weights[name].shape) != tuple(p.shape):
                raise ModelLoadError(f"tensor {name} has shape {tuple(weights[name].shape)}, "
                                     f"the config implies {tuple(p.shape)}")
        state = {n: w if w.is_meta else w.to(device=device, dtype=dtype) for n, w in weights.items()}
        m.load_state_dict(state, assign=True)
        m.inv_freq = rope_inv_freq(arch, rope_freqs).to(device)
        if blocks:
            m.attach_blocks(blocks, int8, regroup)
        return m.eval()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D] for the given positions (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rope(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_cache.layers):
            x = layer(x, cos, sin, kv, meta)
        return self.model.norm(x)

    def attach_blocks(self, packed: dict[str, PackedWeight], int8: bool = False,
                      regroup: Regroup | None = None) -> int:
        """Let linear layers (and the logits) read these GGUF blocks (an empty dict
        detaches them all): for small batches, or with `int8`, in the int8 layout at
        every batch size, each weight's as `regroup(name, rows)` gives it (default:
        regrouped in memory; the runner passes weight_cache's). Returns the number of
        weights attached. Raises RuntimeError for int8 without the kernel library.

        from_weights calls it while building the model; benchmarks/ab_inprocess.py
        calls it again to compare the two ways on the same weights."""
        def form(name: str) -> PackedWeight | None:
            p = packed.get(name)
            if p is None or not int8:
                return p
            return (regroup or _regroup_in_memory)(name, p)

        n = 0
        for name, mod in self.named_modules():
            if isinstance(mod, Linear) and name != "lm_head":
                mod.packed = form(f"{name}.weight")
                n += mod.packed is not None
        for mod in self.modules():  # fuse the projections that share an input
            if isinstance(mod, Attention):
                projs = [mod.q_proj, mod.k_proj, mod.v_proj]
                mod.qkv_packed = fused = fuse([p.packed for p in projs])
                mod.qkv_bias = None if mod.q_proj.bias is None else torch.cat([p.bias.detach() for p in projs])
            elif isinstance(mod, MLP):
                projs = [mod.gate_proj, mod.up_proj]
                mod.gate_up_packed = fused = fuse([p.packed for p in projs])
            else:
                continue
            if fused is not None:
                for p in projs:
                    p.packed = None  # the fused product serves them
        head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
        self.logits_packed = form(head)
        self.model.embed_tokens.packed = packed.get("model.embed_tokens.weight")  # GGUF rows, never regrouped
        lib = library() if int8 else None
        for mod in self.modules():
            if isinstance(mod, (RMSNorm, Attention)):  # the small per-layer ops in C too (int8 mode only:
                mod.kernel = lib  # float32 mode keeps torch's arithmetic, token-identical to transformers)
        return n + (self.logits_packed is not None)

    def release_served_weights(self) -> int:
        """Drop the float32 weights that attached int8 blocks serve at every batch size
        (int8 mode never reads them: ~540 MB on the default model), the embedding table
        too when its GGUF rows are attached (lookups dequantize the rows they need).
        Biases and norms stay. Returns the bytes of float32 weights done without (released,
        or never dequantized: meta); afterwards the model cannot be
        re-attached for float32 activations (benchmarks that compare load twice).
        Raises ModelLoadError if a weight that was never loaded (meta) is not served."""
        served: set[nn.Module] = set()
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.packed is not None and mod.packed.int8:
                served.add(mod)
            elif isinstance(mod, Attention) and mod.qkv_packed is not None and mod.qkv_packed.int8:
                served.update((mod.q_proj, mod.k_proj, mod.v_proj))
            elif isinstance(mod, MLP) and mod.gate_up_packed is not None and mod.gate_up_packed.int8:
                served.update((mod.gate_proj, mod.up_proj))
        if not self.arch.tie_word_embeddings and self.logits_packed is not None and self.logits_packed.int8:
            served.add(self.lm_head)
        embed = self.model.embed_tokens
        if embed.packed is not None and (self.logits_packed is None or self.logits_packed.int8):
            served.add(embed)  # (a tied table must be left to float32 logits)
        freed = 0
        for mod in served:
            w = mod.weight
            freed += w.numel() * w.element_size()  # (meta: a weight the loader never dequantized)
            mod.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        unloaded = [n for n, w in self.named_parameters() if w.is_meta]
        if unloaded:
            raise ModelLoadError(f"weights neither loaded nor read as blocks: {unloaded[:3]}")
        return freed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self.logits_packed
        if p is not None and p.serves(hidden.shape[0]) and hidden.dtype == torch.float32:
            return qmatmul(hidden, p)  # [N, V]
        w = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
        return (hidden @ w.t()).float()  # [N, V]


def _regroup_in_memory(name: str, p: PackedWeight) -> PackedWeight:
    return p.regrouped()


def _with_tied(arch: ModelArch) -> ModelArch:
    from dataclasses import replace

    return replace(arch, tie_word_embeddings=True)
