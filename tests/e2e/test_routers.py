"""Real routers from the package index in front of two `hotprefix serve` processes,
driven by the openai client: vllm-router with its cache-aware policy (a radix tree of
the text it routed) and with its kv_aware policy (hotprefix's KV events and render
endpoint: the router recomputes vLLM's block hashes from the rendered tokens and finds
them in the events), and sglang-router's cache-aware policy. Requests are answered, a
prefix's second request lands where its blocks are (cached_tokens), and a killed
backend is routed around."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import zmq

from tests.gateway.conftest import wait_until
from tests.server.conftest import free_port, launch_server, stop_process

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # (the routers colour their logs even into a pipe)


def events(port: int, replay: int) -> str:
    """--kv-events-config with vLLM's default topic "" (vllm-router's static sources
    subscribe to that one; llm-d's are named kv@<pod>@<model>)."""
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{replay}"})


@pytest.fixture(scope="module")
def workers(tiny_llama):
    """Two hotprefix servers on the tiny model, each publishing KV events:
    [(process, url, events endpoint, replay endpoint)]."""
    out = []
    for _ in range(2):
        ev, rp = free_port(), free_port()
        proc, url = launch_server(["--model", str(tiny_llama[0]), "--served-model-name", "tiny",
                                   "--kv-events-config", events(ev, rp)])
        out.append((proc, url, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"))
    yield out
    for proc, *_ in out:
        if proc.poll() is None:
            stop_process(proc)


class Router:
    """A router process and the lines it has printed (read by a thread as they come)."""

    def __init__(self, args: list[str]) -> None:
        port = free_port()
        self.proc = subprocess.Popen([*args, "--port", str(port), "--prometheus-port", str(free_port())],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + 120
        while time.monotonic() < end:
            assert self.proc.poll() is None, "".join(self.lines)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError("the router did not come up")

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(ANSI.sub("", line))
                self._seen.notify_all()

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        """Until the router prints a line containing needle."""
        with self._seen:
            if not self._seen.wait_for(lambda: any(needle in line for line in self.lines), timeout):
                raise AssertionError(f"the router never printed {needle!r}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def last_sequence(replay: str) -> int:
    """The newest batch a worker has sent (asked of its replay socket, which answers after
    sending what was queued before the question)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(replay)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        last = -1
        while True:
            assert sock.poll(30_000)
            _, seq, payload = sock.recv_multipart()
            if payload == b"":
                return last
            last = int.from_bytes(seq, "big")
    finally:
        sock.close(linger=0)
        ctx.term()


def vllm_router(workers, policy: str, tokenizer: Path) -> list[str]:
    args = [str(BIN / "vllm-router"), "--policy", policy, "--worker-urls", *(w[1] for w in workers),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "debug"]
    if policy == "kv_aware":
        for _, url, ev, rp in workers:
            args += ["--kv-event-source", f"{url}={ev}", "--kv-event-replay-source", f"{url}={rp}"]
        args += ["--kv-event-block-size", "16", "--kv-event-model", str(tokenizer)]
    return args


NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def prompt(tenant: int) -> str:
    """A tenant's shared text: its first character already differs from every other's."""
    name = NAMES[tenant % len(NAMES)]
    return " ".join(f"{name}{tenant}w{i}" for i in range(20))


def served(workers) -> list[float]:
    """Each worker's finished requests (hotprefix:request_success_total, summed)."""
    out = []
    for _, url, *_ in workers:
        text = httpx.get(url + "/metrics").text
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("hotprefix:request_success_total")))
    return out


def ask(client: openai.OpenAI, workers, text: str) -> tuple[int, int]:
    """A completion through the router: (the worker that served it, its cached prompt tokens)."""
    before = served(workers)
    r = client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"
    (which,) = [i for i, (a, b) in enumerate(zip(before, served(workers))) if b > a]
    return which, r.usage.prompt_tokens_details.cached_tokens


def check_affinity(url: str, workers, tenants: int = 4) -> list[int]:
    """Each tenant's second request lands on the worker that served its first, and
    finds its blocks there. Returns where the firsts went."""
    for _, worker, *_ in workers:  # (the module's workers served other routers' tests before)
        assert httpx.post(worker + "/reset_prefix_cache").status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    firsts = []
    for t in range(tenants):
        where, cached = ask(client, workers, prompt(t) + " first")
        assert cached == 0
        again, cached = ask(client, workers, prompt(t) + " second")
        assert again == where and cached >= 48  # (the shared words fill several whole blocks)
        firsts.append(where)
    return firsts


def test_vllm_router_cache_aware_keeps_a_prefix_where_its_blocks_are(workers, tiny_llama):
    router = Router(vllm_router(workers, "cache_aware", tiny_llama[0]))
    try:
        check_affinity(router.url, workers)
    finally:
        router.stop()


def test_vllm_router_kv_aware_finds_blocks_through_the_kv_events(workers, tiny_llama):
    """Each prefix is computed on one worker directly, behind the router's back: only the
    events tell the router where its blocks are."""
    router = Router(vllm_router(workers, "kv_aware", tiny_llama[0]))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    try:
        for t in range(4):
            home = t % 2
            _, url, _, replay = workers[home]
            direct = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            direct.completions.create(model="tiny", prompt=prompt(100 + t) + " first", max_tokens=2)
            router.wait_for(f'source={url} rank=0 seq={last_sequence(replay)}')  # the router has the batch
            where, cached = ask(client, workers, prompt(100 + t) + " second")
            assert where == home and cached >= 48
    finally:
        router.stop()


@pytest.mark.skipif(shutil.which("sglang-router", path=str(BIN)) is None, reason="sglang-router is not installed")
def test_sglang_router_cache_aware_keeps_a_prefix_where_its_blocks_are(workers):
    router = Router([str(BIN / "sglang-router"), "launch", "--policy", "cache_aware",
                     "--worker-urls", *(w[1] for w in workers)])
    try:
        check_affinity(router.url, workers)
    finally:
        router.stop()


def test_a_killed_backend_is_routed_around(workers, tiny_llama):
    router = Router(vllm_router(workers, "cache_aware", tiny_llama[0]))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    try:
        victim = workers[0][0]
        victim.kill()
        victim.wait()
        wait_until(lambda: any(w["url"] == workers[0][1] and not w["is_healthy"]
                               for w in httpx.get(router.url + "/workers").json()["workers"]),
                   timeout=60, what="the router's health check to mark the killed backend")
        for t in range(6):  # every request is answered, by the survivor
            assert ask(client, workers[1:], prompt(10 + t))[0] == 0
    finally:
        router.stop()

