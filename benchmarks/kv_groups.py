"""A grouped KV pool (core/kv_groups.py) through the engine's own Scheduler and
KVCacheManager, without a model (issue 41):

- `bytes_per_sequence`: the KV bytes a running 32,768-token sequence holds on the Gemma 3
  4B shape (34 layers, 5 global, window 1024, 4 KV heads of 256, bf16, blocks of 16),
  counted from the blocks the manager holds after each step, against the all-full layout.
- `sessions`: the collapse case. 16 chat sessions share a 2,000-token system prompt and
  take 6 turns each, interleaved (every session's turn t before any turn t + 1, four
  running at once, answers decoded a token a step); each turn's prompt is the whole
  conversation so far. The prompt-token hit rate of the window model (the 4B's layers)
  against a full-attention model of the same shape with a pool of the same bytes: a
  share of the full model's working set in blocks of 34 layers, the window model's the
  same bytes in pages of 5 layers (as `plan_kv_pool` sizes them; every group's every
  block of the conversations would take about as many bytes as the full model's working
  set: 7 groups of 5 layers).

    .venv/bin/python benchmarks/kv_groups.py
"""

from __future__ import annotations

from dataclasses import dataclass

from hotprefix.config import SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.kv_groups import Retention
from hotprefix.core.outputs import ModelRunnerOutput
from hotprefix.core.request import Request
from hotprefix.core.scheduler import Scheduler
from hotprefix.sampling_params import SamplingParams
from hotprefix.sizing import KVGroupLayout, KVShape

BS = 16
GEMMA3_4B = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))  # layer windows
SHAPE_4B = KVShape(34, 4, 256)


@dataclass(frozen=True)
class Workload:
    """The collapse case's shape."""

    sessions: int = 16
    turns: int = 6
    system_tokens: int = 2000
    user_tokens: int = 150
    answer_tokens: int = 50
    max_running: int = 4

    @property
    def working_set_tokens(self) -> int:
        """Distinct tokens of every conversation at its end."""
        return self.system_tokens + self.sessions * self.turns * (self.user_tokens + self.answer_tokens)


class LruOnly(Retention):
    """The rule turned off: every released window block keeps its place in line (vLLM's order)."""

    def keeps(self, block: int, window: int, boundaries) -> bool:
        return True


def _step(sched: Scheduler, answer: dict[str, list[int]]) -> int:
    """One step; the blocks held while it ran."""
    out = sched.schedule()
    if not out.requests:
        raise RuntimeError("nothing could be scheduled: the pool is too small for one request")
    held = sched.kv.num_blocks - sched.kv.pool.num_free_blocks
    sampled = {}
    for sr in out.requests:
        if sr.sample:
            req = sched.requests[sr.request_id]
            sampled[sr.request_id] = answer[sr.request_id][len(req.output_token_ids)]
    sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    sched.check_integrity()
    return held


def sessions(group_windows: tuple[int | None, ...], num_blocks: int, w: Workload = Workload(),
             retain_every: int = 4096, rule: bool = True) -> float:
    """The prompt-token hit rate of the collapse case on a pool of num_blocks blocks (rule:
    the retention rule on; off, every released window block is reused in LRU order)."""
    kv = KVCacheManager(num_blocks, BS, group_windows=group_windows, retain_every=retain_every)
    if not rule and kv.windows is not None:
        kv.windows.retention = LruOnly(BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=w.max_running, max_num_batched_tokens=8192), kv)
    system = list(range(1, w.system_tokens + 1))
    history = {s: list(system) for s in range(w.sessions)}
    hits = queries = 0
    for t in range(w.turns):
        answer: dict[str, list[int]] = {}
        reqs = []
        for s in range(w.sessions):
            base = 1_000_000 * (s + 1) + 10_000 * t
            prompt = history[s] + list(range(base, base + w.user_tokens))
            rid = f"s{s}t{t}"
            answer[rid] = list(range(base + 5000, base + 5000 + w.answer_tokens))
            req = Request(rid, prompt, SamplingParams(max_tokens=w.answer_tokens, ignore_eos=True))
            sched.add_request(req)
            reqs.append(req)
            history[s] = prompt + answer[rid]
        while sched.has_unfinished():
            _step(sched, answer)
        hits += sum(r.num_cached_tokens for r in reqs)
        queries += sum(r.num_prompt_tokens for r in reqs)
    return hits / queries


def bytes_per_sequence(num_tokens: int = 32768, retain_every: int = 4096) -> tuple[int, int, int]:
    """(KV bytes a running num_tokens sequence holds on the grouped 4B pool after its last
    step, at its largest step, and the all-full layout's): a prompt of num_tokens - 64 in
    chunks of 2,048, then 64 tokens decoded, counting the blocks held after every step."""
    layout = KVGroupLayout.of(GEMMA3_4B)
    kv = KVCacheManager(8192, BS, group_windows=layout.windows, retain_every=retain_every)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048), kv)
    answer = {"a": list(range(900_000, 900_064))}
    sched.add_request(Request("a", list(range(1, num_tokens - 63)), SamplingParams(max_tokens=64, ignore_eos=True)))
    most = last = 0
    while sched.has_unfinished():
        last = kv.num_blocks - kv.pool.num_free_blocks  # between steps (before the step that ends it)
        most = max(most, _step(sched, answer))
    page = layout.page_bytes(SHAPE_4B, "bf16", BS)
    return last * page, most * page, SHAPE_4B.bytes_per_token("bf16") * num_tokens


def main() -> None:
    last, most, full = bytes_per_sequence()
    print(f"4B shape, 32,768 tokens, bf16: all-full {full / 2**20:.0f} MiB; grouped {last / 2**20:.0f} MiB "
          f"({last / full:.1%}) held between steps at the end, {most / 2**20:.0f} MiB ({most / full:.1%}) at "
          "most during a step (a 2,048-token prefill chunk)")
    w = Workload()
    windows = KVGroupLayout.of(GEMMA3_4B).windows
    page_layers = KVGroupLayout.of(GEMMA3_4B).page_layers
    for share in (0.25, 0.4, 0.5):
        blocks = int(share * w.working_set_tokens / BS)
        pages = blocks * SHAPE_4B.num_layers // page_layers - 1  # the same bytes (less the null block)
        full_rate = sessions((None,), blocks, w)
        window_rate = sessions(windows, pages, w)
        lru_rate = sessions(windows, pages, w, rule=False)
        print(f"pool {share:.0%} of the working set ({blocks} blocks of 34 layers, {pages} pages of {page_layers}): "
              f"full {full_rate:.1%}, window {window_rate:.1%} (without the retention rule {lru_rate:.1%}), "
              f"difference {100 * (full_rate - window_rate):+.1f} points")


if __name__ == "__main__":
    main()
