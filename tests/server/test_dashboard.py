"""GET /dashboard in headless Chromium: it loads with no console error, its numbers are
the ones /metrics exports after a known sequence of requests, and a screenshot is taken;
/dashboard/data is behind --api-key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.browser import Browser
from tests.server.conftest import start_server

SHARED = "The quick brown fox jumps over the lazy dog. Caching keys and values saves compute. "


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"hotprefix:(\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            source = f'{{source="{labels["source"]}"}}' if "source" in labels else ""
            out[m.group(1) + source] = float(m.group(3))
    return out


def test_the_page_shows_what_metrics_exports(tiny_llama, tmp_path):
    s = start_server(tiny_llama[0], block_size=4)
    try:
        ids = s.engine.tokenize(SHARED)
        for tail in ("one", "two", "three"):
            r = httpx.post(s.v1 + "/completions", json={"prompt": SHARED + tail, "max_tokens": 3,
                                                        "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
        r = httpx.post(s.url + "/pin", json={"prompt": SHARED}, timeout=60)
        assert r.status_code == 200
        with Browser() as b:
            b.goto(s.url + "/dashboard")
            b.wait_for("document.readyState === 'complete' && Number(document.body.dataset.loaded || 0) >= 1")
            page = b.evaluate("Object.fromEntries([...document.querySelectorAll('[data-metric]')]"
                              ".map(e => [e.dataset.metric, Number(e.textContent)]))")
            shown = b.evaluate("({hit: document.getElementById('hit-rate').textContent, "
                               "pinned: document.getElementById('pinned').textContent, "
                               "rows: [...document.querySelectorAll('#prefixes tr')].map(r => [...r.children]"
                               ".map(c => c.textContent))})")
            metrics = scrape(s.url)
            shot = b.screenshot(tmp_path / "dashboard.png")
            if os.environ.get("HOTPREFIX_SCREENSHOT_DIR"):
                (Path(os.environ["HOTPREFIX_SCREENSHOT_DIR"]) / "dashboard.png").write_bytes(shot)
            errors = b.console_errors()
    finally:
        s.stop()
    assert errors == []
    assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
    assert page and all(page[name] == metrics[name] for name in page), (page, metrics)
    assert set(page) >= {"prefix_cache_hits_total", "prefix_cache_queries_total", "prompt_tokens_total",
                         'prompt_tokens_cached_by_source_total{source="device"}', "generation_tokens_total"}
    # the known sequence: the 2nd and 3rd prompts hit the shared blocks, the pin's prompt hits them too
    shared_hit = (len(ids) // 4) * 4
    assert page["prefix_cache_hits_total"] >= 2 * shared_hit
    assert shown["hit"] == f"{100 * metrics['prefix_cache_hits_total'] / metrics['prefix_cache_queries_total']:.1f} %"
    assert shown["pinned"] == f"{len(ids) // 4} blocks"
    (top,) = [row for row in shown["rows"] if row[6] == "yes"]  # the pinned prefix's group, marked
    assert int(top[2]) == 3 and top[7] == "(not logged)"  # the pin itself is no request of the group


def test_the_data_is_behind_the_api_key(tiny_llama):
    s = start_server(tiny_llama[0], server_kw={"api_key": "sekret"})
    try:
        page = httpx.get(s.url + "/dashboard")  # the page holds no data: it asks for the key
        denied = httpx.get(s.url + "/dashboard/data")
        ok = httpx.get(s.url + "/dashboard/data", headers={"Authorization": "Bearer sekret"})
        bad = httpx.get(s.url + "/dashboard/data", params={"minutes": 0}, headers={"Authorization": "Bearer sekret"})
    finally:
        s.stop()
    assert page.status_code == 200 and 'id="key"' in page.text
    assert denied.status_code == 401 and ok.status_code == 200 and ok.json()["limits"]["api_key"] is True
    assert bad.status_code == 400


@pytest.mark.parametrize("minutes", [0.5, 1440])
def test_the_window_is_what_was_asked(tiny_llama, minutes):
    s = start_server(tiny_llama[0])
    try:
        d = httpx.get(s.url + "/dashboard/data", params={"minutes": minutes}).json()
    finally:
        s.stop()
    assert 0 <= d["window"]["seconds"] <= 60 * minutes and d["now"]["num_blocks"] == 256


def test_polling_the_data_does_not_grow_the_series(tiny_llama):
    s = start_server(tiny_llama[0], server_kw={"dashboard_interval": 3600.0, "dashboard_window": 3600.0})
    try:
        lengths = [len(httpx.get(s.url + "/dashboard/data").json()["series"]) for _ in range(30)]
    finally:
        s.stop()
    assert lengths == [1] * 30  # the sampler's one sample at start, closed by each answer's fresh one


def test_the_page_draws_the_hit_rate_curve_with_the_pool_marked(tiny_llama):
    """Prompts of two shared prefixes, then the page: the curve is drawn from the recent
    prompts, its marker sits at the server's pool, and it says what an unbounded cache gives."""
    s = start_server(tiny_llama[0], block_size=4, num_blocks_override=48)
    try:
        for i in range(8):
            prompt = SHARED * (1 + i % 2) + f"question {i}"
            r = httpx.post(s.v1 + "/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True},
                           timeout=60)
            assert r.status_code == 200
        data = httpx.get(s.url + "/dashboard/data").json()
        with Browser() as b:
            b.goto(s.url + "/dashboard")
            b.wait_for("document.readyState === 'complete' && Number(document.body.dataset.loaded || 0) >= 1")
            shown = b.evaluate("(() => { const svg = document.getElementById('chart-curve'); "
                               "const m = document.getElementById('curve-pool'); "
                               "const dev = document.getElementById('curve-device'); "
                               "return {xmax: Number(svg.dataset.xmax), x: Number(m.getAttribute('x1')), "
                               "blocks: Number(m.dataset.blocks), points: Number(dev.dataset.count), "
                               "advice: document.getElementById('curve-advice').textContent, "
                               "window: document.getElementById('curve-window').textContent}; })()")
            errors = b.console_errors()
    finally:
        s.stop()
    curve = data["curve"]
    assert errors == []
    assert curve["requests"] == 8 and curve["block_size"] == 4 and curve["advice"]["pool"]["blocks"] == 48
    assert shown["blocks"] == 48 and shown["window"] == "the last 8 requests"
    assert shown["x"] == pytest.approx(400 * 48 / shown["xmax"], abs=0.01)
    assert shown["points"] == len([p for p in curve["points"] if not p["host_blocks"]]) >= 2
    assert f"unbounded cache {100 * curve['hit_rate_unbounded']:.1f} %" in shown["advice"]
    assert f"this pool (48 blocks) {100 * curve['advice']['pool_rate']:.1f} %" in shown["advice"]
    assert curve["hit_rate_unbounded"] > 0.3  # the second of each prefix onwards hits it
