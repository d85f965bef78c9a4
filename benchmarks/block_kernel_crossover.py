"""The 7 projections of all 30 layers of the default model for M rows of activations:
the GGUF block kernel against torch's float32 linear (MKL). Chooses qlinear.MAX_M.

    .venv/bin/python benchmarks/block_kernel_crossover.py
"""
import time

import torch

from hotprefix.model.loader import load_model
from hotprefix.model.qlinear import qmatmul

torch.set_num_threads(2)
lm = load_model(None); P = lm.packed; W = lm.weights
pre = "model.layers.0."
names = [pre + f"self_attn.{p}_proj.weight" for p in "qkvo"] + [pre + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
def t(f, R=20):
    for _ in range(3): f()
    s = time.perf_counter()
    for _ in range(R): f()
    return (time.perf_counter() - s) / R * 1e3
# use 30 distinct copies? weights of layer 0..29 to defeat cache
layers = range(30)
for M in (1, 4, 8, 12, 16):
    xs = {576: torch.randn(M, 576), 1536: torch.randn(M, 1536)}
    def kern():
        for l in layers:
            for n in names:
                n2 = n.replace("layers.0.", f"layers.{l}.")
                w = P[n2]; qmatmul(xs[w.k], w)
    def mkl():
        for l in layers:
            for n in names:
                n2 = n.replace("layers.0.", f"layers.{l}.")
                w = W[n2]; torch.nn.functional.linear(xs[w.shape[1]], w)
    print(M, "kernel %.1f ms  mkl %.1f ms" % (t(kern, 5), t(mkl, 5)))
