"""`hotprefix lint --url SERVER`: a live server's prefix groups (GET /prefix_groups).

The answer is read with at most MAX_ANSWER_BYTES held, checked against the shape the
server sends (server/prefix_log.PrefixGroups.snapshot) before anything is printed, and
every string printed from it is escaped (a server's control characters never reach
the terminal raw); what is wrong with an answer is one line (ConfigError)."""

from __future__ import annotations

import json
from typing import Any

from hotprefix.config import ConfigError
from hotprefix.server.log_lines import escape_controls
from hotprefix.tools.jsonl import json_text

MAX_ANSWER_BYTES = 32 << 20
MAX_SHOWN = 200  # characters of a server's error message shown


def _read_capped(url: str, headers: dict[str, str], top: int, path: str) -> tuple[int, bytes]:
    """(status, body) of GET url + path. Raises ConfigError when it cannot be read or is
    larger than MAX_ANSWER_BYTES."""
    import httpx

    target = url.rstrip("/") + path
    try:
        with httpx.stream("GET", target, params={"top": top}, headers=headers, timeout=30) as r:
            body = bytearray()
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise ConfigError(f"{escape_controls(target)} answered more than {MAX_ANSWER_BYTES} bytes")
            return r.status_code, bytes(body)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
        raise ConfigError(f"cannot reach {escape_controls(url)}: {type(e).__name__}: "
                          f"{escape_controls(str(e))[:MAX_SHOWN]}") from None


def fetch(url: str, api_key: str | None, top: int = 50, path: str = "/prefix_groups") -> dict[str, Any]:
    """The server's /prefix_groups, checked (see check_snapshot), or another of its JSON
    pages (an object). Raises ConfigError when it cannot be read or is not what it serves."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    status, body = _read_capped(url, headers, top, path)
    where = escape_controls(url.rstrip("/") + path)
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        answer = None
    if status != 200:
        msg = answer.get("error", {}).get("message") if isinstance(answer, dict) and isinstance(
            answer.get("error"), dict) else None
        shown = msg if isinstance(msg, str) else body[:MAX_SHOWN].decode("utf-8", "replace")
        raise ConfigError(f"{where} answered {status}: {escape_controls(shown)[:MAX_SHOWN]}")
    groups = path == "/prefix_groups"
    problem = check_snapshot(answer) if groups else None if isinstance(answer, dict) else "it must be a JSON object"
    if problem is not None:
        raise ConfigError(f"{where} answered something that is not its {'prefix groups' if groups else 'page'}: "
                          f"{problem}")
    return answer


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _rate(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1


def check_snapshot(snap: Any) -> str | None:
    """What is wrong with a /prefix_groups answer (None: it has the fields lint prints)."""
    if not isinstance(snap, dict) or not _int(snap.get("requests")) or not _int(snap.get("block_size")):
        return "it must be an object with integer `requests` and `block_size`"
    groups = snap.get("groups")
    if not isinstance(groups, list):
        return "`groups` must be a list"
    for i, g in enumerate(groups):
        if not (isinstance(g, dict) and isinstance(g.get("group"), str) and _int(g.get("requests"))
                and _rate(g.get("hit_rate")) and _rate(g.get("possible_hit_rate"))):
            return f"groups[{i}] must have a string `group`, integer `requests` and rates in 0..1"
        breaks = g.get("breaks")
        if not isinstance(breaks, list) or not all(
                isinstance(b, dict) and _int(b.get("token")) and _int(b.get("requests")) for b in breaks):
            return f"groups[{i}].breaks must be a list of {{token, requests}} integers"
    return None


def render_live(snap: dict[str, Any]) -> str:
    """A checked snapshot as text (its strings escaped)."""
    lines = [f"{snap['requests']} requests seen, block size {snap['block_size']}; prefix groups (requests sharing "
             "a first block), most prompt tokens first:"]
    for g in snap["groups"]:
        lost = g["possible_hit_rate"] - g["hit_rate"]
        brk = ", ".join(f"token {b['token']} ({b['requests']})" for b in g["breaks"][:3]) or "none"
        lines.append(f"  {escape_controls(g['group'])[:64]:<18} {g['requests']:>6} requests, hit rate "
                     f"{100 * g['hit_rate']:5.1f} % (possible {100 * g['possible_hit_rate']:5.1f} %"
                     + (f", {100 * lost:.1f} points lost to eviction" if lost > 0.0005 else "") + f"); breaks at {brk}")
    if not snap["groups"]:
        lines.append("  (none yet)")
    lines.append("A break is where a request stopped matching every earlier one: volatile content there "
                 "(a timestamp, an id) splits the group; run `hotprefix lint` on a --request-log-prompts log "
                 "to name it.")
    return "\n".join(lines)


def run_live(url: str, api_key: str | None, as_json: bool) -> int:
    snap = fetch(url, api_key)
    print(json_text(snap) if as_json else render_live(snap))
    return 0
