"""`hotprefix logs` and `hotprefix watch` against a real server on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx

from hotprefix.tools.logs import analyse, percentile, read_token_counts
from hotprefix.tools.watch import parse_metrics, summarise, watch


def test_percentiles_nearest_rank():
    v = list(range(1, 101))
    assert [percentile(v, p) for p in (50, 95, 99, 100)] == [50, 95, 99, 100]
    assert percentile([7], 99) == 7


def test_analyse_by_hand():
    prompts = [100] * 98 + [500, 1000]
    r = analyse(prompts, [-1] * 100, block_size=16, bytes_per_token=23_040, current_max_model_len=8192,
                concurrency=8)
    assert r["prompt_tokens"] == {"p50": 100, "p95": 100, "p99": 500, "max": 1000}
    assert r["recommended_max_model_len"] == 608  # 500 * 1.2 = 600 -> 38 blocks of 16
    assert r["requests_over_recommendation"] == 1
    assert r["kv_bytes_freed"] == (8192 - 608) * 8 * 23_040


def test_logs_on_a_real_request_log(logged_server):
    s, path = logged_server
    sizes = []
    for i in range(12):
        r = httpx.post(s.v1 + "/completions", json={"prompt": "word " * (3 + 4 * i), "max_tokens": 2,
                                                    "ignore_eos": True}).json()
        sizes.append(r["usage"]["prompt_tokens"] + 2)
    deadline = time.monotonic() + 5
    while len(path.read_text().splitlines()) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    prompts, completions = read_token_counts(path)
    assert sorted(p + c for p, c in zip(prompts, completions)) == sorted(sizes)
    out = subprocess.run([sys.executable, "-m", "hotprefix.cli", "logs", str(path), "--json", "--concurrency", "4",
                          "--current-max-model-len", "8192"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    p99 = percentile(sizes, 99)
    assert rep["total_tokens"]["p99"] == p99 and rep["based_on"] == "prompt+completion"
    assert rep["recommended_max_model_len"] == -(-int(-(-p99 * 12 // 10)) // 16) * 16
    # SmolLM2 at serve's CPU default KV dtype (float32): 46,080 bytes a token
    assert rep["kv_bytes_freed"] == (8192 - rep["recommended_max_model_len"]) * 4 * 46_080
    half = subprocess.run([sys.executable, "-m", "hotprefix.cli", "logs", str(path), "--json", "--concurrency", "4",
                           "--current-max-model-len", "8192", "--kv-cache-dtype", "float16"],
                          capture_output=True, text=True)
    assert json.loads(half.stdout)["kv_bytes_freed"] == rep["kv_bytes_freed"] // 2
    text = subprocess.run([sys.executable, "-m", "hotprefix.cli", "logs", str(path)], capture_output=True,
                          text=True).stdout
    assert "recommended --max-model-len" in text


def test_watch_sees_usage_and_hit_rate_move(logged_server):
    s, _ = logged_server
    system = "shared system prompt for watching " * 3
    result = {}
    done = threading.Event()
    gate = threading.Event()  # cleared: the engine thread stops in its step's model pass, its batch running
    gate.set()
    real_execute = s.engine.runner.execute

    def gated_execute(sched):
        out = real_execute(sched)
        gate.wait(timeout=60)
        return out

    def run():  # polls until told to stop; its last sample is taken after `done` is set
        result["summary"] = watch(s.url, interval=0.05, duration=None, count=None, live=False, stop=done)

    s.engine.runner.execute = gated_execute
    t = threading.Thread(target=run)
    held = threading.Thread(target=httpx.post, args=(s.v1 + "/completions",),
                            kwargs={"json": {"prompt": system + "held", "max_tokens": 20, "ignore_eos": True},
                                    "timeout": 60})
    try:
        t.start()
        for i in range(6):
            httpx.post(s.v1 + "/completions", json={"prompt": system + f"q{i}", "max_tokens": 20, "ignore_eos": True})
        gate.clear()  # hold the next request mid-flight, so that samples see it running and holding KV blocks
        held.start()
        deadline = time.monotonic() + 30
        while parse_metrics(httpx.get(s.url + "/metrics").text).running < 1:
            assert time.monotonic() < deadline, "the held request never showed as running"
            time.sleep(0.02)
        done.set()
        t.join(timeout=60)  # the watcher's last sample was taken while the request is held
    finally:
        gate.set()
        s.engine.runner.execute = real_execute
        if held.ident is not None:
            held.join(timeout=60)
    summary = result["summary"]
    assert summary["samples"] >= 2 and summary["prefix_cache_queries"] > 0
    assert 0 < summary["prefix_cache_hit_rate"] <= 1
    assert summary["kv_usage"]["max"] > 0 and summary["running"]["max"] >= 1
    s.wait_idle()
    cli = subprocess.run([sys.executable, "-m", "hotprefix.cli", "watch", s.url, "--count", "2", "--interval",
                          "0.1", "--quiet"], capture_output=True, text=True)
    assert cli.returncode == 0 and json.loads(cli.stdout)["samples"] == 2


def test_watch_reads_vllm_names():
    page = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3.0\n"
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 1.0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n"
            "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{model_name=\"m\"} 100.0\n"
            "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name=\"m\"} 40.0\n")
    a = parse_metrics(page)
    b = parse_metrics(page.replace("100.0", "300.0").replace("40.0", "140.0"))
    assert (a.running, a.waiting, a.kv_usage) == (3.0, 1.0, 0.5)
    assert summarise([a, b])["prefix_cache_hit_rate"] == 0.5
