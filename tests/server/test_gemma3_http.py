"""Gemma 3 over HTTP: a server on a tiny random Gemma 3 (tests/conftest.py: seven layers,
five local with a window of 8), from its HF folder and from a GGUF of it, answers greedy
completions with transformers' Gemma3ForCausalLM's tokens: cold, and after prefix hits
that end inside the window (4 tokens cached) and past it (24 cached), with prompts
prefilled in chunks of 8 tokens over blocks of 4."""

from __future__ import annotations

import openai
import pytest
import torch

from hotprefix.cachecurve.request import SimRequest
from hotprefix.tools.cache_sim import replay
from hotprefix.tools.lint import read_requests
from tests.conftest import build_tiny_model
from tests.gguf_util import write_gguf
from tests.model.test_gemma3 import hf_greedy
from tests.server.conftest import start_server

NEW = 10


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers model, {"hf": its folder, "gguf": an F32 GGUF of it}). The query scale
    is head_dim's: GGUF has no key for it (llama.cpp takes head_dim's)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("gemma3-http")
    hf = build_tiny_model(d / "hf", "gemma3", seed=6, query_pre_attn_scalar=32)
    gguf = write_gguf(d / "tiny-gemma3-F32.gguf", hf, AutoTokenizer.from_pretrained(str(d / "hf")), "F32",
                      arch="gemma3")
    return hf, {"hf": d / "hf", "gguf": gguf}


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_completions_and_prefix_hits_are_transformers_tokens(gemma, source, tmp_path):
    hf, paths = gemma
    log = tmp_path / "requests.jsonl"
    live = start_server(paths[source], server_kw={"return_tokens_as_token_ids": True, "request_log": str(log)},
                        block_size=4, max_num_batched_tokens=8)
    try:
        client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)
        g = torch.Generator().manual_seed(12)
        base = torch.randint(3, 320, (30,), generator=g).tolist()
        for keep, cached in ((0, 0), (6, 4), (26, 24)):
            prompt = base[:keep] + torch.randint(3, 320, (5,), generator=g).tolist() if keep else base
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True})
            tokens = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
            assert tokens == hf_greedy(hf, prompt, NEW), (source, keep)
            assert r.usage.prompt_tokens_details.cached_tokens == cached, (source, keep)
        live.check_drained()
    finally:
        live.stop()
    # the request log says the pool's groups, and lint's replay of the grouped pool finds the hits the server did
    data = read_requests(log)
    assert data.size.windows == (None,) + (8,) * 6 and data.size.retain_every == 4096
    sims = [SimRequest([bytes.fromhex(h) for h in e.blocks], e.tokens, e.completion) for e in data.entries]
    assert replay(sims, 4, data.size).hits == [e.cached for e in data.entries] == [0, 4, 24]
