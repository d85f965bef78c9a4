"""The endpoints and fields vLLM's clients use beside completions: /v1/models/{id}
(the openai client's models.retrieve), /ping, /load, and OpenAI fields that cannot
change a result here (reasoning_effort, metadata, ...) accepted and logged once."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def test_a_model_is_retrieved_by_its_id(live, client):
    m = client.models.retrieve("tiny")
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "hotprefix")
    assert m.model_dump()["max_model_len"] == live.engine.max_model_len
    r = httpx.get(live.v1 + "/models/other")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "the model 'other' does not exist; this server serves tiny",
                                 "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_ping_and_load(live):
    assert httpx.get(live.url + "/ping").status_code == 200 and httpx.post(live.url + "/ping").status_code == 200
    assert httpx.get(live.url + "/load").json() == {"server_load": 0}
    gate, held = threading.Event(), threading.Event()

    def hold(_engine):  # the engine thread waits here, between steps, until the gate opens
        held.set()
        gate.wait(30)

    holder = threading.Thread(target=live.on_engine, args=(hold, 60))
    holder.start()
    assert held.wait(30)
    answer: list = []
    asker = threading.Thread(target=lambda: answer.append(httpx.post(live.v1 + "/completions", timeout=60, json={
        "prompt": "count", "max_tokens": 4, "ignore_eos": True})))
    asker.start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(live.url + "/load").json()["server_load"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(live.url + "/load").json() == {"server_load": 1}  # admitted, waiting on the engine
    finally:
        gate.set()
        holder.join(60)
        asker.join(60)
    assert answer[0].status_code == 200
    live.wait_idle()
    assert httpx.get(live.url + "/load").json() == {"server_load": 0}


def test_fields_that_cannot_change_a_result_are_accepted_and_logged_once(live, client, caplog):
    caplog.set_level(logging.INFO, logger="hotprefix.requests")
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**ask).choices[0].message.content
    for effort in ("low", "high"):
        r = client.chat.completions.create(**ask, reasoning_effort=effort, metadata={"trace": "x"}, store=False,
                                           service_tier="auto")
        assert r.choices[0].message.content == plain
    notes = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert sorted(n.split()[2] for n in notes) == ["metadata", "reasoning_effort", "service_tier", "store"]
    too_long = httpx.post(live.v1 + "/chat/completions", json={**{k: v for k, v in ask.items() if k != "extra_body"},
                                                              "reasoning_effort": "x" * 100})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "reasoning_effort"


def test_vllms_metric_names_under_its_prefix(tiny_llama):
    from tests.server.conftest import start_server

    s = start_server(tiny_llama[0], server_kw={"metrics_prefix": "vllm"}, max_model_len=128)
    try:
        body = {"prompt": "one two three", "max_tokens": 5, "n": 2, "ignore_eos": True, "temperature": 0}
        r = httpx.post(s.v1 + "/completions", json=body).json()
        r2 = httpx.post(s.v1 + "/completions", json=body).json()  # the second hits the cached prefix
        echo = httpx.post(s.v1 + "/completions", json={"prompt": "one two", "max_tokens": 0, "echo": True})
        assert echo.status_code == 200, echo.text
        text = httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0] + ("" if "le=" not in name else "{" + name.split("le=")[1])] = float(value)
    assert values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"]
    hits, queries = values["vllm:prefix_cache_hits_total"], values["vllm:prefix_cache_queries_total"]
    assert queries > 0 and values["vllm:gpu_prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    assert values["vllm:request_params_n_sum"] == 5 and values["vllm:request_params_n_count"] == 3
    assert values["vllm:request_params_max_tokens_sum"] == 10  # 5 + 5 + 0: the echo asked for no tokens
    prompt = r["usage"]["prompt_tokens"]
    generated = r["usage"]["completion_tokens"] + r2["usage"]["completion_tokens"]
    assert generated == 20
    # every token run through the model, in steps: prefill (the first prompt, the second's uncached
    # rest, recomputed) and decode; at least the new prompt tokens and every generated one but the last
    run = values["vllm:iteration_tokens_total_sum"]
    assert run >= prompt + generated - 4 and values["vllm:iteration_tokens_total_count"] >= 5
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "time_per_output_token_seconds", "request_queue_time_seconds"):
        assert values[f"vllm:{name}_count"] > 0, name
    assert values["vllm:request_inference_time_seconds_count"] == 3  # one a request
