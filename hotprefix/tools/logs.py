"""`hotprefix logs`: prompt lengths from a request log, and the --max-model-len they call for."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.sizing import blocks_for_tokens
from hotprefix.tools.jsonl import iter_objects


def percentile(values: list, p: float):
    """Nearest-rank percentile (the smallest value with at least p% of values at or below it)."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def read_token_counts(path: Path) -> tuple[list[int], list[int]]:
    """(prompt tokens, completion tokens or -1) per row of a JSONL file: hotprefix's
    request log, or any rows with `prompt_tokens` at the top or under `usage`.
    Raises ConfigError naming the first bad line."""
    prompts, completions = [], []
    for i, row in iter_objects(path):
        src = row if "prompt_tokens" in row else row.get("usage") or {}
        if not isinstance(src.get("prompt_tokens"), int):
            raise ConfigError(f"{path}:{i}: no integer prompt_tokens (top level or under usage)")
        prompts.append(src["prompt_tokens"])
        c = src.get("completion_tokens")
        completions.append(c if isinstance(c, int) else -1)
    if not prompts:
        raise ConfigError(f"{path}: no rows")
    return prompts, completions


def analyse(prompts: list[int], completions: list[int], block_size: int, bytes_per_token: int,
            current_max_model_len: int, concurrency: int) -> dict[str, Any]:
    """Percentiles, the recommended --max-model-len (p99 of prompt + completion
    tokens when every row has completions, else of prompt tokens, plus 20%,
    rounded up to the block size), and the KV memory that frees at `concurrency`."""
    pct = {f"p{p}": percentile(prompts, p) for p in (50, 95, 99)} | {"max": max(prompts)}
    have_totals = all(c >= 0 for c in completions)
    totals = [p + c for p, c in zip(prompts, completions)] if have_totals else prompts
    tot = {f"p{p}": percentile(totals, p) for p in (50, 95, 99)} | {"max": max(totals)}
    rec = blocks_for_tokens(math.ceil(tot["p99"] * 1.2), block_size) * block_size
    over = sum(1 for t in totals if t > rec)
    freed_tokens = max(0, current_max_model_len - rec) * concurrency
    return {"requests": len(prompts), "prompt_tokens": pct, "total_tokens": tot if have_totals else None,
            "recommended_max_model_len": rec, "based_on": "prompt+completion" if have_totals else "prompt",
            "requests_over_recommendation": over, "current_max_model_len": current_max_model_len,
            "concurrency": concurrency, "kv_bytes_freed": freed_tokens * bytes_per_token}


def render(r: dict[str, Any], gib: float) -> str:
    p = r["prompt_tokens"]
    lines = [f"requests: {r['requests']}",
             f"prompt tokens: p50 {p['p50']}  p95 {p['p95']}  p99 {p['p99']}  max {p['max']}"]
    if r["total_tokens"]:
        t = r["total_tokens"]
        lines.append(f"prompt + completion: p50 {t['p50']}  p95 {t['p95']}  p99 {t['p99']}  max {t['max']}")
    lines += [f"recommended --max-model-len: {r['recommended_max_model_len']} "
              f"(p99 of {r['based_on']} tokens + 20%, rounded up to the block size; "
              f"{r['requests_over_recommendation']} of {r['requests']} requests were longer)",
              f"KV memory freed at concurrency {r['concurrency']} vs --max-model-len "
              f"{r['current_max_model_len']}: {r['kv_bytes_freed'] / gib:.2f} GiB ({r['kv_bytes_freed']:,} bytes)"]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="prompt-length percentiles and the --max-model-len they call for",
                       description="Read a request log (hotprefix serve --request-log) or any JSONL with "
                                   "prompt_tokens; report percentiles and a --max-model-len.")
    p.add_argument("file", help="JSONL file")
    p.add_argument("--model", default=None, help="model for the KV size (preset, config, folder, .gguf, hub id)")
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="auto", type=kv_dtype_or_auto,
                   help="the server's KV dtype: auto (serve's default on the CPU, float32), float16, bfloat16, fp8")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--current-max-model-len", type=int, default=None,
                   help="the --max-model-len in use now (default: the model's context length)")
    p.add_argument("--concurrency", type=int, default=1, help="requests running at once")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def kv_dtype_or_auto(name: str) -> str:
    """serve's --kv-cache-dtype names; auto is what serve picks on the CPU (float32)."""
    from hotprefix.tools.size import kv_dtype

    return "float32" if name == "auto" else kv_dtype(name)


def run(a: argparse.Namespace) -> int:
    from hotprefix.tools.size import load_shape

    _, shape = load_shape(a.model)
    prompts, completions = read_token_counts(Path(a.file))
    current = a.current_max_model_len or shape.max_position_embeddings or max(prompts)
    r = analyse(prompts, completions, a.block_size, shape.kv.bytes_per_token(a.kv_dtype), current, a.concurrency)
    print(json.dumps(r, indent=2) if a.json else render(r, 2**30))
    return 0
