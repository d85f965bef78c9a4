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

import torch
from prefix_ttft import single_decode
from read_bandwidth import decode_bytes, read_rate
from run_facts import report

from hotprefix import LLM


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
    prompt = list(range(100, 130))
    single_decode(llm, prompt, 5)
    buf.sum()
    rounds = []
    for _ in range(a.rounds):
        d, b = single_decode(llm, prompt, a.tokens), read_rate(buf, 3)
        rounds.append({"decode_tokens_per_s": d, "read_bytes_per_s": b, "share": d * nbytes / b})
    report({"model": a.model, "decode_bytes_per_token": nbytes, "rounds": rounds,
            "share_median": statistics.median(r["share"] for r in rounds)}, a.json)


if __name__ == "__main__":
    main()
