"""The machine's streaming read bandwidth over as many bytes as one decode step of a GGUF
file reads, and those bytes: what single-stream decode speed is measured against.

A decode step reads every weight once except the embedding table (one row a token; the
table itself when the output is tied to it), and of a mixture's experts only the ones the
token takes (k of X: the active weights). The bandwidth is a parallel sum over a
buffer of that size on every core (torch's reduction), best of 7 after one untimed pass.

    .venv/bin/python benchmarks/read_bandwidth.py FILE.gguf [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import torch
from run_facts import report

from hotprefix.model.gguf_file import GGUFFile


def decode_bytes(path: str) -> int:
    """Bytes of the tensors a decode step reads (a mixture's experts: k of X)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    reader = GGUFFile(path)
    names = {t.name for t in reader.tensors}
    arch = reader.get("general.architecture")
    experts, used = reader.get(f"{arch}.expert_count") or 1, reader.get(f"{arch}.expert_used_count") or 1
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        rows, cols = t.rows_cols
        nbytes = rows * cols // block * size
        total += nbytes * used // experts if "_exps." in t.name else nbytes
    return total


def read_rate(buf: torch.Tensor, repeats: int = 7) -> float:
    """Bytes per second of a parallel sum over buf (int64; best of `repeats`)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 8 / best


def read_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes per second of a parallel sum over nbytes, after one untimed pass."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    buf.sum()
    return read_rate(buf, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n = decode_bytes(a.model)
    bw = read_bandwidth(n)
    report({"model": a.model, "decode_bytes_per_token": n, "read_bytes_per_s": bw, "threads": torch.get_num_threads(),
            "decode_tokens_per_s_at_bandwidth": bw / n}, a.json)


if __name__ == "__main__":
    main()
