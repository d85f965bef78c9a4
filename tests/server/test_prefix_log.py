"""The request log's block-hash chains, GET /prefix_groups, and `hotprefix lint` reading
both from a real server."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import httpx
import pytest

from hotprefix.engine.requests import CacheScope
from hotprefix.server.prefix_log import LogKey, RecentPrompts
from hotprefix.server.request_log import PrefixEntry
from tests.server.conftest import start_server

SHARED = "The quick brown fox jumps over the lazy dog. Caching keys and values saves compute."


def rows_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def complete(s, prompt: str, **kw) -> None:
    r = httpx.post(s.v1 + "/completions", json={"prompt": prompt, "max_tokens": 1, **kw}, timeout=60)
    assert r.status_code == 200, r.text


def test_log_rows_carry_keyed_salted_hash_chains_and_no_text(tiny_llama, tmp_path):
    path = tmp_path / "requests.jsonl"
    s = start_server(tiny_llama[0], block_size=4, server_kw={"request_log": str(path)})
    try:
        ids = s.engine.tokenize(SHARED + " one")
        complete(s, SHARED + " one")
        complete(s, SHARED + " one")
        complete(s, SHARED + " one", cache_salt="tenant-a")
        hashes = s.engine.prefix_hashes(ids)
        salted = s.engine.prefix_hashes(ids, CacheScope("tenant-a"))
    finally:
        s.stop()
    key_file = tmp_path / "requests.jsonl.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = LogKey(bytes.fromhex(key_file.read_text().strip()))
    first, again, other = (r["prefix"][0] for r in rows_of(path))
    block_bytes = s.engine.arch.kv_shape.bytes_per_block("float32", 4)  # the pool's bytes a block (float32 KV)
    assert rows_of(path)[0]["kv"] == {"block_size": 4, "blocks": 256, "host_blocks": 0, "block_bytes": block_bytes}
    n = len(ids) // 4
    assert first["blocks"][:n] == key.digests(hashes) and again["blocks"][:n] == first["blocks"][:n]
    assert other["blocks"][:n] == key.digests(salted) and set(other["blocks"]).isdisjoint(first["blocks"])
    assert other["salt"] == key.digest(b"tenant-a") and first["salt"] is None
    assert first["tokens"] == len(ids) and first["cached"] == 0 and again["cached"] == (len(ids) - 1) // 4 * 4
    assert "text" not in first and SHARED not in path.read_text()
    assert all(len(d) == 16 and d not in {h.hex()[:16] for h in hashes} for d in first["blocks"])


def test_the_key_survives_a_restart_so_a_log_stays_comparable(tiny_llama, tmp_path):
    path = tmp_path / "requests.jsonl"
    for _ in range(2):
        s = start_server(tiny_llama[0], block_size=4, server_kw={"request_log": str(path)})
        try:
            complete(s, SHARED)
        finally:
            s.stop()
    a, b = (r["prefix"][0] for r in rows_of(path))
    assert a["blocks"] == b["blocks"] and b["cached"] == 0  # a new process: cold cache, same digests
    (tmp_path / "requests.jsonl.key").write_text("not a key\n")
    from hotprefix.config import ConfigError

    with pytest.raises(ConfigError, match="not a request-log key"):
        LogKey.for_log(str(path))


def test_prompts_are_logged_only_when_asked(tiny_llama, tmp_path):
    path = tmp_path / "requests.jsonl"
    s = start_server(tiny_llama[0], block_size=4, server_kw={"request_log": str(path), "request_log_prompts": True})
    try:
        r = httpx.post(s.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": SHARED}],
                                                          "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
    finally:
        s.stop()
    (row,) = rows_of(path)
    assert row["prefix"][0]["text"] == f"<|im_start|>user\n{SHARED}<|im_end|>\n<|im_start|>assistant\n"


def test_prefix_groups_show_where_requests_broke_off(tiny_llama, tmp_path):
    s = start_server(tiny_llama[0], block_size=4, server_kw={"api_key": "sekret"})
    auth = {"Authorization": "Bearer sekret"}
    try:
        shared_ids = s.engine.tokenize(SHARED)
        for tail in (" one", " two", " three"):  # then a shared tail: the break is well before the end
            r = httpx.post(s.v1 + "/completions", json={"prompt": SHARED + tail + SHARED, "max_tokens": 1},
                           headers=auth)
            assert r.status_code == 200
        assert httpx.get(s.url + "/prefix_groups").status_code == 401
        snap = httpx.get(s.url + "/prefix_groups", headers=auth).json()
        assert httpx.get(s.url + "/prefix_groups", params={"top": 0}, headers=auth).status_code == 400
        cli = subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", "--url", s.url, "--api-key", "sekret"],
                             capture_output=True, text=True)
        denied = subprocess.run([sys.executable, "-m", "hotprefix.cli", "lint", "--url", s.url],
                                capture_output=True, text=True)
    finally:
        s.stop()
    (g,) = snap["groups"]
    brk = len(shared_ids) // 4 * 4  # the block holding the first token after SHARED (" one" vs " two")
    assert snap["requests"] == 3 and g["requests"] == 3 and g["breaks"] == [{"token": brk, "requests": 2}]
    assert g["cached_tokens"] == 2 * brk and g["hit_rate"] == pytest.approx(g["possible_hit_rate"])
    assert g["hit_rate"] > 0
    assert cli.returncode == 0, cli.stderr
    assert g["group"] in cli.stdout and f"breaks at token {brk} (2)" in cli.stdout
    assert denied.returncode == 2 and "401" in denied.stderr


def test_without_prefix_caching_there_are_no_chains(tiny_llama, tmp_path):
    path = tmp_path / "requests.jsonl"
    s = start_server(tiny_llama[0], enable_prefix_caching=False, server_kw={"request_log": str(path)})
    try:
        complete(s, SHARED)
        r = httpx.get(s.url + "/prefix_groups")
    finally:
        s.stop()
    assert r.status_code == 400 and "prefix caching is off" in r.json()["error"]["message"]
    (row,) = rows_of(path)
    assert "prefix" not in row and not (tmp_path / "requests.jsonl.key").exists()


def test_a_planted_link_at_the_temporary_name_is_never_written_through(tmp_path):
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    log = tmp_path / "requests.jsonl"
    (tmp_path / f".requests.jsonl.key.{os.getpid()}.tmp").symlink_to(victim)
    key = LogKey.for_log(str(log))
    assert victim.read_text() == "keep me"
    assert bytes.fromhex((tmp_path / "requests.jsonl.key").read_text().strip()) == key.key
    assert stat.S_IMODE((tmp_path / "requests.jsonl.key").stat().st_mode) == 0o600
    assert not (tmp_path / f".requests.jsonl.key.{os.getpid()}.tmp").exists()


def test_the_recent_prompts_stay_bounded_when_their_prompts_fill_no_block():
    """The dashboard's recent prompts (the hit-rate curve's traffic) are bounded by what they
    hold: a prompt shorter than a block has no digest, and still counts (one for its entry),
    so requests of short prompts cannot grow them without bound (they did: only digests
    counted)."""
    recent = RecentPrompts(max_blocks=4)
    for i in range(10):
        recent.add(PrefixEntry(3, 0, 1, ()), float(i))
    assert [when for when, _ in recent.snapshot()] == [6.0, 7.0, 8.0, 9.0] and recent.added == 10
    recent.add(PrefixEntry(12, 0, 1, ("ab", "cd")), 10.0)  # two digests and its entry: three
    assert [when for when, _ in recent.snapshot()] == [9.0, 10.0]
