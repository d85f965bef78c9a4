"""`hotprefix lint LOG --curve` and `hotprefix size --from-log LOG` on request logs written
as the server writes them: the words, the JSON points, the SVG, per tenant, and the worst
inputs (an empty log, one request, another block size, two block sizes in one file)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hotprefix.cachecurve.curve import Options, build
from hotprefix.server.request_log import KVShape
from hotprefix.tools.curve_log import read_log
from tests.tools.curve_logs import chats, write_log

KV = KVShape(16, 200, 0, 737_280)  # smollm2's blocks in float32


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotprefix.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> tuple[Path, list, list]:
    reqs, tenants = chats(600, 21, 16, convs=60, systems=6, tenants=3)
    path = tmp_path_factory.mktemp("curve") / "requests.jsonl"
    write_log(path, reqs, tenants, KV)
    return path, reqs, tenants


def test_the_log_reads_back_as_it_was_served(log):
    path, reqs, tenants = log
    traffic = read_log(path)
    assert [(tuple(bytes.fromhex(h) for h in r.hashes), r.prompt_tokens, r.output_tokens) for r in traffic.reqs] == \
        [(tuple(r.hashes), r.prompt_tokens, max(r.output_tokens, 1)) for r in reqs]
    assert len(set(traffic.tenants)) == 3 and traffic.kv == KV and traffic.span_s == len(reqs) - 0.5


def test_lint_curve_json_text_and_plot(log, tmp_path):
    path, reqs, tenants = log
    svg = tmp_path / "curve.svg"
    r = cli("lint", str(path), "--curve", "--json", "--host-blocks", "100", "--plot", str(svg))
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    curve = build(reqs, tenants, 16, len(reqs) - 0.5, Options(host_blocks=100, pools=(200,)))
    assert js["requests"] == 600 and js["bytes_per_block"] == 737_280 and js["hit_rate_unbounded"] == curve.unbounded
    a = js["advice"]
    assert a["pool"] == {"blocks": 200, "bytes": 200 * 737_280, "flag": None} and a["pool_rate"] == curve.rate(200)
    assert a["host"]["blocks"] == 100 and a["host_gain"] == pytest.approx(curve.host_rate(200) - curve.rate(200))
    rec = a["recommended"]
    assert rec["bytes"] >= rec["blocks"] * 737_280 > rec["bytes"] - 737_280 and a["recommended_rate"] >= \
        0.95 * curve.unbounded
    assert len(a["tenants"]) == 3 and sum(t["requests"] for t in a["tenants"]) == 600
    for p in js["points"]:
        assert set(p) == {"blocks", "bytes", "host_blocks", "host_bytes", "hit_rate", "tokens_saved",
                          "tokens_saved_per_s"}
        rate = curve.rate(p["blocks"]) if not p["host_blocks"] else curve.host_rate(p["blocks"])
        assert p["hit_rate"] == rate and p["bytes"] == p["blocks"] * 737_280
        assert p["tokens_saved_per_s"] == pytest.approx(rate * curve.prompt_tokens / (len(reqs) - 0.5))
    assert js["checks"] and js["check_error_points"] == 0.0 and js["moved_blocks"] == 0
    tree = ET.parse(svg).getroot()  # well-formed, with the curve, the host tier's points and the marks
    classes = {el.get("class") for el in tree.iter() if el.get("class")}
    assert {"device", "host", "unbounded", "pool", "recommended"} <= classes
    text = cli("lint", str(path), "--curve", "--host-blocks", "100")
    assert text.returncode == 0, text.stderr
    assert f"`--kv-cache-memory {rec['flag']}` ({rec['blocks']:,} blocks" in text.stdout
    assert "reaches 95 % of it" in text.stdout and "host tier (100 blocks) adds" in text.stdout
    assert "per tenant (cache salt digest)" in text.stdout and "(from the log)" in text.stdout


def test_size_answers_from_the_log_beside_the_formula(log):
    path, reqs, tenants = log
    curve = build(reqs, tenants, 16, None, Options(checks=0))
    p95 = curve.pool_for(0.95)
    r = cli("size", "--from-log", str(path), "--kv-cache-dtype", "float32", "--kv-cache-dtype", "fp8", "--json")
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    rec = js["from_log"]["recommended"]
    assert rec["float32"]["blocks"] >= p95 and rec["fp8"]["blocks"] >= p95
    assert rec["float32"]["bytes"] == 2 * rec["fp8"]["bytes"] or rec["float32"]["flag"] != rec["fp8"]["flag"]
    assert js["from_log"]["curve"]["hit_rate_unbounded"] == curve.unbounded and "blocks_needed" in js["reports"][0]
    table = cli("size", "--from-log", str(path))
    assert table.returncode == 0 and "95 % of the log's unbounded hit rate" in table.stdout
    assert "blocks needed" in table.stdout and f"from {path}:" in table.stdout


def test_another_block_size(tmp_path):
    """A server of 32-token blocks: the curve counts its blocks; --block-size cannot re-cut
    its hashes; a file with two servers' block sizes is refused at the line that changes."""
    reqs, tenants = chats(80, 4, 32)
    path = tmp_path / "bs32.jsonl"
    write_log(path, reqs, tenants, KVShape(32, 50, 0, 2048))
    r = cli("lint", str(path), "--curve", "--json")
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    assert js["block_size"] == 32 and js["hit_rate_unbounded"] == build(reqs, tenants, 32).unbounded
    bad = cli("lint", str(path), "--curve", "--block-size", "16")
    assert bad.returncode == 2 and "32-token blocks" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    mixed = tmp_path / "mixed.jsonl"
    write_log(mixed, reqs[:3], tenants[:3], KVShape(16, 50, 0, 1024))
    mixed.write_text(mixed.read_text() + path.read_text())
    err = cli("lint", str(mixed), "--curve")
    assert err.returncode == 2 and f"{mixed}:4: blocks of 32 tokens in a log of 16-token blocks" in err.stderr


def test_an_empty_log_and_one_request(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = cli("lint", str(empty), "--curve")
    assert r.returncode == 2 and r.stderr.strip() == f"hotprefix: error: {empty}: no requests"
    one = tmp_path / "one.jsonl"
    reqs, tenants = chats(1, 2, 16)
    write_log(one, reqs, tenants, KV)
    r = cli("lint", str(one), "--curve")
    assert r.returncode == 0, r.stderr
    assert "hit-rate curve of 1 request (" in r.stdout and "no pool size caches anything on this traffic" in r.stdout
    js = json.loads(cli("lint", str(one), "--curve", "--json").stdout)
    assert js["hit_rate_unbounded"] == 0 and js["advice"]["recommended"] is None and js["points"]
