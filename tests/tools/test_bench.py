"""`hotprefix bench` against real hotprefix servers (tiny model), `--compare` against two."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hotprefix.tools.workloads import WORKLOADS, build
from tests.server.conftest import start_server

NO_SERVER_PACKAGES = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):  # as on the lent GPU: torch, triton, transformers, pytest only
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client", "pydantic"}:
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Absent())
from hotprefix.tools.workloads import build
jobs, conc, turns = build("tenants", 0, 1.0)
print(len(jobs), conc, turns, len(jobs[0].prompt) > 0)
"""


def test_workloads_import_without_the_server_packages():
    """benchmarks/gpu_path.py builds the tenants requests on a GPU host whose python has
    none of the server's packages (the H200 run of 2026-11-27 could not, before
    tools/workloads.py); bench's names are the same objects."""
    import hotprefix.tools.bench as bench
    import hotprefix.tools.workloads as workloads

    p = subprocess.run([sys.executable, "-c", NO_SERVER_PACKAGES], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["200", "8", "0", "True"]
    assert bench.build is workloads.build and bench.WORKLOADS is workloads.WORKLOADS


def test_workloads_are_deterministic_and_shaped_as_specified():
    for w in WORKLOADS:
        a, conc_a, turns_a = build(w, seed=1)
        b, _, _ = build(w, seed=1)
        assert [j.prompt for j in a] == [j.prompt for j in b]
        assert [j.prompt for j in a] != [j.prompt for j in build(w, seed=2)[0]]
    jobs, conc, _ = build("tenants")
    assert len(jobs) == 200 and conc == 8
    assert len({j.prompt.split("\n")[0] for j in jobs}) == 20  # 20 tenant system prompts
    assert all(400 <= len(j.prompt.split("\n")[0].split()) - 3 <= 600 for j in jobs)
    jobs, conc, turns = build("chat")
    assert (len(jobs), conc, turns) == (8, 8, 6)
    jobs, _, _ = build("unique")
    assert len(jobs) == 64 and len({j.prompt.split()[1] for j in jobs}) == 64  # distinct from the start
    jobs, _, _ = build("rag")
    assert len(jobs) == 32 and len({j.prompt.split("\nQuestion")[0] for j in jobs}) == 1
    jobs, conc, _ = build("ttft")
    assert len(jobs) == 6 and conc == 1 and len(jobs[0].prompt.split("\n")[0].split()) == 1000
    jobs, conc, _ = build("decode", scale=0.1)  # (lengths do not scale: it measures a stream)
    assert (len(jobs), conc) == (3, 1) and all(j.max_tokens == 128 and len(j.prompt.split()) == 32 for j in jobs)
    jobs, conc, _ = build("shared")  # one warm-up, then 8 at once on its prefix
    assert (len(jobs), conc) == (9, 8) and [j.warmup for j in jobs] == [True] + [False] * 8
    assert len({j.prompt.split("\nQuestion")[0] for j in jobs}) == 1 and len({j.prompt for j in jobs}) == 9


def test_bench_shared_measures_the_eight_after_the_warmup(tiny_llama, tmp_path):
    out = tmp_path / "shared.json"
    s = start_server(tiny_llama[0], max_model_len=256)
    try:
        r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "bench", s.url, "--workload", "shared",
                            "--scale", "0.03", "--max-tokens", "4", "--json", str(out)],
                           capture_output=True, text=True, timeout=600)
    finally:
        s.stop()
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())[0]["results"][0]
    assert (res["requests"], res["failed"], res["output_tokens"], res["concurrency"]) == (8, 0, 32, 8)
    # the warm-up's prompt tokens are outside the counters: the 8 find the prefix's blocks cached
    assert res["hit_rate_source"] == "metrics" and res["prefix_cache_hit_rate"] > 0.5


@pytest.fixture(scope="module")
def two_servers(tiny_llama):
    a = start_server(tiny_llama[0], max_model_len=256)
    b = start_server(tiny_llama[0], max_model_len=256, enable_prefix_caching=False)
    yield a, b
    a.stop()
    b.stop()


def test_bench_compare_two_servers(two_servers, tmp_path):
    a, b = two_servers
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "bench", a.url, "--compare", b.url, "--scale", "0.05",
                        "--max-tokens", "4", "--workload", "tenants", "--workload", "unique", "--workload", "chat",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "workload tenants" in r.stdout and "B vs A" in r.stdout
    res = {w["workload"]: w for w in json.loads(out.read_text())}
    ten = res["tenants"]
    cached, uncached = ten["results"]
    assert cached["requests"] == uncached["requests"] == 10 and cached["failed"] == uncached["failed"] == 0
    assert cached["output_tokens"] == 40
    assert cached["prefix_cache_hit_rate"] > 0.3 and cached["hit_rate_source"] == "metrics"
    assert uncached["prefix_cache_hit_rate"] in (0.0, None)
    assert set(ten["ratios"]) == {"output_tokens_per_s", "requests_per_s", "ttft_p50_speedup", "itl_p50_speedup"}
    assert res["unique"]["results"][0]["prefix_cache_hit_rate"] == 0.0
    chat = res["chat"]["results"][0]
    assert chat["requests"] == 6 and chat["prefix_cache_hit_rate"] > 0.3  # history is re-sent each turn
    assert chat["ttft_s"]["p50"] > 0 and chat["itl_s"]["p50"] > 0


def test_bench_decode_measures_each_stream_after_its_first_token(tiny_llama, tmp_path):
    out = tmp_path / "decode.json"
    s = start_server(tiny_llama[0], max_model_len=512)
    try:
        r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "bench", s.url, "--workload", "decode",
                            "--json", str(out)], capture_output=True, text=True, timeout=600)
    finally:
        s.stop()
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())[0]["results"][0]
    assert (res["requests"], res["failed"], res["output_tokens"]) == (3, 0, 3 * 128), res["errors"]
    # 127 gaps between tokens per stream: the rate is 127 / (the time after its first token), so no
    # stream's rate is below 127 / the whole run's time (a bound that holds at any load; the ratio to
    # the median gap it replaced did not: at load 15 a few long gaps pull a stream's mean far from it)
    assert res["stream_tokens_per_s_median"] >= 127 / res["wall_s"]
    assert res["itl_s"]["p50"] > 0
    assert "tokens/s of a stream (median)" in r.stdout


def test_bench_against_a_keyed_server(tiny_llama):
    s = start_server(tiny_llama[0], server_kw={"api_key": "sk-bench-key"}, max_model_len=256)
    try:
        cmd = [sys.executable, "-m", "hotprefix.cli", "bench", s.url, "--scale", "0.05", "--max-tokens", "2",
               "--workload", "unique"]
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and "cannot list models" in refused.stderr
        ok = subprocess.run(cmd + ["--api-key", "sk-bench-key"], capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0, ok.stderr
        assert "workload unique" in ok.stdout and "3 (0 failed)" in ok.stdout
    finally:
        s.stop()
