"""Sampling's cost on the CPU: the default model answering 8 chats at once (96 tokens each,
ignore_eos) under each kind of SamplingParams users send — greedy, temperature, top-p,
top-k, min-p, penalties — offline through LLM.chat. Output tokens/s (the best of --runs)
and a hash of the tokens, so that two checkouts can be compared on the same answers:

    python benchmarks/sampling.py                            # this tree
    PYTHONPATH=/path/to/other/checkout python benchmarks/sampling.py   # another one

One JSON line per setting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from hotprefix import LLM, SamplingParams
from hotprefix.model.default_model import default_model_path

SETTINGS = {
    "greedy": {"temperature": 0},
    "temperature": {"temperature": 0.7},
    "top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_p 0.95, T 1": {"temperature": 1.0, "top_p": 0.95},
    "top_k 40": {"temperature": 0.8, "top_k": 40},
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "repetition 1.1": {"temperature": 0, "repetition_penalty": 1.1},
    "llama.cpp's defaults": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}
QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
             "List five fruits and describe them.", "What is the capital of France and why is it famous?"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--seqs", type=int, default=8)
    args = p.parse_args()
    llm = LLM(args.model or str(default_model_path()))
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.seqs)]
    llm.chat(chats[:2], SamplingParams(max_tokens=8))  # warm-up
    for name, kw in SETTINGS.items():
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=1, **kw)
        best, outs = float("inf"), []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            outs = llm.chat(chats, sp)
            best = min(best, time.perf_counter() - t0)
        tokens = json.dumps([o.outputs[0].token_ids for o in outs]).encode()
        print(json.dumps({"setting": name, "params": kw, "output_tok_s": round(args.seqs * args.tokens / best, 1),
                          "tokens_sha1": hashlib.sha1(tokens).hexdigest()[:12]}), flush=True)


if __name__ == "__main__":
    main()
