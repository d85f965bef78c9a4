"""Cached prefixes survive a restart: `hotprefix serve --kv-disk-dir`, a 1,000-token
prefix, SIGTERM, the same command again; the prefix comes back from disk with the
same greedy answer, over real HTTP with the official client."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow
PREFIX = " ".join(f"Rule {i}: shipment {i * 37 % 101} leaves dock {i % 7} at {i % 24}:00." for i in range(64))


def serve(args: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hotprefix", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def ask(url: str, question: str) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = client.completions.create(model="default", prompt=PREFIX + question, max_tokens=12, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def metric(url: str, pattern: str) -> float:
    m = re.search(pattern + r" ([0-9.e+]+)", httpx.get(url + "/metrics").text)
    assert m, pattern
    return float(m.group(1))


def test_a_prefix_survives_sigterm_and_restart(tmp_path):
    args = ["--quantized-matmul", "float32", "--kv-disk-dir", str(tmp_path / "kv"), "--max-model-len", "2048",
            "--served-model-name", "default"]
    with open(tmp_path / "log", "w") as log:
        proc, url = serve(args, log)
        try:
            cold, n_prompt, cached = ask(url, " When does shipment 5 leave?")
            assert n_prompt >= 1000 and cached == 0
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises it after draining
        files = list((tmp_path / "kv").glob("*/*.kvb"))
        assert len(files) >= n_prompt // 16
        proc, url = serve(args, log)
        try:
            text, _, cached = ask(url, " When does shipment 5 leave?")
            assert text == cold
            assert cached == (n_prompt - 1) // 16 * 16 and cached >= 992
            by_disk = r'hotprefix:prompt_tokens_cached_by_source_total\{model_name="default",source="disk"\}'
            assert metric(url, by_disk) == cached
            assert metric(url, r'hotprefix:kv_tier_blocks\{model_name="default",tier="disk"\}') >= len(files)
            # another question on the same prefix: its blocks are in the pool now
            _, _, cached2 = ask(url, " Which dock is rule 9 about?")
            assert cached2 >= 992
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises it after draining
