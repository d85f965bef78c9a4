#!/usr/bin/env python3
"""A markdown table of aiperf runs: one row per artifact folder (aiperf.sh profile's LABEL-cN).

    python benchmarks/peers/aiperf_table.py docs/bench/aiperf/*-c*/

Reads each folder's profile_export_aiperf.json (aiperf's own summary; nothing recomputed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (column, aiperf metric, statistic, format)
COLUMNS = (
    ("TTFT p50", "time_to_first_token", "p50", "{:,.0f} ms"),
    ("TTFT p90", "time_to_first_token", "p90", "{:,.0f} ms"),
    ("inter-token latency, mean", "inter_token_latency", "avg", "{:.1f} ms"),
    ("request latency p50", "request_latency", "p50", "{:,.0f} ms"),
    ("output tok/s", "output_token_throughput", "avg", "{:.1f}"),
    ("requests/s", "request_throughput", "avg", "{:.2f}"),
    ("prompt tokens cached", "overall_usage_prompt_cache_read_pct", "avg", "{:.1f} %"),
)


def cell(summary: dict, metric: str, stat: str, fmt: str) -> str:
    value = (summary.get(metric) or {}).get(stat)
    return "–" if value is None else fmt.format(value)


def row(folder: Path) -> str:
    """One table row: the folder's name, the requests that ended well and in error, the columns."""
    s = json.loads((folder / "profile_export_aiperf.json").read_text())
    ok = cell(s, "request_count", "avg", "{:.0f}")
    errors = cell(s, "error_request_count", "avg", "{:.0f}")
    errors = "0" if errors == "–" else errors
    cells = [cell(s, metric, stat, fmt) for _, metric, stat, fmt in COLUMNS]
    return f"| {folder.name} | {ok} ({errors}) | " + " | ".join(cells) + " |"


def main(folders: list[str]) -> None:
    print("| run | requests (errors) | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for f in folders:
        print(row(Path(f)))


if __name__ == "__main__":
    main(sys.argv[1:])
