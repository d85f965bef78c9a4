"""A mixture of experts over HTTP: the OpenAI server on a tiny Qwen3-MoE GGUF (Q4_K_M,
int8 mode, 8 experts, 2 a token) answers concurrent requests on a shared prefix, with
prefix caching and chunked prefill, bit for bit (text, tokens, top-5 logprobs) as a server
without prefix caching answers each one alone; on a tiny HF folder, a request whose router
scores are not finite gets a one-line 500 and the server goes on answering as before."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.conftest import build_tiny_model
from tests.gguf_util import write_gguf
from tests.model.test_qwen3_moe import GGUF_MOE
from tests.server.conftest import LiveServer, start_server

SHARED = "Notes on the harbour's tides, copied from the keeper's book, line by line. " * 3


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("moe-http")
    model = build_tiny_model(d / "src", "qwen3moe", seed=21, **GGUF_MOE)
    return write_gguf(d / "moe-Q4_K_M.gguf", model, AutoTokenizer.from_pretrained(str(d / "src")), "Q4_K_M",
                      arch="qwen3moe")


def bodies() -> list[dict]:
    """Eight completions on one shared prefix: greedy, and seeded sampling every third."""
    out = []
    for i in range(8):
        seeded = i % 3 == 2
        out.append({"prompt": SHARED + f"Day {i}: the water stood at", "max_tokens": 6 + i, "logprobs": 5,
                    "temperature": 0.9 if seeded else 0.0, "seed": i if seeded else None})
    return out


def ask(url: str, body: dict) -> tuple[tuple, int]:
    """(the answer: text, tokens, logprobs, top logprobs; the prompt's cached tokens)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    r = c.completions.create(model="tiny", extra_body={"ignore_eos": True}, **body)
    ch = r.choices[0]
    top = tuple(tuple(sorted(t.items())) for t in ch.logprobs.top_logprobs)
    answer = (ch.text, tuple(ch.logprobs.tokens), tuple(ch.logprobs.token_logprobs), top)
    return answer, r.usage.prompt_tokens_details.cached_tokens


def serve(path, caching: bool) -> LiveServer:
    return start_server(path, quantized_matmul="int8", enable_prefix_caching=caching, block_size=4,
                        num_blocks_override=96, max_num_batched_tokens=24)


def test_concurrent_cached_answers_are_the_answers_alone(moe_gguf):
    ref = serve(moe_gguf, caching=False)
    try:
        assert all(layer.mlp.experts.kernel.c.int8 == 1 for layer in ref.engine.runner.model.model.layers)
        alone = [ask(ref.url, b)[0] for b in bodies()]
    finally:
        ref.stop()
    assert len(set(alone)) == len(alone)  # eight different answers: nothing vacuous
    live = serve(moe_gguf, caching=True)
    try:
        first = ask(live.url, bodies()[0])  # makes the shared prefix warm
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda b: ask(live.url, b), bodies()))
        live.check_drained()
    finally:
        live.stop()
    assert first[0] == alone[0] and first[1] == 0
    assert [a for a, _ in got] == alone
    assert all(c > 0 for _, c in got)  # every request found the shared prefix in the cache


def test_a_router_producing_nan_fails_its_request_with_one_line(tmp_path):
    build_tiny_model(tmp_path, "qwen3moe", seed=22)
    live = serve(tmp_path, caching=True)
    try:
        good = {"prompt": [5, 6, 8, 9], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        want = httpx.post(live.v1 + "/completions", json=good, timeout=120).json()["choices"][0]["text"]

        def damage(engine) -> None:
            engine.runner.model.model.embed_tokens.weight.data[7] = torch.nan

        live.on_engine(damage)
        r = httpx.post(live.v1 + "/completions", json=good | {"prompt": [5, 6, 7, 8]}, timeout=120)
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "router's scores are not finite" in msg and "\n" not in msg
        again = httpx.post(live.v1 + "/completions", json=good, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
        live.check_drained()
    finally:
        live.stop()
