"""Issue 47's GPU goal: `-tp 1` through the tensor-parallel code loses nothing against the code
before it, in the same run on one GPU (decode and TTFT within 2 %).

Each checkout (a folder holding a `hotprefix/` package) runs in its own process, in
alternating order (ABC, CBA, ...), on random weights of a real shape (--load-format dummy,
bf16, the triton backend with CUDA graphs, prefix caching off so every prompt is cold):

- ttft_s: one prompt of --prompt-len tokens, one output token (median of 5);
- decode_ms: single-sequence decode, (time of 1 + D tokens - time of 1 token) / D (medians of --reps);
- batch_tok_s: --batch sequences decoding D tokens each, output tokens/s (median of --reps).

    python benchmarks/gpu_tp_ab.py --checkout base=.device/base --checkout new=. --rounds 2
    python benchmarks/gpu_tp_ab.py --device cpu --model FOLDER --quick --checkout new=.   # smoke test

One JSON line per measurement on stdout (and appended to --out), then a summary line per
shape: each checkout's medians over the rounds and new/base ratios. benchmarks/gpu_run.sh
runs it as its `tp-ab` phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(args: argparse.Namespace) -> None:
    """Measure one checkout (the hotprefix on sys.path) on every shape; one JSON line each."""
    import torch

    from hotprefix import LLM, SamplingParams

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def gen(llm, batch, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        sync()
        return time.perf_counter() - t0

    for shape in args.model:
        t_build = time.perf_counter()
        llm = LLM(shape, load_format="dummy", tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                  max_model_len=args.max_model_len, enable_prefix_caching=False, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.batched_tokens,
                  **({"num_blocks_override": 256} if args.quick else {}))
        build_s = time.perf_counter() - t_build
        vocab = llm.engine.runner.arch.vocab_size
        g = torch.Generator().manual_seed(7)

        def ids(n: int, length: int, vocab: int = vocab, g: torch.Generator = g) -> list[list[int]]:
            return torch.randint(100, min(vocab, 30000), (n, length), generator=g).tolist()

        d = args.decode_tokens
        gen(llm, ids(1, args.prompt_len), 2)  # warm-up: kernels compiled, graphs replayed
        gen(llm, ids(args.batch, 128), 4)
        ttft = statistics.median(gen(llm, ids(1, args.prompt_len), 1) for _ in range(5))
        one = ids(1, 128)
        t1 = statistics.median(gen(llm, one, 1) for _ in range(args.reps))
        td = statistics.median(gen(llm, one, d + 1) for _ in range(args.reps))
        batch = ids(args.batch, 128)
        tb = statistics.median(gen(llm, batch, d) for _ in range(args.reps))
        print(json.dumps({"what": "tp_ab", "checkout": args.name, "shape": shape, "build_s": round(build_s, 1),
                          "ttft_s": round(ttft, 4), "decode_ms": round((td - t1) / d * 1e3, 3),
                          "batch": args.batch, "batch_tok_s": round(args.batch * d / tb, 1)}), flush=True)
        llm.close()
        del llm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def parent(args: argparse.Namespace, rest: list[str]) -> None:
    checkouts = [c.split("=", 1) for c in args.checkout]
    rows: list[dict] = []

    def emit(d: dict) -> None:
        line = json.dumps(d)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    for r in range(args.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        for name, folder in order:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(folder)}
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, *rest], env=env,
                               capture_output=True, text=True, timeout=args.child_timeout)
            got = [json.loads(x) for x in p.stdout.splitlines() if x.startswith('{"what": "tp_ab"')]
            for d in got:
                rows.append(d)
                emit({**d, "round": r})
            if p.returncode:
                emit({"what": "tp_ab_error", "checkout": name, "round": r, "rc": p.returncode,
                      "stderr": p.stderr[-1500:]})
    base = checkouts[0][0]
    for shape in args.model:
        med = {}
        for name, _ in checkouts:
            mine = [d for d in rows if d["checkout"] == name and d["shape"] == shape]
            if mine:
                med[name] = {k: statistics.median(d[k] for d in mine) for k in ("ttft_s", "decode_ms", "batch_tok_s")}
                med[name]["runs"] = len(mine)
        ratio = {n: {k: round(v[k] / med[base][k], 4) for k in ("ttft_s", "decode_ms", "batch_tok_s")}
                 for n, v in med.items() if base in med and n != base}
        emit({"what": "tp_ab_summary", "shape": shape, "base": base, "medians": med, "ratio_to_base": ratio})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", action="append", default=[], help="NAME=FOLDER (the first is the base)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child-timeout", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test of the script)")
    args, _ = p.parse_known_args()
    if args.quick:
        args.prompt_len, args.decode_tokens, args.batch, args.max_model_len = 64, 8, 4, 512
        args.max_num_seqs, args.batched_tokens = 8, 512
        if not args.device.startswith("cuda"):
            args.dtype = "float32"
    if args.child:
        args.name = args.child
        child(args)
        return
    rest = _child_args(sys.argv[1:])
    parent(args, rest)


def _child_args(argv: list[str]) -> list[str]:
    """argv less the parent's own options (--checkout, --rounds, --child-timeout, --out)."""
    own = {"--checkout", "--rounds", "--child-timeout", "--out"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in own:
            skip = "=" not in a
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
