"""Pure KV-cache size arithmetic, shared by the engine and `hotprefix size`.

No torch import: the numbers depend only on the model's shape and the dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

# Bytes per element of each KV dtype name ("auto" is resolved by the caller).
DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class KVShape:
    """The part of a model's shape that decides its KV size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: str) -> int:
        """K and V of one token over all layers: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def bytes_per_block(self, dtype: str, block_size: int) -> int:
        return self.bytes_per_token(dtype) * block_size


@dataclass(frozen=True)
class KVGroupLayout:
    """A model's layers in KV-cache groups by attention kind, as vLLM's hybrid allocator
    makes them: every group holds the same number of layers (`page_layers`: the fewest
    layers of one kind), so that a block of any group is one page of the same size; a
    kind with more layers takes several groups (the last one padded). `windows[g]`: None
    for a full-attention group (it keeps every block of a sequence), else the window of
    its layers (it needs only the blocks that meet a sequence's last `window` tokens).
    Gemma 3 270M (18 layers, every sixth global): one full group of 3 layers, five
    window groups of 3; a Llama: one full group of all its layers."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]
    page_layers: int

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> KVGroupLayout:
        kinds: dict[int | None, list[int]] = {}
        for i, w in enumerate(layer_windows):
            kinds.setdefault(w, []).append(i)
        per = min(len(v) for v in kinds.values())
        groups = [(w, tuple(ls[j:j + per])) for w, ls in sorted(kinds.items(), key=lambda kv: kv[0] is not None)
                  for j in range(0, len(ls), per)]
        return cls(tuple(w for w, _ in groups), tuple(ls for _, ls in groups), per)

    @classmethod
    def pooled(cls, layer_windows: Sequence[int | None]) -> KVGroupLayout | None:
        """The layout the pool is grouped by (core/kv_groups.py), or None where one block table
        serves every layer: one kind of attention, or windows without a full-attention layer."""
        layout = cls.of(layer_windows)
        return layout if len(layout.windows) > 1 and layout.windows[0] is None else None

    def page_bytes(self, kv: KVShape, dtype: str, block_size: int) -> int:
        """Bytes of one block of any group: K and V of page_layers layers."""
        return 2 * self.page_layers * kv.num_kv_heads * kv.head_dim * dtype_bytes(dtype) * block_size

    def window_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """The most blocks the window groups hold at once for one sequence (window_blocks)."""
        return window_blocks(self.windows, num_tokens, block_size, chunk_tokens)

    def blocks_held(self, group: int, num_tokens: int, block_size: int, retained_tails: int = 0) -> int:
        """Blocks group `group` holds for a sequence of num_tokens: all of them (full), or
        the blocks meeting its last `window` tokens plus `retained_tails` window tails
        kept at boundaries (each the blocks a hit there needs)."""
        w = self.windows[group]
        total = blocks_for_tokens(num_tokens, block_size)
        if w is None:
            return total
        tail = blocks_for_tokens(w - 1, block_size) + 1
        return min(total, tail * (1 + retained_tails))

    def sequence_blocks(self, num_tokens: int, block_size: int, retained_tails: int = 0) -> int:
        """Blocks (pages) a sequence of num_tokens holds over every group (blocks_held's sum)."""
        return sum(self.blocks_held(g, num_tokens, block_size, retained_tails) for g in range(len(self.windows)))

    def bytes_per_sequence(self, kv: KVShape, dtype: str, num_tokens: int, block_size: int,
                           retained_tails: int = 0) -> int:
        """KV bytes a sequence of num_tokens holds over every group (pages of page_layers
        layers; a padded group's page counts whole)."""
        return self.page_bytes(kv, dtype, block_size) * self.sequence_blocks(num_tokens, block_size, retained_tails)


def window_blocks(windows: Sequence[int | None], num_tokens: int, block_size: int, chunk_tokens: int) -> int:
    """The most blocks the window groups (those of `windows` that are not None) hold at once for
    one sequence of num_tokens computing at most chunk_tokens a step: each, the blocks of its
    window before a chunk and of the chunk."""
    total = blocks_for_tokens(num_tokens, block_size)
    return sum(min(total, blocks_for_tokens(w - 1 + min(chunk_tokens, num_tokens), block_size) + 1)
               for w in windows if w is not None)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element; raises ValueError for an unknown dtype name."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens (the last one may be partial)."""
    return math.ceil(num_tokens / block_size)


def max_cached_blocks(num_tokens: int, block_size: int) -> int:
    """The most leading full blocks of a sequence that may come from the prefix cache:
    its last token is always computed (its logits give the next token)."""
    return max(0, num_tokens - 1) // block_size


def num_blocks_in_budget(budget_bytes: int, shape: KVShape, dtype: str, block_size: int) -> int:
    """How many whole blocks fit in budget_bytes (0 if the budget is negative)."""
    if budget_bytes <= 0:
        return 0
    return budget_bytes // shape.bytes_per_block(dtype, block_size)


def gpu_kv_budget(total_bytes: int, utilization: float, weight_bytes: int, activation_bytes: int) -> int:
    """KV budget on a GPU: total * utilization minus weights and peak activations."""
    return int(total_bytes * utilization) - weight_bytes - activation_bytes


def activation_bytes_estimate(max_num_batched_tokens: int, hidden_size: int, intermediate_size: int,
                              vocab_size: int, max_num_seqs: int, dtype_size: int) -> int:
    """A generous bound on the activations of one forward step.

    The largest live tensors are the MLP's gate and up projections ([T, 2 * I]),
    a few [T, hidden] residual copies, and the logits ([seqs, vocab], in float32).
    """
    per_token = (2 * intermediate_size + 6 * hidden_size) * dtype_size
    logits = max_num_seqs * vocab_size * 4 * 2
    return max_num_batched_tokens * per_token + logits


def vocab_rows(vocab: int, tp: int) -> int:
    """The vocabulary rows each of tp ranks keeps (the last rank's padded with zeros)."""
    return -(-vocab // tp)


def split_refusal(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> str | None:
    """Why a model of these heads and MLP size does not split over `tp` tensor-parallel
    ranks (each rank its heads, GQA groups whole, and its MLP columns), or None."""
    flag = f"--tensor-parallel-size {tp}"
    if num_kv_heads % tp or num_heads % tp:
        fits = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0 and num_heads % n == 0]
        return (f"{flag}: the model's {num_kv_heads} KV heads and {num_heads} query heads do not split over {tp} "
                f"ranks (the size must divide both: {', '.join(map(str, fits))})")
    if intermediate_size % tp:
        return f"{flag}: the model's MLP size {intermediate_size} does not split over {tp} ranks"
    return None


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: enough for KV size and a weight-size estimate."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    layer_windows: tuple[int | None, ...] = ()  # each layer's attention window (empty: all full)
    num_experts: int = 0  # a mixture of experts: moe_layers of the layers route each token
    experts_per_token: int = 0  # to this many of num_experts SwiGLU experts
    expert_intermediate_size: int = 0
    moe_layers: int = 0
    qk_norm: bool = False  # per-head RMSNorms of q and k (Qwen3): 2 x head_dim a layer

    @property
    def kv(self) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim)

    def per_device(self, tp: int) -> ModelShape:
        """What one of `tp` tensor-parallel ranks holds: its query and KV heads, its MLP
        columns, its rows of the vocabulary (the norms whole). Raises ValueError (split_refusal's
        line) for a shape that does not split, or a mixture of experts (not split)."""
        if tp == 1:
            return self
        why = split_refusal(tp, self.num_heads, self.num_kv_heads, self.intermediate_size)
        if why is None and self.num_experts:
            why = f"--tensor-parallel-size {tp}: a mixture of experts runs on one device only"
        if why is not None:
            raise ValueError(why)
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=self.num_kv_heads // tp,
                       intermediate_size=self.intermediate_size // tp, vocab_size=vocab_rows(self.vocab_size, tp))

    @property
    def kv_groups(self) -> KVGroupLayout:
        return KVGroupLayout.of(self.layer_windows or (None,) * self.num_layers)

    @property
    def pool_groups(self) -> KVGroupLayout:
        """The groups the engine's pool holds this shape in (KVGroupLayout.pooled; one full group
        of every layer where one block table serves every layer)."""
        full = KVGroupLayout((None,), (tuple(range(self.num_layers)),), self.num_layers)
        return (KVGroupLayout.pooled(self.layer_windows) if self.layer_windows else None) or full

    def num_params(self, active: bool = False) -> int:
        """Parameters of a Llama-style decoder (attention without bias, SwiGLU MLPs or
        mixtures of SwiGLU experts with a router, RMSNorms, Qwen3's q/k norms); `active`: those one token's
        forward pass reads (its top experts only; the embedding table counted whole, as
        published "active" counts do)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        moe = experts * 3 * h * self.expert_intermediate_size + self.num_experts * h  # experts, router
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        dense_layers = self.num_layers - self.moe_layers
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return self.num_layers * (attn + norms) + dense_layers * mlp + self.moe_layers * moe + embed + h


@dataclass(frozen=True)
class SizeReport:
    """The answers of `hotprefix size` for one dtype. Byte counts are exact integers."""

    dtype: str
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    prompt_tokens: int
    blocks_per_prompt: int
    bytes_per_prompt: int
    num_prompts: int
    pool_blocks: int
    pool_bytes: int
    budget_bytes: int | None
    blocks_in_budget: int | None
    max_model_len: int
    concurrency: int
    private_blocks_per_request: int
    blocks_needed: int
    fits_without_eviction: bool | None
    max_concurrency: int | None
    max_concurrency_unshared: int | None
    # a sequence of max_model_len tokens in the model's KV groups (KVGroupLayout: window groups
    # hold their window's blocks, plus retained_tails tails kept at boundaries) and in the
    # all-full layout (every layer every block)
    sequence_bytes: int = 0
    sequence_bytes_full: int = 0
    retained_tails: int = 0
    host_tier_blocks: int = 0  # --kv-offloading-size: full blocks, and the prompts they hold
    host_tier_prompts: int = 0
    disk_tier_blocks: int = 0  # --kv-disk-size (each file: a block and a DISK_HEADER_BYTES header)
    disk_tier_prompts: int = 0


DISK_HEADER_BYTES = 112  # engine/kv_disk.py's file header (checked there)


def size_report(shape: ModelShape, dtype: str, block_size: int = 16, prompt_tokens: int = 0, num_prompts: int = 1,
                concurrency: int = 1, max_model_len: int | None = None, budget_bytes: int | None = None,
                host_tier_bytes: int = 0, disk_tier_bytes: int = 0, retain_every: int = 0) -> SizeReport:
    """KV sizes for a pool of num_prompts distinct prompts of prompt_tokens each
    (kept cached, shared by every request that starts with them), with
    `concurrency` requests of up to max_model_len tokens running at once.
    The tiers below the pool (host_tier_bytes, disk_tier_bytes) keep full blocks:
    how many, and how many prompts' full blocks that is.

    Blocks are the pool's as the engine allocates them (ModelShape.pool_groups): for a
    model with window layers, pages of one group's layers; a prompt keeps its full group's
    blocks and each window group's tail at its end and every `retain_every` tokens
    (KVGroupLayout.blocks_held), a request's window groups hold their window.

    Each running request needs its own blocks for what follows its prompt's
    full blocks; `fits_without_eviction` is whether the prompt pool plus that
    working set fit the budget. `max_concurrency` is how many requests of
    max_model_len fit beside the pool; `max_concurrency_unshared` with no sharing.
    """
    max_len = max_model_len or shape.max_position_embeddings or prompt_tokens
    groups = shape.pool_groups
    bpt = shape.kv.bytes_per_token(dtype)
    bpb = groups.page_bytes(shape.kv, dtype, block_size)
    def tails(n: int) -> int:  # retention boundaries before the tail at a sequence's end
        return (n - 1) // retain_every if retain_every and n else 0

    per_prompt_blocks = groups.sequence_blocks(prompt_tokens, block_size, tails(prompt_tokens))
    shared_full = prompt_tokens // block_size
    tier_prompt = groups.sequence_blocks(shared_full * block_size, block_size, tails(prompt_tokens))
    sequence = groups.sequence_blocks(max_len, block_size)
    private = sequence - shared_full
    pool = per_prompt_blocks * num_prompts
    need = pool + concurrency * private
    null = len(groups.windows) > 1  # (a grouped pool's null block)
    in_budget = None if budget_bytes is None else max(0, max(0, budget_bytes) // bpb - null)
    host_blocks, disk_blocks = host_tier_bytes // bpb, disk_tier_bytes // (bpb + DISK_HEADER_BYTES)
    return SizeReport(
        dtype=dtype, block_size=block_size, bytes_per_token=bpt, bytes_per_block=bpb,
        prompt_tokens=prompt_tokens, blocks_per_prompt=per_prompt_blocks, bytes_per_prompt=per_prompt_blocks * bpb,
        num_prompts=num_prompts, pool_blocks=pool, pool_bytes=pool * bpb, budget_bytes=budget_bytes,
        blocks_in_budget=in_budget, max_model_len=max_len, concurrency=concurrency,
        private_blocks_per_request=private, blocks_needed=need,
        fits_without_eviction=None if in_budget is None else need <= in_budget,
        max_concurrency=None if in_budget is None else max(0, (in_budget - pool) // max(private, 1)),
        max_concurrency_unshared=None if in_budget is None else in_budget // max(sequence, 1),
        sequence_bytes=groups.bytes_per_sequence(shape.kv, dtype, max_len, block_size, tails(max_len)),
        sequence_bytes_full=bpt * max_len, retained_tails=tails(max_len),
        host_tier_blocks=host_blocks, host_tier_prompts=host_blocks // max(tier_prompt, 1),
        disk_tier_blocks=disk_blocks, disk_tier_prompts=disk_blocks // max(tier_prompt, 1))
