"""The model-server contract of the Gateway API Inference Extension's endpoint picker
(and llm-d's): under --metrics-prefix vllm, the queue and KV gauges it scores pods by,
with vLLM's meanings, and cache_config_info's block size and block count (its
prefix-cache scorer's configuration)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = start_server(tiny_llama[0], server_kw={"metrics_prefix": "vllm"}, max_num_seqs=1, num_blocks_override=64)
    yield s
    s.stop()


def scrape(server) -> dict[str, list]:
    """Every sample of /metrics, by metric family name, parsed as Prometheus parses it."""
    text = httpx.get(server.url + "/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def gauge(server, name: str) -> float:
    (sample,) = scrape(server)[name]
    return sample.value


def wait_for(server, want: dict[str, float], timeout: float = 60.0) -> None:
    """Scrape until the gauges read `want` (the state is awaited, not slept for)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(gauge(server, n) == v for n, v in want.items()):
            return
    raise AssertionError(f"the gauges never read {want}")


def test_the_gauges_the_endpoint_picker_reads_have_vllms_meanings(server):
    info = scrape(server)["vllm:cache_config_info"]
    labels = info[0].labels
    assert int(labels["block_size"]) == server.engine.kv.block_size
    assert int(labels["num_gpu_blocks"]) == server.engine.kv.num_blocks == 64
    assert gauge(server, "vllm:kv_cache_usage_perc") == 0.0
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 200, "ignore_eos": True}
    done = []
    threads = [threading.Thread(target=lambda: done.append(httpx.post(server.v1 + "/completions", json=body,
                                                                      timeout=120).status_code))
               for _ in range(2)]
    for t in threads:
        t.start()
    # one seat (--max-num-seqs 1): one request runs while the other waits in the scheduler's queue
    wait_for(server, {"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 1})
    usage = gauge(server, "vllm:kv_cache_usage_perc")
    assert 0 < usage <= 1  # the running request's blocks, as a fraction of the pool (1 means 100 percent)
    for t in threads:
        t.join()
    assert done == [200, 200]
    wait_for(server, {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                      "vllm:kv_cache_usage_perc": 0.0})  # finished: cached blocks are free, not in use
    pinned = httpx.post(server.url + "/pin", json={"model": "tiny", "prompt": list(range(3, 3 + 48))}).json()
    assert pinned["pinned_blocks"] == 3
    assert gauge(server, "vllm:kv_cache_usage_perc") == 3 / 64  # a pin holds its blocks: in use
