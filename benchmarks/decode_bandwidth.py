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

from hotprefix import LLM, SamplingParams


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
            "share_median": statistics.median(r["share"] for r in rounds),
            "bytes_read_per_token": bytes_read_per_token(llm, prompt, a.tokens)}, a.json)


def bytes_read_per_token(llm: LLM, prompt: list[int], n: int) -> dict:
    """What a decode step reads, as the model holds it: every product's blocks outside the
    experts (their int8 forms in int8 mode), and the experts' bytes by the kernel's own
    counters over n decode steps (after the prompt's prefill)."""
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if hasattr(m, "kernel") and hasattr(m, "reads")]
    dense, seen = 0, set()
    for m in model.modules():
        for name in ("blocks", "qkv_blocks", "gate_up_blocks", "logits_blocks"):
            b = getattr(m, name, None)
            if b is not None and not hasattr(m, "reads") and id(b) not in seen:
                seen.add(id(b))
                dense += b.nbytes
    eng = llm.engine
    eng.add_request("bytes", prompt, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
    eng.step()  # the prefill and its token
    before = sum(int(e.reads.sum()) for e in experts)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    moe = (sum(int(e.reads.sum()) for e in experts) - before) / max(steps, 1)
    return {"dense_bytes": dense, "expert_bytes_per_token": moe, "total": dense + moe, "decode_steps": steps}


if __name__ == "__main__":
    main()
