"""`hotprefix lint --url SERVER`: a live server's prefix groups (GET /prefix_groups)."""

from __future__ import annotations

import json
from typing import Any

from hotprefix.config import ConfigError


def fetch(url: str, api_key: str | None, top: int = 50, path: str = "/prefix_groups") -> dict[str, Any]:
    """The server's /prefix_groups (or another of its JSON pages). Raises ConfigError when
    it cannot be read."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + path, params={"top": top}, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text[:200]
        raise ConfigError(f"{url}{path} answered {r.status_code}: {msg}")
    return r.json()


def render_live(snap: dict[str, Any]) -> str:
    lines = [f"{snap['requests']} requests seen, block size {snap['block_size']}; prefix groups (requests sharing "
             "a first block), most prompt tokens first:"]
    for g in snap["groups"]:
        lost = g["possible_hit_rate"] - g["hit_rate"]
        brk = ", ".join(f"token {b['token']} ({b['requests']})" for b in g["breaks"][:3]) or "none"
        lines.append(f"  {g['group']:<18} {g['requests']:>6} requests, hit rate {100 * g['hit_rate']:5.1f} % "
                     f"(possible {100 * g['possible_hit_rate']:5.1f} %"
                     + (f", {100 * lost:.1f} points lost to eviction" if lost > 0.0005 else "") + f"); breaks at {brk}")
    if not snap["groups"]:
        lines.append("  (none yet)")
    lines.append("A break is where a request stopped matching every earlier one: volatile content there "
                 "(a timestamp, an id) splits the group; run `hotprefix lint` on a --request-log-prompts log "
                 "to name it.")
    return "\n".join(lines)


def run_live(url: str, api_key: str | None, as_json: bool) -> int:
    snap = fetch(url, api_key)
    print(json.dumps(snap, indent=2) if as_json else render_live(snap))
    return 0
