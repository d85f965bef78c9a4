"""How much of the machine's read bandwidth single-stream decode uses, measured so that a
shared machine's swings cancel: decode rounds (one sequence, in process) alternate with
streaming reads of as many bytes as a decode step reads (read_bandwidth.py), and each
round's ratio (decode bytes per second over read bytes per second) is taken from
neighbouring measurements.

    .venv/bin/python benchmarks/decode_bandwidth.py FILE.gguf [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from read_bandwidth import decode_bytes
from run_facts import report

from hotprefix import LLM, SamplingParams


def decode_rate(llm: LLM, rid: str, tokens: int) -> float:
    """Tokens/s of one sequence after its first token."""
    eng = llm.engine
    eng.add_request(rid, list(range(100, 130)), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    stamps = []
    while eng.has_unfinished_requests():
        if eng.step():
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def read_rate(buf: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 8 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=17, help="decode steps a round")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(model=a.model, kv_cache_memory=256 << 20)
    nbytes = decode_bytes(a.model)
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    decode_rate(llm, "warm", 5)
    buf.sum()
    rounds = []
    for r in range(a.rounds):
        d, b = decode_rate(llm, f"r{r}", a.tokens), read_rate(buf)
        rounds.append({"decode_tokens_per_s": d, "read_bytes_per_s": b, "share": d * nbytes / b})
    report({"model": a.model, "decode_bytes_per_token": nbytes, "rounds": rounds,
            "share_median": statistics.median(r["share"] for r in rounds)}, a.json)


if __name__ == "__main__":
    main()
