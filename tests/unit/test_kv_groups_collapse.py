"""The collapse case of issue 41 through the engine's Scheduler and KVCacheManager without
a model (benchmarks/kv_groups.py, whose figures docs/benchmarks.md gives): 16 chat sessions
sharing a 2,000-token system prompt, 6 turns each, interleaved, into a pool of 40 % of the
working set. The Gemma 3 4B layout's hit rate (a grouped pool of the same bytes) is within
5 points of a full-attention model's; integrity is checked after every step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hotprefix.sizing import KVGroupLayout


def _bench():
    path = Path(__file__).parents[2] / "benchmarks" / "kv_groups.py"
    spec = importlib.util.spec_from_file_location("kv_groups_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_window_model_hit_rate_within_5_points_of_the_full_model():
    bench = _bench()
    w = bench.Workload()
    blocks = int(0.4 * w.working_set_tokens / bench.BS)
    layout = KVGroupLayout.of(bench.GEMMA3_4B)
    assert len(layout.windows) == 7 and layout.page_layers == 5
    pages = blocks * 34 // 5 - 1
    full = bench.sessions((None,), blocks, w)
    window = bench.sessions(layout.windows, pages, w)
    assert full > 0.5  # the shared prompt and each session's history are hit
    assert abs(full - window) <= 0.05, (full, window)


def test_32k_sequence_holds_under_30_percent_of_the_all_full_layout():
    last, most, full = _bench().bytes_per_sequence()
    # full group 2,048 blocks + 6 window groups x 65 (the window of 1,024 tokens and the block the next
    # token fills), pages of 5 layers, against 34 layers x 32,768 tokens
    assert last == (2048 + 6 * 65) * 2 * 5 * 4 * 256 * 2 * 16
    assert last / full <= 0.30 and most / full <= 0.30
