"""The machine's int8 dot-product peak (int8_peak.c: AMX tiles where the CPU and kernel
grant them, VNNI on 512 and 256 bits, AVX2's vpmaddubsw chains; 1 and 2 threads), and with
--gguf the share of it that a prefill's int8 products reach: every layer's products of the
file (q|k|v and gate|up fused, as the model runs them) on x [--tokens, K], through the
kernel library (kernels/ops.qmatmul), against the best path and against VNNI's. The
products run on AMX tiles where the library turned them on; HOTPREFIX_NO_AMX=1 runs them
on the VNNI kernels (kernel_paths in the result says which).

Each rate is given two ways: by the wall clock, and by CPU time (a thread's multiply-adds
over the CPU time it ran; for the products, the process's CPU time over all its threads):
on a machine shared with other work the wall clock measures the sharing, CPU time what
the cores do while they run this. A multiply-add is 2 int8 ops.

    .venv/bin/python benchmarks/int8_peak.py [--gguf FILE.gguf] [--tokens 1030] [--layers N] [--json out.json]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from run_facts import report

from hotprefix.model.kernels.build import compile_flags

HERE = Path(__file__).parent


def peak(seconds: float = 0.1, runs: int = 15, threads: int = 2) -> dict[str, dict[str, float]]:
    """{"path/threads": {"wall": MAC/s, "cpu": MAC/s}} of int8_peak.c, built with the
    kernel library's flags (best of `runs` runs of `seconds`). Raises RuntimeError
    without a C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        subprocess.run([cc, *compile_flags(), str(HERE / "int8_peak.c"), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(seconds), str(runs), str(threads)], check=True, capture_output=True,
                             text=True).stdout
    rates = {}
    for line in out.splitlines():
        path, t, wall, cpu = line.split()
        rates[f"{path}/{t}"] = {"wall": float(wall), "cpu": float(cpu)}
    return rates


def layer_products(path: str) -> list:
    """Every layer's int8 products of a GGUF file as the model runs them: (q|k|v), o,
    (gate|up), down, regrouped (mapped from the regrouped-weight cache, built into it the
    first time)."""
    from hotprefix.model.build import _mode_blocks
    from hotprefix.model.kernels.weights import fuse
    from hotprefix.model.loader import load_model
    from hotprefix.model.parallel import SINGLE

    lm = load_model(path)
    blocks = _mode_blocks(lm, lm.packed, int8=True, parallel=SINGLE)
    products = []
    for i in range(lm.arch.num_layers):
        w = {re.sub(r"^model\.layers\.\d+\.", "", n).removesuffix(".weight"): b for n, b in blocks.items()
             if n.startswith(f"model.layers.{i}.")}
        products += [fuse([w["self_attn.q_proj"], w["self_attn.k_proj"], w["self_attn.v_proj"]]),
                     w["self_attn.o_proj"], fuse([w["mlp.gate_proj"], w["mlp.up_proj"]]), w["mlp.down_proj"]]
    return products


def prefill_rate(products: list, tokens: int, threads: int) -> dict[str, float]:
    """Multiply-adds a second of one pass over `products` with x [tokens, K] on `threads`
    threads (after an untimed pass over the first layer): wall clock and process CPU time."""
    import torch

    from hotprefix.model.kernels.ops import qmatmul

    torch.set_num_threads(threads)
    xs = {w.k: torch.randn(tokens, w.k) for w in products}
    for w in products[:4]:
        qmatmul(xs[w.k], w)
    macs = sum(tokens * w.k * w.n for w in products)
    t0, c0 = time.perf_counter(), time.process_time()
    for w in products:
        qmatmul(xs[w.k], w)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"macs": macs, "seconds": wall, "cpu_seconds": cpu, "wall": macs / wall, "cpu": macs / cpu * threads}


def per_product(products: list, tokens: int) -> dict[str, float]:
    """Multiply-adds a CPU-second of each of the first layer's products on one thread
    (best of 3 calls), by their parts' types: what each kernel reaches."""
    import torch

    from hotprefix.model.kernels.ops import qmatmul

    torch.set_num_threads(1)
    rates = {}
    for name, w in zip(("qkv", "o", "gate_up", "down"), products[:4]):
        x = torch.randn(tokens, w.k)
        best = min(_cpu_seconds(qmatmul, x, w) for _ in range(3))
        rates[f"{name} {'+'.join(p.type_name for p in w.parts)} K={w.k}"] = tokens * w.k * w.n / best
    return rates


def _cpu_seconds(fn, *args) -> float:
    c0 = time.process_time()
    fn(*args)
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="a GGUF file whose prefill products to time against the peak")
    ap.add_argument("--tokens", type=int, default=1030)
    ap.add_argument("--layers", type=int, default=0, help="time only the first N layers (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    from hotprefix.model.kernels.build import library, vector_paths

    result: dict = {"peak_macs_per_s": peak(threads=args.threads), "kernel_paths": vector_paths(library())}
    if args.gguf:
        products = layer_products(args.gguf)
        if args.layers:
            products = products[:4 * args.layers]
        best = max(r["cpu"] for k, r in result["peak_macs_per_s"].items() if k.endswith("/1"))
        runs = {}
        for t in range(1, args.threads + 1):
            r = prefill_rate(products, args.tokens, t)
            full = max(v["cpu"] for k, v in result["peak_macs_per_s"].items() if k.endswith(f"/{t}"))
            vnni = result["peak_macs_per_s"].get(f"vnni512/{t}", {"cpu": full})["cpu"]
            runs[t] = {**r, "share_cpu": r["cpu"] / full, "share_wall": r["wall"] / full,
                       "share_vnni_cpu": r["cpu"] / vnni}
        result["prefill"] = {"file": args.gguf, "tokens": args.tokens, "products": len(products),
                             "best_1_thread_peak": best, "by_threads": runs,
                             "layer0_per_product_cpu": per_product(products, args.tokens)}
    report(result, args.json)


if __name__ == "__main__":
    main()
