"""The engine's numbers, kept by the engine thread and read by /metrics and the stats line."""

from __future__ import annotations

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

    def add(self, st: SchedulerStats) -> None:
        self.prefix_cache_queries += st.prefix_cache.queries
        self.prefix_cache_hits += st.prefix_cache.hits
        self.evicted_blocks += st.prefix_cache.evicted_blocks
        self.prefill_tokens += st.num_prefill_tokens
        self.decode_tokens += st.num_decode_tokens
        for source, n in st.tiers.hit_blocks.items():
            self.cached_tokens_by_source[source.value] += n * st.block_size
        self.offloaded_blocks += st.tiers.offloaded_blocks
        self.loaded_blocks += st.tiers.loaded_blocks
