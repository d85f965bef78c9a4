"""deploy/grafana/hotprefix.json: it parses, is laid out on Grafana's grid, and every query
names a metric a real server exports, under both prefixes (hotprefix: and vllm:)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server

BOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "hotprefix.json"
NAME = re.compile(r"\$\{prefix\}:([a-zA-Z_][a-zA-Z0-9_]*)")


def board() -> dict:
    return json.loads(BOARD.read_text())


def queries(b: dict) -> list[str]:
    out = [t["expr"] for p in b["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in b["templating"]["list"] if "definition" in v]
    return out


def exported(tiny_llama, prefix: str) -> set[str]:
    """Every metric name a server with --metrics-prefix `prefix` exposes (samples and families),
    with a host tier (the tier gauges) and a refused request (the rejections counter)."""
    s = start_server(tiny_llama[0], kv_offloading_size=1 << 20, server_kw={"metrics_prefix": prefix,
                                                                            "api_key": "k" * 16})
    try:
        r = httpx.post(s.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer " + "k" * 16})
        assert r.status_code == 200
        assert httpx.post(s.v1 + "/completions", json={"prompt": "hi"}).status_code == 401
        text = httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    names |= {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE")}
    return names


def test_the_board_parses_and_is_laid_out():
    b = board()
    panels = b["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(set(refs)) == len(refs)
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    prefix = next(v for v in b["templating"]["list"] if v["name"] == "prefix")
    assert prefix["query"] == "hotprefix,vllm" and prefix["current"]["value"] == "hotprefix"
    # the panels vLLM's board lacks: the prefix-cache hit rate, and cached tokens by tier
    hit = next(p for p in panels if p["title"].startswith("Prefix-cache hit rate"))
    assert "prefix_cache_hits_total" in hit["targets"][0]["expr"] and "prefix_cache_queries_total" in \
        hit["targets"][0]["expr"]
    assert any("prompt_tokens_cached_by_source_total" in t["expr"] and "by (source)" in t["expr"]
               for p in panels for t in p.get("targets", []))


@pytest.mark.parametrize("prefix", ["hotprefix", "vllm"])
def test_every_query_names_an_exported_metric(prefix, tiny_llama):
    names = exported(tiny_llama, prefix)
    used = set()
    for expr in queries(board()):
        found = NAME.findall(expr)
        assert found, f"a query with no ${{prefix}}: metric: {expr}"
        used |= set(found)
    missing = sorted(n for n in used if f"{prefix}:{n}" not in names)
    assert missing == [], missing
    assert len(used) >= 20  # the board covers the exporter, not a corner of it
