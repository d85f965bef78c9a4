"""The engine's numbers, kept by the engine thread and read by /metrics and the stats line."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from hotprefix.core.stats import SchedulerStats


@dataclass(frozen=True)
class LiveStats:
    """The engine's state as of its last step or command, published by the engine
    thread (one reference swap: readers on other threads see a whole snapshot)."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0
    tiers: TierGauges | None = None  # None: no tier below the pool


@dataclass(frozen=True)
class TierGauges:
    """What the KV tiers hold now, and the disk tier's totals since start."""

    host_blocks: int
    host_capacity: int
    disk_blocks: int = 0
    disk_capacity: int = 0
    disk_written_blocks: int = 0
    disk_read_blocks: int = 0
    disk_bad_files: int = 0
    host_block_bytes: int = 0
    disk_file_bytes: int = 0


ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


@dataclass
class EngineCounters:
    """Totals since start, accumulated on the engine thread after every step (the
    counters /metrics exports; gauges are read live from the scheduler)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    evicted_blocks: int = 0
    step_errors: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0  # tokens decoded one at a time: generated tokens
    cached_tokens_by_source: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    offloaded_blocks: int = 0  # pool -> host tier
    loaded_blocks: int = 0  # host tier -> pool
    # tokens per step, as a histogram over ITERATION_BUCKETS (counts per bucket, not cumulative; the last is +Inf)
    iteration_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_BUCKETS) + 1))
    iteration_tokens: int = 0
    # speculative decoding (vLLM's spec_decode counters): drafts verified, their tokens, the tokens kept,
    # and kept tokens by draft position (None: speculation is off)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] | None = None

    def add(self, st: SchedulerStats) -> None:
        if (n := st.num_prefill_tokens + st.num_decode_tokens) > 0:
            self.iteration_counts[bisect_left(ITERATION_BUCKETS, n)] += 1
            self.iteration_tokens += n
        self.prefix_cache_queries += st.prefix_cache.queries
        self.prefix_cache_hits += st.prefix_cache.hits
        self.evicted_blocks += st.prefix_cache.evicted_blocks
        self.prefill_tokens += st.num_prefill_tokens
        self.decode_tokens += st.num_decode_tokens
        for source, n in st.tiers.hit_blocks.items():
            self.cached_tokens_by_source[source.value] += n * st.block_size
        self.offloaded_blocks += st.tiers.offloaded_blocks
        self.loaded_blocks += st.tiers.loaded_blocks
        if st.spec is not None and self.spec_accepted_per_pos is not None:
            self.spec_drafts += st.spec.num_drafts
            self.spec_draft_tokens += st.spec.num_draft_tokens
            self.spec_accepted_tokens += st.spec.num_accepted_tokens
            for pos, n in enumerate(st.spec.accepted_per_pos):
                self.spec_accepted_per_pos[pos] += n


@dataclass(frozen=True)
class PinSummary:
    """The pool's pins and cache now (LLMEngine.pin_summary, on the engine thread):
    pinned blocks, the most allowed, the pool's size, cached blocks, and the first
    block's hash of each pinned prefix."""

    pinned_blocks: int
    max_pinned_blocks: int
    num_blocks: int
    cached_blocks: int
    first_blocks: tuple[bytes, ...]
