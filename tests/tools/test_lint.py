"""`hotprefix lint` on crafted logs, and its prediction checked against a real server."""

from __future__ import annotations

import json
import random
import uuid

import httpx
import pytest

from hotprefix.engine.tokenizer import PromptEncoder
from hotprefix.tools.lint import Linter, find_volatile, simulate
from tests.server.conftest import start_server

SYSTEM = "You are the support assistant. Answer briefly. "


def crafted(n: int = 16, seed: int = 0) -> list[dict]:
    """Chat requests whose system prompt starts with a timestamp (first half) or a
    request UUID (second half) in front of a shared instruction."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        head = (f"Current time: 2026-11-22T14:{i:02d}:{rng.randint(10, 59)}Z" if i < n // 2
                else f"Request {uuid.UUID(int=rng.getrandbits(128))}")
        rows.append({"messages": [{"role": "system", "content": f"{head}\n{SYSTEM}"},
                                  {"role": "user", "content": f"question {i}?"}]})
    return rows


@pytest.fixture(scope="module")
def linter(tiny_llama):
    from transformers import AutoTokenizer

    return Linter(PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_llama[0]))), block_size=4)


def test_volatile_patterns():
    kinds = [v.kind for v in find_volatile(
        "at 2026-11-22T14:03:11Z id 123e4567-e89b-12d3-a456-426614174000 user_id=ab12cd on 11/22/2026 "
        "at 14:05 ts 1795356027 count 42 req-9f8e7d6c")]
    assert kinds == ["timestamp", "uuid", "id", "date", "time", "unix_time", "counter", "id"]


def test_simulation_matches_the_engine_rules():
    a, b = list(range(10)), list(range(10)) + [99]
    sim = simulate([a, b, a], block_size=4)
    assert sim.hits == [0, 8, 8]  # b: 2 full blocks; a again: capped at (10 - 1) // 4 = 2 blocks
    assert sim.lcps == [0, 10, 10]


def test_finds_timestamp_and_uuid_with_positions(linter):
    rep, fixed = linter.report(crafted())
    kinds = {f["kind"]: f for f in rep["volatile_before_break"]}
    assert set(kinds) == {"timestamp", "uuid"}
    ts = kinds["timestamp"]["examples"][0]
    assert ts["snippet"].startswith("2026-11-22T14:") and ts["char_pos"] == len("<|im_start|>system\nCurrent time: ")
    assert kinds["uuid"]["examples"][0]["char_pos"] == len("<|im_start|>system\nRequest ")
    # Every prompt but the first of each kind breaks inside its volatile content (the first
    # UUID prompt breaks at "Request" vs "Current": a structural difference, not volatile).
    assert kinds["timestamp"]["requests"] == 7 and kinds["uuid"]["requests"] == 7
    assert rep["hit_rate_if_fixed"] > rep["hit_rate_as_sent"] + 0.2
    # The fix moved the volatile text after the shared part: the system prompts now agree.
    assert len({f["messages"][0]["content"] for f in fixed}) <= 2
    assert all("(" in f["messages"][-1]["content"] for f in fixed)


def test_prediction_matches_a_real_server_within_2_points(linter, tiny_llama, tmp_path):
    rep, fixed = linter.report(crafted(24, seed=3))
    s = start_server(tiny_llama[0], block_size=4, num_blocks_override=2048, max_model_len=256)
    try:
        def measured(bodies):
            q0, h0 = s.metric("prefix_cache_queries_total"), s.metric("prefix_cache_hits_total")
            for b in bodies:
                r = httpx.post(s.v1 + "/chat/completions", json={**b, "max_tokens": 1}, timeout=60)
                assert r.status_code == 200, r.text
            return (s.metric("prefix_cache_hits_total") - h0) / (s.metric("prefix_cache_queries_total") - q0)

        fixed_rate = measured(fixed)
        httpx.post(s.url + "/reset_prefix_cache")
        sent_rate = measured(crafted(24, seed=3))
    finally:
        s.stop()
    assert abs(fixed_rate - rep["hit_rate_if_fixed"]) <= 0.02, (fixed_rate, rep["hit_rate_if_fixed"])
    assert abs(sent_rate - rep["hit_rate_as_sent"]) <= 0.02, (sent_rate, rep["hit_rate_as_sent"])


def test_cli_report_json_and_fixed_file(tmp_path, tiny_llama):
    import subprocess
    import sys

    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in crafted()))
    out = tmp_path / "fixed.jsonl"
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", str(log), "--model", str(tiny_llama[0]),
                        "--block-size", "4", "--json", "--write-fixed", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["requests"] == 16 and {f["kind"] for f in rep["volatile_before_break"]} == {"timestamp", "uuid"}
    assert len(out.read_text().splitlines()) == 16
    text = subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", str(log), "--model", str(tiny_llama[0]),
                           "--block-size", "4"], capture_output=True, text=True).stdout
    assert "volatile content where sharing breaks" in text and "timestamp" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", str(bad), "--model", str(tiny_llama[0])],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "neither `messages` nor `prompt`" in r.stderr
