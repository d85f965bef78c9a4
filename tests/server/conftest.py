"""A real hotprefix server on a loopback port (uvicorn in a thread) over the tiny model."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from hotprefix.config import KEEP_ALIVE_S, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.server.app import build_app
from hotprefix.server_config import AdmissionConfig

# The test servers' --preprocess-timeout unless a test sets its own: the default 20 s was
# outlasted by a chat template on a 2-core machine at load 16 (a 400 the test did not ask for)
LOADED_PREPROCESS_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    engine: LLMEngine
    server: uvicorn.Server
    thread: threading.Thread
    async_engine: AsyncEngine

    def on_engine(self, fn, timeout: float = 30.0):
        """fn(engine) run on the server's engine thread between steps; its result."""
        ae = self.async_engine
        return asyncio.run_coroutine_threadsafe(ae.call(fn), ae._loop).result(timeout)

    def check_drained(self) -> None:
        """Nothing runs, waits or is held: no request, no queued sequence, no KV
        block (pins aside), and the scheduler's and pool's bookkeeping is whole."""
        self.wait_idle()
        ae = self.async_engine

        def check(e):
            e.scheduler.check_integrity()
            return e.has_unfinished_requests(), e.kv.pool.num_free_blocks + e.kv.num_pinned_blocks

        busy, free = self.on_engine(check)
        assert not busy and free == self.engine.kv.num_blocks
        assert ae.num_unfinished == 0 and ae.num_queued == 0
        assert self.metric("kv_cache_usage_perc") == self.engine.kv.num_pinned_blocks / self.engine.kv.num_blocks

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str) -> float:
        """The value of a hotprefix: metric (summed over label sets) from /metrics."""
        text = httpx.get(self.url + "/metrics").text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(f"hotprefix:{name}{{") or line.startswith(f"hotprefix:{name} "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"no metric {name}"
        return total

    def wait_idle(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.metric("num_requests_running") == 0 and self.metric("num_requests_waiting") == 0:
                return
            time.sleep(0.05)
        raise AssertionError("the server did not become idle")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(folder, server_kw=None, **engine_kw) -> LiveServer:
    cache = {k: engine_kw.pop(k) for k in list(engine_kw) if k in CacheConfig.__dataclass_fields__}
    sched = {k: engine_kw.pop(k) for k in list(engine_kw) if k in SchedulerConfig.__dataclass_fields__}
    cache.setdefault("num_blocks_override", 256)
    cfg = EngineConfig(ModelConfig(model=str(folder), **engine_kw), CacheConfig(**cache), SchedulerConfig(**sched))
    engine = LLMEngine(cfg)
    port = free_port()
    server_kw = {"admission": AdmissionConfig(preprocess_timeout=LOADED_PREPROCESS_S), **(server_kw or {})}
    scfg = ServerConfig(port=port, served_model_names=("tiny",), **server_kw)
    async_engine = AsyncEngine(engine, scfg.admission)
    app = build_app(async_engine, scfg)
    url, server, thread = serve_in_thread(app, port)
    return LiveServer(url, engine, server, thread, async_engine)


def serve_in_thread(app, port: int | None = None) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Run an ASGI app under uvicorn on a loopback port in a daemon thread; return when it serves."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))  # as `hotprefix serve` runs it
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "server did not start"
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def live(tiny_llama) -> Iterator[LiveServer]:
    s = start_server(tiny_llama[0], max_model_len=128)
    yield s
    s.stop()


def launch_server(args: list[str], scheme: str = "http", verify=False, path: str = "/health",
                  timeout: float = 120, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m hotprefix serve ARGS --port P` as its own process, once `path` answers 200:
    (the process, its base URL). Its output is kept (stop_process returns it)."""
    port = free_port()
    if "--preprocess-timeout" not in args:
        args = [*args, "--preprocess-timeout", str(LOADED_PREPROCESS_S)]
    proc = subprocess.Popen([sys.executable, "-m", "hotprefix", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"{scheme}://127.0.0.1:{port}"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + path, verify=verify, timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def stop_process(proc: subprocess.Popen) -> str:
    """SIGTERM (SIGKILL after 30 s); the process's output."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    return proc.stdout.read()
