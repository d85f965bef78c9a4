"""/v1/completions/render and /v1/chat/completions/render: the token ids a request would
run, as vLLM's render endpoints answer them; a router that hashes them hashes exactly the
blocks the engine then caches (the operator's forced turn, tools and template applied)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import build_tiny_model
from tests.server.conftest import start_server

FORCED = {"role": "system", "content": "Be brief."}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-long")
    build_tiny_model(folder, "llama", max_position_embeddings=1024)  # (tools render long on a byte tokenizer)
    s = start_server(folder)
    yield s
    s.stop()


def cached(server, ids: list[int]) -> bool:
    """Whether every full block of ids is in the server's pool."""
    hashes = server.async_engine.prefix_hashes(ids)
    return server.on_engine(lambda e: all(e.kv.pool.lookup(h) is not None for h in hashes))


def test_a_chat_renders_to_the_ids_the_engine_runs_and_caches(server):
    body = {"model": "tiny", "messages": [FORCED, {"role": "user", "content": "The quick brown fox."}],
            "operator_messages": 1, "tools": [TOOL], "max_tokens": 3, "temperature": 0}
    r = httpx.post(server.v1 + "/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert set(rendered) == {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                             "stream_options", "cache_salt", "priority", "kv_transfer_params"}
    ids = rendered["token_ids"]
    assert rendered["sampling_params"]["max_tokens"] == 3 and rendered["model"] == "tiny"
    assert server.async_engine.num_unfinished == 0  # nothing was queued
    assert not cached(server, ids)
    answer = httpx.post(server.v1 + "/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == len(ids) >= 2 * server.engine.kv.block_size
    assert cached(server, ids)  # the blocks a router hashes from the render are the ones the engine cached
    without_tools = httpx.post(server.v1 + "/chat/completions/render",
                               json={**body, "tools": None}).json()["token_ids"]
    assert without_tools != ids  # the tools are part of what runs


def test_completions_render_one_per_prompt_truncated_as_generation_is(server):
    texts = ["one two three four", "caching keys and values"]
    body = {"model": "tiny", "prompt": texts, "max_tokens": 2, "truncate_prompt_tokens": 3, "cache_salt": "s1"}
    r = httpx.post(server.v1 + "/completions/render", json=body)
    assert r.status_code == 200, r.text
    rendered = r.json()
    tokenized = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert [x["token_ids"] for x in rendered] == [ids[-3:] for ids in tokenized]
    assert [x["cache_salt"] for x in rendered] == ["s1", "s1"]
    ids = httpx.post(server.v1 + "/completions/render", json={"model": "tiny", "prompt": [5, 6, 7]}).json()
    assert [x["token_ids"] for x in ids] == [[5, 6, 7]]


def test_render_refuses_what_generation_refuses(server):
    bad = httpx.post(server.v1 + "/completions/render", json={"model": "tiny", "prompt": [10**9], "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    missing = httpx.post(server.v1 + "/chat/completions/render", json={"model": "other", "messages": [FORCED]})
    assert missing.status_code == 404
