"""The hit-rate curve against real servers: a log captured from one server, its curve read
at three pool sizes (--num-gpu-blocks-override) and with a host tier, each within 2 points
of what a server of that size measures for the same requests; the recommendation applied
(--kv-cache-memory) lands within 2 points of the rate it promises; and the server's own
curve of its recent traffic (lint --url --curve) says what it measured."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

from hotprefix.cachecurve.advice import advise
from hotprefix.cachecurve.curve import Options, build
from hotprefix.config import parse_size
from hotprefix.tools.curve_cli import run_live
from hotprefix.tools.curve_log import read_log
from tests.server.conftest import start_server
from tests.tools.lint_logs import LOGS

BLOCK = 16
CAPTURE = 4096  # blocks: nothing is evicted


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.conftest import build_tiny_model

    d = tmp_path_factory.mktemp("tiny-1k")
    build_tiny_model(d, "llama", max_position_embeddings=1024)
    return d


def bodies() -> list[dict]:
    """The three lint logs, interleaved as one server would see them."""
    logs = [LOGS[name]() for name in LOGS]
    return [b for group in zip(*logs) for b in group]


def serve(model: Path, log: Path, url_check: bool = False, **cache) -> tuple[float, dict | None]:
    """Send the bodies one by one to a fresh server writing `log`: the hit rate it measured
    (and, with url_check, the curve `lint --url SERVER --curve` reads from it)."""
    cache.setdefault("num_blocks_override", CAPTURE)
    s = start_server(model, block_size=BLOCK, max_model_len=1024, server_kw={"request_log": str(log)}, **cache)
    live = None
    try:
        for b in bodies():
            r = httpx.post(s.v1 + "/chat/completions", json={**b, "max_tokens": 1, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        if url_check:
            live = httpx.get(s.url + "/dashboard/data").json()["curve"]
    finally:
        s.stop()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows), live


@pytest.fixture(scope="module")
def captured(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("capture") / "requests.jsonl"
    measured, _ = serve(model, log)
    return read_log(log), measured


def test_the_curve_at_three_pool_sizes_and_with_a_host_tier_is_what_servers_measure(model, captured, tmp_path):
    traffic, unbounded_measured = captured
    kv = traffic.kv
    assert kv.block_size == BLOCK and kv.blocks == CAPTURE and kv.block_bytes
    curve = build(traffic.reqs, traffic.tenants, BLOCK, traffic.span_s, Options(checks=0))
    assert abs(curve.unbounded - unbounded_measured) <= 0.02
    p95 = curve.pool_for(0.95)
    sizes = sorted({curve.largest + 2, (curve.largest + p95) // 2, p95})
    assert len(sizes) == 3 and curve.rate(sizes[0]) + 0.05 < curve.rate(sizes[2])  # the curve rises: a real test
    for n in sizes:
        measured, _ = serve(model, tmp_path / f"pool{n}.jsonl", num_blocks_override=n)
        assert abs(curve.rate(n) - measured) <= 0.02, (n, curve.rate(n), measured)
    pool, host = sizes[0], sizes[2]
    with_host = build(traffic.reqs, traffic.tenants, BLOCK, None, Options(host_blocks=host, pools=(pool,), checks=0))
    measured, _ = serve(model, tmp_path / "host.jsonl", num_blocks_override=pool,
                        kv_offloading_size=host * kv.block_bytes)
    assert abs(with_host.host_rate(pool) - measured) <= 0.02, (with_host.host_rate(pool), measured)
    assert with_host.host_rate(pool) > curve.rate(pool) + 0.02  # the tier adds what the pool evicted


def test_the_recommendation_applied_lands_where_it_promised(model, captured, tmp_path):
    traffic, _ = captured
    curve = build(traffic.reqs, traffic.tenants, BLOCK, traffic.span_s, Options(checks=0))
    a = advise(curve, traffic.kv.block_bytes, None)
    flag = a.recommended.flag
    measured, live = serve(model, tmp_path / "recommended.jsonl", url_check=True, num_blocks_override=None,
                           kv_cache_memory=parse_size(flag))
    assert abs(a.recommended_rate - measured) <= 0.02, (flag, a.recommended_rate, measured)
    # the server's own curve of its recent traffic, marked at its pool, says what it measured
    assert live["requests"] == len(bodies()) and live["advice"]["pool"]["blocks"] == a.recommended.blocks
    assert abs(live["advice"]["pool_rate"] - measured) <= 0.02


def test_lint_url_curve_prints_the_servers_curve(model, capsys):
    s = start_server(model, block_size=BLOCK, max_model_len=1024, num_blocks_override=64,
                     server_kw={"api_key": "sekret"})
    try:
        for b in bodies()[:12]:
            r = httpx.post(s.v1 + "/chat/completions", json={**b, "max_tokens": 1}, timeout=60,
                           headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200
        a = argparse.Namespace(url=s.url, api_key="sekret", json=False, plot=None)
        assert run_live(a) == 0
        text = capsys.readouterr().out
        a.json = True
        assert run_live(a) == 0
        js = json.loads(capsys.readouterr().out)
    finally:
        s.stop()
    assert "hit-rate curve of 12 requests" in text and "the server's pool, 64 blocks" in text
    assert js["requests"] == 12 and js["advice"]["pool"]["blocks"] == 64
