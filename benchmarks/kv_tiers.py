"""What the KV tiers below the pool buy and cost, in process on the default model.

    .venv/bin/python benchmarks/kv_tiers.py working-set [PROMPTS] [POOL_PROMPTS]
        PROMPTS distinct 256-token tenant prompts (default 60) in a pool that holds
        POOL_PROMPTS of them (default 10): pass 1 computes each once, pass 2 asks each
        again (+ a question); hit rate, prompt tokens/s and mean TTFT of pass 2, with no
        tier, a host tier that holds them all, and a disk tier behind a 32 MiB host tier.
    .venv/bin/python benchmarks/kv_tiers.py restart
        TTFT of a 1,030-token prompt on a fresh engine: cold vs found on disk (the files
        written by an earlier engine; the OS page cache is warm, as after a restart).
    .venv/bin/python benchmarks/kv_tiers.py unique [REPS]
        16 unique 300-token prompts x 32 tokens in a pool that must evict all the time:
        tokens/s with no tier, host tier, host + disk (writing every block, or only
        blocks hit again); alternating runs, medians.

Prints JSON lines. float32 activations (the KV is the same either way; the numbers
are the tiers', not the matmul's).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
import warnings

from hotprefix.config import CacheConfig, EngineConfig, ModelConfig
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.model.loader import load_model
from hotprefix.sampling_params import SamplingParams

warnings.filterwarnings("ignore")
LOADED = load_model(None)
RNG = random.Random(0)


def toks(n: int) -> list[int]:
    return [RNG.randrange(100, 49000) for _ in range(n)]


def engine(**cache) -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig(quantized_matmul="float32"), CacheConfig(**cache)), loaded=LOADED)


def run(e: LLMEngine, prompts: list[list[int]], max_tokens: int = 1, batch: int = 1) -> dict[str, float]:
    """Run prompts `batch` at a time; prompt tokens/s, hit rate and mean TTFT."""
    t0, ttfts, cached, total = time.perf_counter(), [], 0, 0
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        for j, p in enumerate(prompts[i:i + batch]):
            e.add_request(f"r{time.monotonic_ns()}-{j}", p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          ignore_eos=True))
        seen = set()
        while e.has_unfinished_requests():
            for out in e.step():
                if out.request_id not in seen:
                    seen.add(out.request_id)
                    ttfts.append(time.perf_counter() - start)
                if out.finished:
                    cached += out.num_cached_tokens
                    total += len(out.prompt_token_ids)
    wall = time.perf_counter() - t0
    return {"prompt_tok_s": round(total / wall, 1), "hit_rate": round(cached / total, 3),
            "mean_ttft_s": round(statistics.mean(ttfts), 4), "wall_s": round(wall, 2)}


def working_set(n_prompts: int = 60, pool_prompts: int = 10) -> None:
    prompts = [toks(256) for _ in range(n_prompts)]
    blocks = pool_prompts * 16 + 8
    modes = {"no tier": {}, "host tier (1 GiB)": {"kv_offloading_size": 1 << 30},
             "disk tier (32 MiB host)": {"kv_offloading_size": 32 << 20, "kv_disk_dir": tempfile.mkdtemp()}}
    for name, extra in modes.items():
        e = engine(num_blocks_override=blocks, **extra)
        run(e, [p + [5] for p in prompts])  # pass 1: every prompt computed once
        if e.disk is not None:
            e.disk.flush()
        res = run(e, [p + toks(8) for p in prompts])
        print(json.dumps({"bench": "working-set", "mode": name, "prompts": n_prompts,
                          "pool_prompts": pool_prompts, **res}))
        e.close()


def restart() -> None:
    prompt = toks(1030)
    d = tempfile.mkdtemp()
    first = engine(kv_disk_dir=d)
    cold = run(first, [prompt])
    first.close()
    for name, extra in (("cold (no disk tier)", {}), ("disk-warm", {"kv_disk_dir": d})):
        e = engine(**extra)
        res = run(e, [prompt])
        print(json.dumps({"bench": "restart", "mode": name, "ttft_s": res["mean_ttft_s"],
                          "hit_rate": res["hit_rate"], "first_engine_cold_ttft_s": cold["mean_ttft_s"]}))
        e.close()


SPENT: dict[str, float] = {}


def timed(cls: type, name: str) -> None:
    """Wrap cls.name to add its wall time to SPENT[cls.__name__ + '.' + name]."""
    fn = getattr(cls, name)
    key = f"{cls.__name__}.{name}"

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT[key] = SPENT.get(key, 0.0) + time.perf_counter() - t
    setattr(cls, name, wrapper)


def unique(reps: int = 3) -> None:
    from hotprefix.engine.kv_disk import DiskStore
    from hotprefix.model.kv_offload import HostArena

    for cls, name in ((HostArena, "save"), (HostArena, "gather"), (HostArena, "restore"), (DiskStore, "_write")):
        timed(cls, name)
    modes = {"no tier": {}, "host tier": {"kv_offloading_size": 1 << 30},
             "host + disk": {"kv_offloading_size": 1 << 30, "kv_disk_dir": tempfile.mkdtemp()},
             "host + disk, --kv-disk-write reused": {"kv_offloading_size": 1 << 30, "kv_disk_dir": tempfile.mkdtemp(),
                                                     "kv_disk_write": "reused"}}
    engines = {name: engine(num_blocks_override=200, **extra) for name, extra in modes.items()}
    res: dict[str, list[float]] = {name: [] for name in modes}
    spent: dict[str, dict[str, float]] = {name: {} for name in modes}
    for rep in range(reps + 1):
        for name, e in engines.items():
            SPENT.clear()
            r = run(e, [toks(300) for _ in range(16)], max_tokens=32, batch=16)
            if e.disk is not None:
                e.disk.flush()
            if rep:  # the first round warms each engine up
                res[name].append(r["wall_s"])
                for k, v in SPENT.items():
                    spent[name][k] = spent[name].get(k, 0.0) + v
    base = statistics.median(res["no tier"])
    for name, walls in res.items():
        med = statistics.median(walls)
        total = sum(walls)
        print(json.dumps({"bench": "unique", "mode": name, "median_wall_s": round(med, 3),
                          "runs": walls, "wall_diff_pct": round(100 * (med / base - 1), 1),
                          "copy_time_pct_of_wall": {k: round(100 * v / total, 2) for k, v in spent[name].items()},
                          "offloaded_blocks": engines[name].scheduler.make_stats().tiers.offloaded_blocks}))
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    kind, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    {"working-set": working_set, "restart": restart, "unique": unique}[kind](*args)
