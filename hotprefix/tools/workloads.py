"""The shared-prefix workloads of `hotprefix bench` (docs/benchmarks.md), built
deterministically from a seed: the requests only, without the HTTP client, so that offline
drivers (benchmarks/gpu_path.py on a GPU host that has torch but not the server's
packages, the transformers baseline) send the same prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hotprefix.config import ConfigError

WORKLOADS = ("ttft", "tenants", "rag", "chat", "unique", "decode", "shared")
_WORDS = ("time people year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact be have do say get make go know take see come think look "
          "want give use find tell ask seem feel try leave call good new first last long great little own other "
          "old right big high different small large next early young important few public bad same able cache "
          "block prefix token model server request memory compute answer question system prompt document share "
          "tenant latency through before after under between against during without within along following "
          "across behind beyond plus except but up out around down off above near data table index query plan "
          "store value key page layer head batch queue store chain hash policy limit rate usage budget").split()


@dataclass
class Job:
    """One request: its prompt, for chat the conversation and turn it belongs to, its
    own output length where the workload sets one (else --max-tokens), and whether it
    only warms the server (sent first, alone, and not measured)."""

    prompt: str
    conversation: int | None = None
    turn: int = 0
    max_tokens: int | None = None
    warmup: bool = False


def words(rng: random.Random, n: int) -> str:
    """n words (at least one) drawn from the workloads' vocabulary."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def build(workload: str, seed: int = 0, scale: float = 1.0) -> tuple[list[Job], int, int]:
    """(jobs, concurrency, turns per conversation or 0). Lengths are in words
    (about one token each for SmolLM2); scale shrinks counts and lengths."""
    rng = random.Random(seed)

    def s(n: int) -> int:
        return max(1, round(n * scale))

    if workload == "ttft":
        prefix = words(rng, s(1000))
        return [Job(f"{prefix}\nQuestion {i}: {words(rng, s(30))}?") for i in range(1 + s(5))], 1, 0
    if workload == "tenants":
        systems = [f"Tenant {t} policy. " + words(rng, rng.randint(s(400), s(600))) for t in range(s(20))]
        jobs = [Job(f"{rng.choice(systems)}\nUser: {words(rng, rng.randint(s(20), s(40)))}?") for _ in range(s(200))]
        return jobs, 8, 0
    if workload == "rag":
        doc = "Document: " + words(rng, s(2000))
        return [Job(f"{doc}\nQuestion {i}: {words(rng, s(20))}?") for i in range(s(32))], 4, 0
    if workload == "chat":
        return [Job(f"User: {words(rng, s(40))}", conversation=c) for c in range(s(8))], 8, 6
    if workload == "unique":
        return [Job(f"Item {i} {rng.random():.6f}: " + words(rng, s(300))) for i in range(s(64))], 8, 0
    if workload == "decode":  # one stream at a time, long outputs: the per-stream decode rate
        return [Job(f"Story {i}: {words(rng, 30)}", max_tokens=128) for i in range(3)], 1, 0
    if workload == "shared":  # 8 concurrent requests on a prefix that one request before them made warm
        prefix = words(rng, s(1000))
        jobs = [Job(f"{prefix}\nQuestion {i}: {words(rng, s(30))}?", warmup=i == 0) for i in range(9)]
        return jobs, 8, 0
    raise ConfigError(f"unknown workload {workload!r} (one of {', '.join(WORKLOADS)})")
