"""`hotprefix lint --curve --plot FILE`: the hit-rate curve as one SVG file, no plotting library.

Drawn from the curve's JSON (tools/curve_report.to_json): hit rate (token-weighted) over
the pool's size, the host tier's points when there is one, the unbounded cache's rate
dashed, and the recommended pool and the server's pool marked. The dashboard draws the
same picture in its page (server/static/dashboard.html).
"""

from __future__ import annotations

from typing import Any
from xml.sax.saxutils import escape

from hotprefix.cachecurve.advice import human

W, H = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 56, 56
COLORS = {"device": "#1d4ed8", "host": "#d97706", "unbounded": "#667085", "pool": "#b42318", "recommended": "#059669"}


def _x(blocks: float, top: float) -> float:
    return LEFT + (W - LEFT - RIGHT) * blocks / top


def _y(rate: float) -> float:
    return TOP + (H - TOP - BOTTOM) * (1 - rate)


def _ticks(top: float, n: int = 5) -> list[float]:
    step = 10 ** len(str(int(max(top / n, 1)))) / 10
    for mult in (1, 2, 2.5, 5, 10):
        if top / (step * mult) <= n:
            step *= mult
            break
    return [i * step for i in range(int(top / step) + 1)]


def _line(x1: float, y1: float, x2: float, y2: float, color: str, dash: str = "", cls: str = "") -> str:
    extra = (f' stroke-dasharray="{dash}"' if dash else "") + (f' class="{cls}"' if cls else "")
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" stroke-width="1.5"{extra}/>'


def _text(x: float, y: float, text: str, anchor: str = "middle", color: str = "#1d2330") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{color}">{escape(text)}</text>'


def svg(c: dict[str, Any]) -> str:
    """The picture of a curve's JSON."""
    device = [(p["blocks"], p["hit_rate"]) for p in c["points"] if not p["host_blocks"]]
    host = [(p["blocks"], p["hit_rate"]) for p in c["points"] if p["host_blocks"]]
    a = c["advice"]
    marks = [(k, a[k]["blocks"]) for k in ("pool", "recommended") if a[k]]
    top = max([b for b, _ in device + host] + [b for _, b in marks] + [1]) * 1.02
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="system-ui, sans-serif" font-size="12">', f'<rect width="{W}" height="{H}" fill="#fff"/>',
           _text(W / 2, 20, f"prefix-cache hit rate by KV pool size ({c['requests']:,} requests, "
                            f"block size {c['block_size']})")]
    for r in (0, 0.25, 0.5, 0.75, 1):
        out += [_line(LEFT, _y(r), W - RIGHT, _y(r), "#e4e7ec"), _text(LEFT - 6, _y(r) + 4, f"{100 * r:.0f} %", "end")]
    for t in _ticks(top):
        label = f"{t:,.0f}" + (f" ({human(t * c['bytes_per_block'])})" if c["bytes_per_block"] and t else "")
        out += [_line(_x(t, top), H - BOTTOM, _x(t, top), H - BOTTOM + 4, "#667085"),
                _text(_x(t, top), H - BOTTOM + 16, label)]
    out.append(_text((LEFT + W - RIGHT) / 2, H - 14, "pool size (blocks)"))
    out.append(_line(LEFT, _y(a["unbounded"]), W - RIGHT, _y(a["unbounded"]), COLORS["unbounded"], "6 4",
                     "unbounded"))
    for name, pts in (("device", device), ("host", host)):
        if pts:
            path = " ".join(f"{_x(b, top):.1f},{_y(r):.1f}" for b, r in sorted(pts))
            out.append(f'<polyline class="{name}" points="{path}" fill="none" stroke="{COLORS[name]}" '
                       'stroke-width="2"/>')
    for name, blocks in marks:
        out.append(_line(_x(blocks, top), TOP, _x(blocks, top), H - BOTTOM, COLORS[name], "4 3", name))
        out.append(_text(_x(blocks, top) + 4, H - BOTTOM - 8 - 14 * (name == "recommended"),
                         "server's pool" if name == "pool" else "95 % of unbounded", "start", COLORS[name]))
    legend = [("device", "device pool"), ("unbounded", "unbounded cache")]
    legend += [("host", f"+ host tier ({c['points'][-1]['host_blocks']:,} blocks)")] if host else []
    for i, (name, label) in enumerate(legend):
        x = LEFT + 8 + 170 * i
        out += [_line(x, TOP - 18, x + 18, TOP - 18, COLORS[name]), _text(x + 22, TOP - 14, label, "start")]
    return "\n".join(out + ["</svg>"]) + "\n"
