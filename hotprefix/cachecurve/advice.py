"""What a hit-rate curve (curve.py) tells an operator, in serve's flags.

`advise` reads the curve: the pool that reaches 95 % of what an unbounded cache would
give (as `--kv-cache-memory` and `--num-gpu-blocks-override`), the steepest fall below
it (a cliff), what the host tier adds, and the same per tenant. `to_json` is the curve's
one form outside the process: the points, the advice, how far the numbers hold (lint
prints it, `--plot` and the dashboard draw it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hotprefix.cachecurve.curve import Curve
from hotprefix.config import parse_size

TARGET = 0.95  # of the unbounded cache's hit rate
CLIFF_STEP = 0.8  # a cliff: the rate falls by CLIFF_POINTS when the pool shrinks by this factor
CLIFF_POINTS = 0.10


def flag_bytes(n: int) -> str:
    """The least size serve's size flags read as at least n bytes, rounded up to a tenth
    of a GiB (from 1 GiB) or a MiB."""
    if n >= 1 << 30:
        return f"{math.ceil(n * 10 / (1 << 30)) / 10:g}GiB"
    if n >= 1 << 20:
        return f"{math.ceil(n / (1 << 20))}MiB"
    return str(n)


def flag_gib(n: int) -> str:
    """`--kv-offloading-size` (GiB, or text with a unit) for at least n bytes."""
    text = flag_bytes(n)
    return text[:-3] if text.endswith("GiB") else text


def human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass(frozen=True)
class Size:
    """A pool size: blocks, bytes (None without the bytes of a block), the flag that gives it."""

    blocks: int
    bytes: int | None
    flag: str | None

    @classmethod
    def of(cls, blocks: int, per_block: int | None) -> Size:
        if per_block is None:
            return cls(blocks, None, None)
        text = flag_bytes(blocks * per_block)
        return cls(parse_size(text) // per_block, parse_size(text), text)


@dataclass(frozen=True)
class Advice:
    """The curve's answer. `recommended`: the least pool reaching TARGET of the unbounded
    rate (rounded up to its flag); `cliff`: the pool below which the rate falls by
    CLIFF_POINTS or more within one CLIFF_STEP (None: no such fall); `pool`: the
    server's (None when unknown); `host_gain`: points the host tier adds at `pool`, or at
    the recommendation."""

    unbounded: float
    recommended: Size | None
    recommended_rate: float
    cliff: Size | None
    cliff_rate: float | None
    pool: Size | None
    pool_rate: float | None
    host: Size | None
    host_gain: float | None
    tenants: tuple[dict[str, Any], ...]


def advise(curve: Curve, per_block: int | None, pool: int | None) -> Advice:
    p95 = curve.pool_for(TARGET)
    rec = Size.of(p95, per_block) if p95 else None
    cliff, cliff_rate = _cliff(curve, p95)
    host = _exact(curve.host_blocks, per_block) if curve.host_blocks else None
    at = pool or (rec.blocks if rec else None)
    gain = None
    if host and at is not None and curve.host_rate(at) is not None:
        gain = (curve.host_rate(at) or 0.0) - curve.rate(at)
    return Advice(curve.unbounded, rec, curve.rate(rec.blocks) if rec else 0.0,
                  Size.of(cliff, per_block) if cliff else None, cliff_rate,
                  _exact(pool, per_block) if pool else None, curve.rate(pool) if pool else None, host, gain,
                  _tenants(curve, pool))


def _exact(blocks: int, per_block: int | None) -> Size:
    return Size(blocks, blocks * per_block if per_block else None, None)


def _cliff(curve: Curve, top: int | None) -> tuple[int | None, float | None]:
    """The pool (between the largest request and `top`) below which the rate falls the most
    within one CLIFF_STEP, when that fall is at least CLIFF_POINTS."""
    if not top:
        return None, None
    best, size = (0.0, None, None), top
    while size * CLIFF_STEP >= max(curve.largest, 1):
        below = int(size * CLIFF_STEP)
        drop = curve.rate(size) - curve.rate(below)
        if drop > best[0]:
            best = (drop, size, curve.rate(below))
        size = below
    return (best[1], best[2]) if best[0] >= CLIFF_POINTS else (None, None)


def _tenants(curve: Curve, pool: int | None) -> tuple[dict[str, Any], ...]:
    rows = []
    for t in curve.tenants:
        tokens = max(t.prompt_tokens, 1) / curve.block_size
        rows.append({"salt": t.salt, "requests": t.requests, "prompt_tokens": t.prompt_tokens,
                     "hit_rate_unbounded": t.hits.total / tokens,
                     "hit_rate_at_pool": float(t.hits.at(pool)) / tokens if pool else None,
                     "pool_for_95": curve.pool_for(TARGET, t.hits)})
    return tuple(rows)


def points(curve: Curve, per_block: int | None, extra: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """The curve's points: pool blocks and bytes, host-tier blocks (0: none), hit rate,
    prompt tokens saved, and per second over the log's span."""
    out = []
    rows = [(s, 0, curve.rate(s)) for s in curve.grid(extra=extra)]
    rows += [(s, curve.host_blocks, r) for s, r in curve.host_points]
    for blocks, host, rate in rows:
        saved = rate * curve.prompt_tokens
        out.append({"blocks": blocks, "bytes": blocks * per_block if per_block else None, "host_blocks": host,
                    "host_bytes": host * per_block if per_block and host else (0 if not host else None),
                    "hit_rate": rate, "tokens_saved": round(saved),
                    "tokens_saved_per_s": saved / curve.duration_s if curve.duration_s else None})
    return out


def to_json(curve: Curve, advice: Advice, per_block: int | None) -> dict[str, Any]:
    extra = tuple(s.blocks for s in (advice.recommended, advice.cliff, advice.pool) if s)
    return {
        "requests": curve.requests, "prompt_tokens": curve.prompt_tokens, "block_size": curve.block_size,
        "bytes_per_block": per_block, "duration_s": curve.duration_s,
        "hit_rate_unbounded": curve.unbounded, "exact_from_blocks": curve.largest, "moved_blocks": curve.moved,
        "checks": [asdict(c) for c in curve.checks], "check_error_points": curve.check_error,
        "sample_rate": curve.sample_rate, "sample_error_points": curve.sample_error,
        "advice": asdict(advice), "points": points(curve, per_block, extra),
    }
