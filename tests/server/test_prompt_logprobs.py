"""Prompt logprobs, as loglikelihood evaluation (lm-evaluation-harness's
local-completions: `echo`, `logprobs`, `max_tokens: 0`) and vLLM's `prompt_logprobs`
use them: each prompt token's logprob against transformers' on the tiny model, over
chunked prefill; from the prefix cache only with the logprobs kept with its blocks."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.server.conftest import start_server

PROMPT = "the cache keeps the keys and the values of every block it has seen before"


@pytest.fixture(scope="module")
def srv(tiny_llama):
    s = start_server(tiny_llama[0], max_model_len=128, block_size=4, max_num_batched_tokens=8)  # 8-token chunks
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(srv, tiny_llama):
    """transformers' logprob of each prompt token given those before it, [L-1], and its log-softmax rows."""
    ids = srv.engine.tokenize(PROMPT)
    with torch.no_grad():
        rows = torch.log_softmax(tiny_llama[1](torch.tensor([ids])).logits[0].float(), -1)  # [L, V]
    return ids, rows


def test_echo_with_max_tokens_0_is_the_prompt_with_its_logprobs(srv, reference):
    ids, rows = reference
    assert len(ids) > 16  # several chunks of 8
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    srv.on_engine(lambda e: e.reset_prefix_cache())
    seen = []
    # the second time the prompt's blocks are cached with the logprobs their positions give: every full
    # block is a hit (the last token is computed), and the logprobs are the same bits
    for cached in (0, (len(ids) - 1) // 4 * 4):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                      temperature=0)
        c = r.choices[0]
        assert c.text == PROMPT and c.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens_details.cached_tokens == cached
        lp = c.logprobs
        seen.append((lp.token_logprobs, lp.top_logprobs))
        assert lp.tokens == [srv.async_engine.token_text(t) for t in ids] and lp.token_logprobs[0] is None
        want = rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor(lp.token_logprobs[1:])
        assert float((got - want).abs().max()) < 1e-4
        for pos in (1, len(ids) - 1):  # the two most likely next tokens, as transformers ranks them
            top = torch.topk(rows[pos - 1], 2)
            assert [srv.async_engine.token_text(int(t)) for t in top.indices] == list(lp.top_logprobs[pos])
    assert seen[0] == seen[1]
    srv.check_drained()


def test_echo_then_generated_tokens_and_prompt_logprobs_in_vllms_shape(srv, reference):
    ids, rows = reference
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0,
            "ignore_eos": True, "prompt_logprobs": 1}
    c = httpx.post(srv.v1 + "/completions", json=body, timeout=60).json()["choices"][0]
    assert len(c["logprobs"]["tokens"]) == len(ids) + 3 and c["text"].startswith(PROMPT)
    assert all(isinstance(x, float) for x in c["logprobs"]["token_logprobs"][len(ids):])
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos in (1, 5, len(ids) - 1):
        entry = plp[pos][str(ids[pos])]
        want = rows[pos - 1]
        assert abs(entry["logprob"] - float(want[ids[pos]])) < 1e-4
        assert entry["rank"] == int((want > want[ids[pos]]).sum()) + 1
        assert str(int(want.argmax())) in plp[pos]  # the most likely token is shown beside it
    chat = httpx.post(srv.v1 + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    plp = chat.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])  # the prompt token alone
    srv.check_drained()


@pytest.mark.parametrize("path,body,param", [
    ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
])
def test_what_cannot_be_honoured_is_a_400(srv, path, body, param):
    r = httpx.post(srv.v1 + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_on_the_default_models_int8_head_is_the_score_of_its_logits(monkeypatch):
    """The default model's int8 head scores an echoed prompt without making the logits
    (kernels/scores.score_head): over HTTP, through the openai client, the logprobs, ranks' top
    tokens and text of the logits path (the same engine scoring from logits, in process) to
    float rounding."""
    from hotprefix.engine.llm import LLM
    from hotprefix.model import scoring
    from hotprefix.model.default_model import default_model_path
    from hotprefix.sampling_params import SamplingParams

    prompt = PROMPT * 12  # ~200 tokens: two AMX tiles of positions and more
    with monkeypatch.context() as m:
        m.setattr(scoring.PromptScorer, "on_head", lambda self, hidden: False)
        llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False)
        ids = llm.engine.tokenize(prompt)
        (ref,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))
        llm.close()
    s = start_server(default_model_path())
    try:
        assert s.engine.runner.scorer.on_head(torch.zeros(1, 1))  # the server scores on its head
        client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt and len(lp.token_logprobs) == len(ids) > 160
        want = [e.sampled.logprob for e in ref.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-4
        for pos, e in enumerate(ref.prompt_logprobs[1:], 1):
            assert list(lp.top_logprobs[pos]) == [s.async_engine.token_text(a.token_id) for a in e.top]
        assert s.engine.runner.scorer.buffer is None  # no logits were made
        s.check_drained()
    finally:
        s.stop()
