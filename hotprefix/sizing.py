"""Pure KV-cache size arithmetic, shared by the engine and `hotprefix size`.

No torch import: the numbers depend only on the model's shape and the dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def dtype_bytes(dtype: str) -> int:
    """Bytes per element; raises ValueError for an unknown dtype name."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens (the last one may be partial)."""
    return math.ceil(num_tokens / block_size)


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
