"""The gateway's warm-up on a restarted backend, with and without the disk KV tier.

The gateway warms a hotprefix backend by POSTing each tenant's system prompt to its
/pin (gateway/warmup.py): compute the prefix unless cached, then pin it. This script
does exactly that for TENANTS salted ~1,000-token prompts against `hotprefix serve
--kv-disk-dir DIR`, then SIGTERMs the server, starts it again with the same flags and
warms again: the first warm-up computes every prompt, the second finds them on disk.

    .venv/bin/python benchmarks/warmup_restart.py [TENANTS]
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

FACTS = "Our refund window is {d} days; shipping to zone {z} takes {s} days; support answers within {h} hours. "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hotprefix", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def warm(url: str, prompts: list[str]) -> float:
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        r = httpx.post(url + "/pin", json={"messages": [{"role": "system", "content": p}],
                                           "cache_salt": f"tenant-{i}"}, timeout=600)
        assert r.status_code == 200, r.text
    return time.perf_counter() - t


def cached_by_source(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"\} ([0-9.e+]+)', text)}


def main(tenants: int = 8) -> None:
    prompts = [f"You are the assistant of tenant {t}. " + "".join(
        FACTS.format(d=(t * 7 + i) % 60, z=i, s=(t + i) % 9, h=(t * i) % 48) for i in range(40))
        for t in range(tenants)]
    args = ["--kv-disk-dir", tempfile.mkdtemp(), "--max-model-len", "2048", "--max-pinned-fraction", "0.6"]
    for run in ("first start (empty disk)", "restart (disk tier warm)"):
        t0 = time.perf_counter()
        proc, url = start(args)
        up = time.perf_counter() - t0
        took = warm(url, prompts)
        print(json.dumps({"run": run, "tenants": tenants, "server_start_s": round(up, 2), "warmup_s": round(took, 2),
                          "cached_tokens_by_source": cached_by_source(url)}))
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
    os._exit(0)
