"""The gateway in front of a real hotprefix server (tiny model): cache isolation
between tenants, shared public prompts, warm-up and exact usage."""

from __future__ import annotations

import json

import httpx
import pytest

from hotprefix.gateway import keys as K
from hotprefix.gateway.store import Store
from tests.gateway.conftest import ADMIN, SECRET, start_gateway, wait_until, wait_warm

SYSTEM = ("You are the assistant of a company that sells garden tools. Answer questions about rakes, "
          "spades, hoes and watering cans in a short and friendly way.")
USER = "Which spade should I buy for heavy clay soil in a small garden, and why?"
BS = 16


@pytest.fixture
def store(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 'gateway.db'}")
    st.migrate()
    st.add_prompt("garden-a", SYSTEM, public=False)
    st.add_prompt("garden-b", SYSTEM, public=False)  # the same text, private to another tenant
    st.add_prompt("garden-shared", SYSTEM, public=True)
    for tenant, prompt in (("a", "garden-a"), ("b", "garden-b"), ("c", "garden-shared"), ("d", "garden-shared")):
        st.create_tenant(tenant, prompt)
    return st


def chat(gw, key, user=USER, **kw):
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": user}], "max_tokens": 2, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def tokens(server, messages, add_generation_prompt=True):
    return httpx.post(server.url + "/tokenize", json={"messages": messages,
                                                      "add_generation_prompt": add_generation_prompt}).json()["tokens"]


def test_private_prompts_never_share_cache_and_public_ones_do(logged_server, store):
    server, _ = logged_server
    httpx.post(server.url + "/reset_prefix_cache")
    gw = start_gateway([server.url], store, warmup=False)
    try:
        wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, what="gateway")
        k = {t: store.create_key(SECRET, t)[0] for t in "abcd"}
        full = tokens(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
        whole_blocks = (len(full) - 1) // BS * BS  # the most a repeat can hit (the last token is recomputed)

        first_a = chat(gw, k["a"])
        assert cached(first_a) == 0
        assert cached(chat(gw, k["a"])) == whole_blocks  # a tenant reuses its own prefix
        # b sends the very same text, with the same prompt text: nothing of a's is reused
        assert cached(chat(gw, k["b"])) == 0
        assert cached(chat(gw, k["b"])) == whole_blocks

        # public prompt: d reuses what c computed, but only the blocks before the
        # first token that depends on the user's input
        a_probe = tokens(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A"}])
        z_probe = tokens(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "z"}])
        shared = next(i for i, (x, y) in enumerate(zip(a_probe, z_probe)) if x != y)
        assert shared > BS
        assert cached(chat(gw, k["c"])) == 0
        assert cached(chat(gw, k["d"])) == shared // BS * BS < whole_blocks
        assert cached(chat(gw, k["d"])) == whole_blocks  # d's own continuation is cached for d
        # a private tenant with the same prompt text still shares nothing with the public prompt
        httpx.post(server.url + "/reset_prefix_cache")
        chat(gw, k["c"], user="something else entirely")
        assert cached(chat(gw, k["a"], user="another question")) == 0
    finally:
        gw.stop()


def test_warm_up_pins_each_prompt_on_start(logged_server, store):
    server, _ = logged_server
    httpx.post(server.url + "/reset_prefix_cache")
    gw = start_gateway([server.url], store)
    try:
        wait_warm(gw)
        k = {t: store.create_key(SECRET, t)[0] for t in "ac"}
        sys_only = tokens(server, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
        # the first request of each tenant already finds its prompt's blocks
        assert cached(chat(gw, k["a"])) == len(sys_only) // BS * BS
        assert cached(chat(gw, k["c"], user="Q")) > 0
        # pinned: a cache reset keeps them (hotprefix's /reset_prefix_cache drops only unpinned blocks)
        httpx.post(server.url + "/reset_prefix_cache")
        assert cached(chat(gw, k["a"], user="after the reset")) == len(sys_only) // BS * BS
    finally:
        gw.stop()
        system = [{"role": "system", "content": SYSTEM}]  # leave the backend as we found it
        for salt in ({"cache_salt": K.tenant_salt(SECRET, "a")}, {"cache_salt": K.tenant_salt(SECRET, "b")}, {}):
            assert httpx.post(server.url + "/unpin", json={"messages": system, **salt}).json()["unpinned_blocks"] > 0


def test_a_warm_up_the_backend_refuses_is_logged_with_its_reason(logged_server, tmp_path, caplog):
    """A prompt shorter than one block cannot be pinned: the log and the dashboard's
    last error say the backend's reason, not HTTP's generic "400 Bad Request"."""
    server, _ = logged_server
    st = Store(f"sqlite:///{tmp_path / 'short.db'}")
    st.migrate()
    st.add_prompt("tiny-prompt", "Hi.", public=True)
    st.create_tenant("t", "tiny-prompt")
    gw = start_gateway([server.url], st)
    try:
        wait_warm(gw)
        data = httpx.get(gw.url + "/admin/dashboard", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    finally:
        gw.stop()
    (backend,) = data["backends"]
    why = "HTTP 400: the prefix is shorter than one block (16 tokens)"
    assert backend["healthy"] and backend["last_error"] == f"warm-up of prompt tiny-prompt v1: {why}"
    assert [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage() and "failed" in r.getMessage()] \
        == [f"warm-up {server.url}: prompt tiny-prompt v1 failed: {why}"]


def test_usage_rows_equal_the_backend_request_log(logged_server, store):
    server, log = logged_server
    gw = start_gateway([server.url], store, warmup=False)
    try:
        wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, what="gateway")
        key, rec = store.create_key(SECRET, "c")
        before = len(log.read_text().splitlines())
        chat(gw, key)
        h = {"Authorization": f"Bearer {key}"}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=h, timeout=60,
                          json={"messages": [{"role": "user", "content": USER}], "max_tokens": 5,
                                "stream": True}) as r:
            events = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and all("usage" not in json.loads(e[6:]) for e in events[:-1])
        r = httpx.post(gw.url + "/v1/completions", headers=h, timeout=60,
                       json={"prompt": "Tell me about rakes.", "max_tokens": 3})
        assert r.status_code == 200
        wait_until(lambda: len(log.read_text().splitlines()) >= before + 3, what="the backend's request log")
        logged = [json.loads(x) for x in log.read_text().splitlines()[before:]]
        rows = store.usage_rows(rec.id)
        assert len(rows) == 3
        for row, b in zip(rows, logged):
            assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.finish_reason) == (
                b["prompt_tokens"], b["cached_tokens"], b["completion_tokens"], b["finish_reason"])
        assert [r.stream for r in rows] == [False, True, False]
    finally:
        gw.stop()
