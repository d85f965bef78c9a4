"""Per-step statistics, recorded by the core as plain dataclasses (no metrics library here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.core.kv_cache_manager import PrefixCacheStats
from hotprefix.core.kv_tiers import TierStats
from hotprefix.core.speculation import SpecStats


@dataclass
class SchedulerStats:
    """The state after one step, and what that step did.

    num_preemptions and the token counts are for this step alone;
    num_preemptions_total is since start.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0
    num_preemptions_total: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    kv_cache_usage: float = 0.0
    swap_usage: float = 0.0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    tiers: TierStats = field(default_factory=TierStats)  # hits by source (device included), tier copies
    block_size: int = 16
    spec: SpecStats | None = None  # speculative decoding's counters since the last read (None: off)
