"""What publishing KV events and being scraped every 50 ms cost, on the default model.

Engines (in-process, one process, one model file): the same work on an engine with
--kv-events-config on (a subscriber connected and draining, so every batch is encoded
and sent) and one with it off, interleaved rep by rep (the order alternating): decode
throughput (8 sequences, 64 tokens each, tokens/s over the decode steps) and cold TTFT
(a fresh 1,000-token prompt, no cache hit). Then the server (in-process, uvicorn in a
thread, --metrics-prefix vllm): the same decode batch through /v1/completions with and
without a thread scraping /metrics every 50 ms. Medians of --reps; on a shared machine
the spread between reps is printed with them.

    .venv/bin/python benchmarks/kv_events_overhead.py [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import socket
import statistics
import threading
import time

import httpx
import uvicorn
import zmq
from run_facts import report

from hotprefix import LLM, SamplingParams
from hotprefix.config import KVEventsConfig, ServerConfig
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.server.app import build_app

_ids = itertools.count()
BATCH, DECODE_TOKENS, TTFT_TOKENS = 8, 64, 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_rate(llm: LLM, rng: random.Random) -> float:
    """Tokens/s of BATCH sequences over the steps after their prefill."""
    eng, vocab = llm.engine, llm.engine.arch.vocab_size
    for _ in range(BATCH):
        eng.add_request(f"d{next(_ids)}", [rng.randrange(100, vocab) for _ in range(32)],
                        SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True))
    eng.step()  # the prefill
    t0, tokens = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        tokens += sum(len(ids) for out in eng.step() for ids in out.new_token_ids)
    return tokens / (time.perf_counter() - t0)


def cold_ttft(llm: LLM, rng: random.Random) -> float:
    eng, vocab = llm.engine, llm.engine.arch.vocab_size
    t0 = time.perf_counter()
    eng.add_request(f"t{next(_ids)}", [rng.randrange(100, vocab) for _ in range(TTFT_TOKENS)],
                    SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def drain(endpoint: str, stop: threading.Event) -> int:
    """A subscriber reading every batch (the cost of sending for real); how many it got."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    n = 0
    while not stop.is_set():
        if sub.poll(100):
            sub.recv_multipart()
            n += 1
    sub.close(linger=0)
    ctx.term()
    return n


def engines(reps: int) -> dict:
    port = free_port()
    on = LLM(kv_cache_memory=512 << 20, kv_events=KVEventsConfig(enable_kv_cache_events=True,
                                                                 endpoint=f"tcp://*:{port}"))
    off = LLM(kv_cache_memory=512 << 20)
    stop, got = threading.Event(), []
    sub = threading.Thread(target=lambda: got.append(drain(f"tcp://127.0.0.1:{port}", stop)))
    sub.start()
    rng = random.Random(0)
    runs = {"decode": {"on": [], "off": []}, "ttft": {"on": [], "off": []}}
    for rep in range(reps):
        for name in (("off", "on") if rep % 2 else ("on", "off")):
            llm = on if name == "on" else off
            runs["decode"][name].append(decode_rate(llm, rng))
            runs["ttft"][name].append(cold_ttft(llm, rng))
    stop.set()
    sub.join()
    batches = on.engine.kv_events.zmq.queued
    return {**runs, "batches_published": batches, "batches_received": got[0]}


async def http_decode_rate(url: str) -> float:
    body = {"model": "m", "prompt": "Tell me a long story about caches.", "max_tokens": DECODE_TOKENS,
            "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(BATCH)))
        wall = time.perf_counter() - t0
    return sum(r.json()["usage"]["completion_tokens"] for r in rs) / wall


def scraped(reps: int) -> dict:
    llm = LLM(kv_cache_memory=512 << 20)
    port = free_port()
    cfg = ServerConfig(port=port, served_model_names=("m",), metrics_prefix="vllm", log_stats=False)
    engine = AsyncEngine(llm.engine, cfg.admission)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, cfg), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    runs, scrapes = {"on": [], "off": []}, []
    for rep in range(reps):
        for name in (("off", "on") if rep % 2 else ("on", "off")):
            stop = threading.Event()

            def scrape(stop: threading.Event = stop) -> None:
                n = 0
                with httpx.Client() as c:
                    while not stop.wait(0.05):
                        assert "vllm:num_requests_waiting" in c.get(url + "/metrics").text
                        n += 1
                scrapes.append(n)

            t = threading.Thread(target=scrape)
            if name == "on":
                t.start()
            runs[name].append(asyncio.run(http_decode_rate(url)))
            stop.set()
            if name == "on":
                t.join()
    server.should_exit = True
    return {"decode_http": runs, "scrapes": sum(scrapes)}


def summary(runs: dict[str, list[float]], higher_is_better: bool) -> dict:
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    cost = (off - on) / off if higher_is_better else (on - off) / off
    return {"on": round(on, 4), "off": round(off, 4), "cost_pct": round(100 * cost, 2),
            "spread_pct": round(100 * (max(runs["off"]) - min(runs["off"])) / off, 1), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    e = engines(a.reps)
    s = scraped(a.reps)
    report({"command": f"benchmarks/kv_events_overhead.py --reps {a.reps}",
            "events_decode_tok_s": summary(e["decode"], True), "events_cold_ttft_s": summary(e["ttft"], False),
            "events_batches": {"published": e["batches_published"], "received": e["batches_received"]},
            "scrape_50ms_decode_tok_s": summary(s["decode_http"], True), "scrapes": s["scrapes"]}, a.json)


if __name__ == "__main__":
    main()
