"""Concurrency, disconnects, the request log, SIGTERM draining, and schema fuzzing, over real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotprefix import LLM, SamplingParams
from tests.server.conftest import free_port, start_server


def test_32_concurrent_streaming_clients_get_complete_correct_outputs(live, tiny_llama):
    prompts = [f"client {i} asks about caching" for i in range(32)]
    offline = LLM(model=str(tiny_llama[0]), num_blocks_override=256)
    refs = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]

    async def one(c: openai.AsyncOpenAI, p: str) -> tuple[str, str | None]:
        s = await c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
        text, reason = "", None
        async for ch in s:
            text += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
        return text, reason

    async def main():
        c = openai.AsyncOpenAI(base_url=live.v1, api_key="x", max_retries=0)
        res = await asyncio.gather(*(one(c, p) for p in prompts))
        await c.close()
        return res

    res = asyncio.run(main())
    assert [t for t, _ in res] == refs
    assert all(r == "length" for _, r in res)
    live.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_blocks(live):
    body = {"model": "tiny", "prompt": "tell me a long story", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    before = live.metric("request_success_total")
    with httpx.stream("POST", live.v1 + "/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    # The client is gone: the request must leave the running set and hold no block.
    live.wait_idle()
    assert live.metric("kv_cache_usage_perc") == 0.0
    assert live.metric("num_requests_running") == 0
    assert live.engine.kv.pool.num_free_blocks == live.engine.kv.num_blocks
    deadline = time.monotonic() + 5
    while live.metric("request_success_total") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    text = httpx.get(live.url + "/metrics").text
    assert 'finished_reason="abort"' in text


def test_disconnect_while_waiting_for_a_non_streaming_response(live):
    body = {"model": "tiny", "prompt": "another long story", "max_tokens": 100, "ignore_eos": True}
    try:
        httpx.post(live.v1 + "/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    live.wait_idle()
    assert live.engine.kv.pool.num_free_blocks == live.engine.kv.num_blocks


def test_a_client_leaving_before_its_answer_is_an_info_line_not_an_error(live, caplog):
    """The engine is held between steps, so no answer can come before the client's
    timeout: the client goes; the server logs one INFO line per request, no error
    and no traceback (uvicorn's "Exception in ASGI application" included)."""
    uvicorn_log = logging.getLogger("uvicorn.error")  # (uvicorn's loggers do not propagate to the root)
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="hotprefix.requests")
    try:
        for path, body in (("/responses", {"input": "hi", "max_output_tokens": 50}),
                           ("/completions", {"prompt": "hi", "max_tokens": 50}),
                           ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})):
            gate, held = threading.Event(), threading.Event()

            def hold(_engine, gate=gate, held=held):
                held.set()
                gate.wait(30)

            holder = threading.Thread(target=live.on_engine, args=(hold, 60))
            holder.start()
            try:
                assert held.wait(30)
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(live.v1 + path, json={"model": "tiny", **body}, timeout=0.5)
                deadline = time.monotonic() + 10
                while not any(f"/v1{path}: the client went away" in r.getMessage() for r in caplog.records) \
                        and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                gate.set()
                holder.join(60)
        live.wait_idle()
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    gone = [r for r in caplog.records if "the client went away" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in gone] == [
        (logging.INFO, "POST /v1/responses"), (logging.INFO, "POST /v1/completions"),
        (logging.INFO, "POST /v1/chat/completions")]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert live.engine.kv.pool.num_free_blocks == live.engine.kv.num_blocks


def test_request_log_rows(tiny_llama, tmp_path):
    path = tmp_path / "requests.jsonl"
    s = start_server(tiny_llama[0], server_kw={"request_log": str(path)})
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="x")
        c.completions.create(model="tiny", prompt="hello there", max_tokens=3, extra_body={"ignore_eos": True},
                             user="alice")
        with httpx.stream("POST", s.v1 + "/completions", json={"prompt": "bye", "max_tokens": 90,
                                                                "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())
        s.wait_idle()
        deadline = time.monotonic() + 5
        while len(path.read_text().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        s.stop()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    ok = next(r for r in rows if r["status"] == "ok")
    assert ok["user"] == "alice" and ok["completion_tokens"] == 3 and ok["finish_reason"] == "length"
    assert ok["prompt_tokens"] > 0 and ok["cached_tokens"] == 0 and ok["ttft_s"] is not None
    gone = next(r for r in rows if r["status"] == "client_disconnected")
    assert gone["finish_reason"] == "abort" and gone["completion_tokens"] < 90


def test_sigterm_drains_running_requests_then_exits(tiny_llama, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hotprefix.cli", "serve", "--model", str(tiny_llama[0]),
                             "--port", str(port), "--num-gpu-blocks-override", "64", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "drain me", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        events = [first] + [x for x in rest if x]
        assert events[-1] == "data: [DONE]"
        texts = [json.loads(e[6:]) for e in events[:-1]]
        assert texts[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal after its graceful shutdown: death by SIGTERM, after the drain.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert "Shutting down" in out or "shutdown" in out.lower()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
FIELDS = ["prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
          "stream", "logprobs", "echo", "stop_token_ids", "logit_bias", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "ignore_eos", "cache_salt", "stream_options", "priority", "user",
          "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "best_of"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
       endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       valid_prompt=st.booleans())
def test_fuzzed_request_bodies_never_cause_a_5xx(live, body, endpoint, valid_prompt):
    if valid_prompt:
        body.setdefault("prompt", "fuzz")
        body.setdefault("messages", [{"role": "user", "content": "fuzz"}])
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = max(1, min(body["max_tokens"], 4))
    r = httpx.post(live.url + endpoint, json=body, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code


def test_non_finite_numbers_in_raw_json_are_refused(live):
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in ("NaN", "Infinity", "-Infinity"):
            raw = f'{{"prompt": "x", "max_tokens": 2, "{field}": {value}}}'.encode()
            r = httpx.post(live.v1 + "/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (field, value, r.text)
    raw = b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"3": NaN}}'
    assert httpx.post(live.v1 + "/completions", content=raw,
                      headers={"content-type": "application/json"}).status_code == 400
