#!/usr/bin/env python3
"""The transformers baseline for the `ttft` workload: the default model in float32 with
`generate`, in process, no cache across requests.

It sends the exact prompts `hotprefix bench --workload ttft` sends the servers (a 1,000-word
shared prefix, one question each; the first request cold, the rest on the same prefix), greedy,
--new-tokens tokens each (EOS held off until then, as `ignore_eos`), and reports:

  cold TTFT  the first prompt's time to its first token (a 2-token call warms lazy set-up before)
  warm TTFT  the median over the other prompts: transformers reuses nothing between requests,
             so each prefills its whole prompt again
  decode     one sequence's tokens/s after its first token, (n - 1) / (t_n - t_1), median

Run it with the project's venv (it has torch, transformers, gguf, accelerate and hotprefix):

    .venv/bin/python benchmarks/peers/hf_baseline.py [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from hotprefix.model.default_model import default_model_path
from hotprefix.tools.workloads import build


class TokenTimes(BaseStreamer):
    """Records when each new token arrives; generate's first put() carries the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
        else:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class Timing:
    """One request: prompt tokens, time to the first token, decode rate after it."""

    prompt_tokens: int
    ttft_s: float
    decode_tok_s: float | None


def timed_generate(model, ids: list[int], new_tokens: int, pad_id: int) -> Timing:
    """Greedy `generate` of exactly `new_tokens` tokens after `ids`, timed per token."""
    x = torch.tensor([ids])
    clock = TokenTimes()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=pad_id, streamer=clock)
    t = clock.times
    rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None
    return Timing(len(ids), t[0] - start, rate)


def main() -> int:
    ap = argparse.ArgumentParser(description="transformers baseline (float32, no cache across requests)")
    ap.add_argument("--gguf", type=Path, default=None, help="model file (default: hotprefix's default model)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="the bench workload's seed")
    ap.add_argument("--scale", type=float, default=1.0, help="the bench workload's scale")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gguf = (a.gguf or default_model_path()).resolve()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    jobs, _, _ = build("ttft", a.seed, a.scale)
    pad = tok.eos_token_id
    timed_generate(model, tok(jobs[0].prompt[:64])["input_ids"], 2, pad)  # lazy set-up, untimed
    runs = [timed_generate(model, tok(j.prompt)["input_ids"], a.new_tokens, pad) for j in jobs]
    rates = [r.decode_tok_s for r in runs if r.decode_tok_s]
    res = {"system": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
           "dtype": "float32", "threads": torch.get_num_threads(), "model": gguf.name, "load_s": load_s,
           "new_tokens": a.new_tokens, "cold_ttft_s": runs[0].ttft_s,
           "warm_ttft_p50_s": statistics.median(r.ttft_s for r in runs[1:]) if len(runs) > 1 else None,
           "decode_tok_s_p50": statistics.median(rates) if rates else None, "runs": [asdict(r) for r in runs]}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, float32, "
          f"{res['threads']} threads, {gguf.name}; load {load_s:.2f} s")
    print(f"cold TTFT {res['cold_ttft_s']:.3f} s ({runs[0].prompt_tokens} prompt tokens)")
    if res["warm_ttft_p50_s"] is not None:
        print(f"warm TTFT {res['warm_ttft_p50_s']:.3f} s (median of {len(runs) - 1}; no reuse across requests)")
    if res["decode_tok_s_p50"] is not None:
        print(f"decode    {res['decode_tok_s_p50']:.1f} tok/s (median of {len(rates)}, one sequence)")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
