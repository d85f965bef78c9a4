"""A cache hit never changes an answer, over HTTP: `hotprefix serve` on the default model
with prefix caching, a pool too small for the load (evictions, preemption), chunked
prefill and a disk tier, answering concurrent clients (greedy and seeded sampling), gives
every answer, with its logprobs, bit for bit as a server without prefix caching answers
each request alone; and so does the same server after a restart, its prefixes read back
from the disk tier."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server.conftest import launch_server, stop_process

pytestmark = pytest.mark.slow
SYSTEM = ["You answer questions about the plant's shipping rules. " * 12,
          "Summaries of the maintenance log follow, one line a day. " * 14]
QUESTIONS = ["Which dock ships on Monday?", "Who signs off the batch?", "What is checked first?",
             "When does the late shift start?", "How many pallets fit a truck?", "Where are spare parts kept?"]


def requests() -> list[dict]:
    out = []
    for i, q in enumerate(QUESTIONS * 2):
        seeded = i % 3 == 2
        out.append({"prompt": SYSTEM[i % 2] + "\nQ: " + q + "\nA:", "max_tokens": 12, "logprobs": 5,
                    "temperature": 0.8 if seeded else 0.0, "seed": i if seeded else None})
    return out


def ask(client: openai.OpenAI, body: dict) -> tuple:
    r = client.completions.create(model="m", extra_body={"ignore_eos": True}, **body)
    c = r.choices[0]
    lp = c.logprobs
    top = tuple(tuple(sorted(t.items())) for t in lp.top_logprobs)
    return (c.text, tuple(lp.tokens), tuple(lp.token_logprobs), top), r.usage.prompt_tokens_details.cached_tokens


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_concurrent_cached_answers_and_a_restart_are_the_uncached_answers_alone(tmp_path):
    ref_proc, ref_url = launch_server(["--served-model-name", "m", "--no-enable-prefix-caching"])
    try:
        ref = client(ref_url)
        alone = [ask(ref, b)[0] for b in requests()]  # one at a time, no cache
    finally:
        stop_process(ref_proc)
    prompts = [b["prompt"] for b in requests()]
    assert len(set(prompts)) == 6  # each prompt asked twice, greedy twice or with two seeds
    assert alone[0] == alone[6]  # the same greedy request, the same answer
    assert len({a[2] for a in alone}) >= 6  # six prompts, six different logprobs: nothing vacuous
    args = ["--served-model-name", "m", "--num-gpu-blocks-override", "48", "--max-num-batched-tokens", "64",
            "--kv-disk-dir", str(tmp_path / "kv")]
    proc, url = launch_server(args)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda b: ask(client(url), b), requests()))
    finally:
        log = stop_process(proc)
    assert [a for a, _ in got] == alone
    assert sum(c for _, c in got) > 0, log  # some prompts did hit the cache
    proc, url = launch_server(args)  # a restart: the prefixes come back from the disk tier
    try:
        again = [ask(client(url), b) for b in requests()]
    finally:
        stop_process(proc)
    assert [a for a, _ in again] == alone
    assert again[0][1] > 0  # the first request after the restart hit the disk tier
