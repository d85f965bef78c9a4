"""The text of a hit-rate curve (hotprefix/cachecurve: its JSON), as lint --curve and size
--from-log print it: the answer first, then per tenant, then how far the numbers hold."""

from __future__ import annotations

from typing import Any

from hotprefix.cachecurve.advice import CLIFF_STEP, TARGET, flag_gib, human


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _size(s: dict[str, Any]) -> str:
    if not s["flag"]:
        return f"{s['blocks']:,} blocks"
    return f"`--kv-cache-memory {s['flag']}` ({s['blocks']:,} blocks, `--num-gpu-blocks-override {s['blocks']}`)"


def render(c: dict[str, Any], how: str = "") -> str:
    """The text of a curve's JSON (to_json): the answer first, then per tenant, then how
    far the numbers hold."""
    a = c["advice"]
    span = f" over {c['duration_s'] / 60:.1f} min" if c["duration_s"] else ""
    plural = "" if c["requests"] == 1 else "s"
    lines = [f"hit-rate curve of {c['requests']:,} request{plural} ({c['prompt_tokens']:,} prompt tokens{span}), "
             f"block size {c['block_size']}" + (f", {human(c['bytes_per_block'])} a block{how}"
                                                  if c["bytes_per_block"] else "")]
    if not a["unbounded"]:
        lines.append("no prompt shares a full block with an earlier one: no pool size caches anything on this traffic")
        return "\n".join(lines)
    lines.append(f"an unbounded cache: {_pct(a['unbounded'])}")
    if a["recommended"]:
        lines.append(f"{_size(a['recommended'])} reaches {100 * TARGET:.0f} % of it: {_pct(a['recommended_rate'])}")
    if a["cliff"]:
        lines.append(f"below {_size(a['cliff'])} the rate falls off a cliff: {_pct(a['cliff_rate'])} at "
                     f"{100 * CLIFF_STEP:.0f} % of that pool")
    if a["pool"]:
        lines.append(f"the server's pool, {a['pool']['blocks']:,} blocks: {_pct(a['pool_rate'])}")
    if a["host"] and a["host_gain"] is not None:
        where = "the server's pool" if a["pool"] else "the recommended pool"
        h = a["host"]
        tier = f"`--kv-offloading-size {flag_gib(h['bytes'])}`" if h["bytes"] else f"{h['blocks']:,}-block"
        lines.append(f"a {tier} host tier ({h['blocks']:,} blocks) adds {100 * a['host_gain']:.1f} points at {where}")
    at = a["pool"] or a["recommended"]
    if c["duration_s"] and at:
        saved = next((p["tokens_saved_per_s"] for p in c["points"] if p["blocks"] == at["blocks"] and
                      not p["host_blocks"]), None)
        if saved is not None:
            lines.append(f"prefill tokens saved: {saved:,.0f}/s at {at['blocks']:,} blocks")
    return "\n".join(lines + _tenant_lines(a["tenants"]) + _model_lines(c))


def _tenant_lines(tenants: list[dict[str, Any]]) -> list[str]:
    if len(tenants) < 2:
        return []
    out = ["per tenant (cache salt digest), most prompt tokens first:"]
    for t in tenants:
        need = f"{t['pool_for_95']:,} blocks" if t["pool_for_95"] else "-"
        out.append(f"  {t['salt'] or '(no salt)':<18} {t['requests']:>7,} requests, unbounded "
                   f"{_pct(t['hit_rate_unbounded'])}, {100 * TARGET:.0f} % of it from {need}"
                   + (f", at the server's pool {_pct(t['hit_rate_at_pool'])}" if t["hit_rate_at_pool"] is not None
                      else ""))
    return out


def _model_lines(c: dict[str, Any]) -> list[str]:
    out = [f"model: one pass, exact for pools of {c['exact_from_blocks']:,} blocks or more (smaller ones refuse the "
           "largest request)" + ("" if not c["moved_blocks"] else
                                 f", except {c['moved_blocks']:,} blocks recomputed past the cap while still cached "
                                 "(an identical prompt sent again: the engine keeps the old copy where it was)")]
    if c["checks"]:
        sizes = ", ".join(f"{k['blocks']:,}" for k in c["checks"])
        out.append(f"checked against replays of the engine's policy at {sizes} blocks "
                   f"({c['checks'][0]['requests']:,} requests): within {c['check_error_points']:.2f} points")
    if c["sample_rate"] < 1:
        out.append(f"sampled: {100 * c['sample_rate']:.2g} % of the blocks by hash, error "
                   f"±{c['sample_error_points']:.2f} points (95 %)")
    return out
