"""The 7 projections of all 30 layers of the default model for M rows of activations:
the GGUF block kernel against torch's float32 linear (MKL). Chooses qlinear.MAX_M.

    .venv/bin/python benchmarks/block_kernel_crossover.py
"""

from __future__ import annotations

import time

import torch

from hotprefix.model.kernels.ops import qmatmul
from hotprefix.model.loader import load_model

PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"]


def timed(fn, reps: int = 5) -> float:
    """Milliseconds per call, after 3 calls of warm-up."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.set_num_threads(2)
    lm = load_model(None)
    weights = lm.model_weights(blocks_only=False)  # the float32 weights, dequantized from the blocks
    names = [f"model.layers.{i}.{p}.weight" for i in range(lm.arch.num_layers) for p in PROJ]
    for m in (1, 4, 8, 12, 16, 24):
        xs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
        blocks = timed(lambda xs=xs: [qmatmul(xs[lm.packed[n].k], lm.packed[n]) for n in names])
        dense = timed(lambda xs=xs: [torch.nn.functional.linear(xs[weights[n].shape[1]], weights[n])
                                     for n in names])
        print(f"M={m:2d}  block kernel {blocks:6.1f} ms   float32 linear {dense:6.1f} ms")


if __name__ == "__main__":
    main()
