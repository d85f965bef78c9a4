"""Budgets in the gateway: the ledger's arithmetic, its two stores deciding alike, a
concurrent burst that never spends past a budget (in memory, on Redis, across two
gateways), money budgets at a price table, model lists, and spend reports."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import httpx
import pytest

from hotprefix.config import ConfigError
from hotprefix.gateway.budgets import (
    Budget,
    MemoryLedger,
    Price,
    PriceTable,
    RedisLedger,
    Scope,
    parse_duration,
)
from hotprefix.gateway.ratelimit import MemoryLimiter, RedisLimiter
from hotprefix.gateway.store import Store
from tests.gateway.conftest import ADMIN, SECRET, start_fake, start_gateway, tenant_store, wait_until

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
PRICES = PriceTable.from_dict({"fake-model": {"input": 1000, "cached_input": 500, "output": 2000}})


@pytest.fixture
def store(tmp_path) -> Store:
    return tenant_store(tmp_path)  # acme (a private prompt) and beta


# -- the ledger -------------------------------------------------------------------------------


def test_durations_and_price_tables_are_checked():
    assert [parse_duration(x) for x in ("30s", "1h", "1d", "30d", None)] == [30, 3600, 86400, 30 * 86400, None]
    for bad in ("0d", "1w", "-1h", "400d", "1.5h", "h"):
        with pytest.raises(ConfigError, match="budget_duration"):
            parse_duration(bad)
    with pytest.raises(ConfigError, match="needs input and output"):
        PriceTable.from_dict({"m": {"input": 1}})
    with pytest.raises(ConfigError, match="numbers >= 0"):
        PriceTable.from_dict({"m": {"input": -1, "output": 1}})
    t = PriceTable.from_dict({"m": {"input": 1, "output": 2}, "*": {"input": 3, "output": 4}})
    assert t.get("m").cached_input == 1 and t.get("other") == Price(3, 3, 4)
    assert Price(1000, 500, 2000).cost_micros(100, 40, 10) == 60 * 1000 + 40 * 500 + 10 * 2000
    with pytest.raises(ConfigError, match="max_budget_tokens"):
        Budget(tokens=0)


def test_the_memory_ledger_grants_what_fits_and_settles_to_what_was_used():
    now = [1_000_000.0]
    led = MemoryLedger(clock=lambda: now[0])
    key = [Scope("key:k", Budget(tokens=100, duration_s=3600))]

    async def go():
        a = await led.reserve(key, want=60, least=11, prompt=10, price=None)
        b = await led.reserve(key, want=60, least=11, prompt=10, price=None)  # 40 left: cut to 40
        c = await led.reserve(key, want=60, least=11, prompt=10, price=None)  # nothing left
        await led.settle(a.reservation, 15, 0)  # a used 15 of its 60: 45 back
        d = await led.reserve(key, want=60, least=11, prompt=10, price=None)
        now[0] += 3600  # the next period: a fresh budget
        e = await led.reserve(key, want=60, least=11, prompt=10, price=None)
        return a, b, c, d, e, await led.spent(key)

    a, b, c, d, e, spent = asyncio.run(go())
    assert (a.granted, b.granted, c.admitted, d.granted, e.granted) == (60, 40, False, 45, 60)
    assert c.refused_by == "key:k (tokens)" and c.resets_in == pytest.approx(3600 - 1_000_000 % 3600)
    assert spent["key:k"]["tokens_spent"] == 60


def test_a_money_budget_cuts_the_completion_to_what_the_money_allows():
    led = MemoryLedger()
    price = Price(1000, 500, 2000)  # micro-units per token
    scopes = [Scope("key:k", Budget(money=0.1)), Scope("tenant:t", Budget(tokens=10_000))]

    async def go():
        first = await led.reserve(scopes, want=1000, least=11, prompt=10, price=price)
        return first, await led.spent(scopes)

    first, spent = asyncio.run(go())
    # 0.1 = 100,000 micro-units: the prompt takes 10,000, leaving 45 completion tokens at 2,000
    assert first.granted == 55 and first.reservation.micros == 100_000
    assert spent["key:k"]["spend"] == pytest.approx(0.1) and spent["tenant:t"]["tokens_spent"] == 55


def test_memory_and_redis_ledgers_decide_alike(redis_url):
    price = Price(1000, 500, 2000)
    seq = [(300, 21, 20), (300, 21, 20), (5000, 11, 10), (80, 11, 10), (80, 11, 10)]

    async def run(led) -> list[tuple[bool, int]]:
        pre = uuid.uuid4().hex[:8]
        scopes = [Scope(f"key:{pre}", Budget(tokens=600, duration_s=86400)),
                  Scope(f"tenant:{pre}", Budget(money=0.9, duration_s=86400))]
        out = []
        for want, least, prompt in seq:
            d = await led.reserve(scopes, want, least, prompt, price)
            out.append((d.admitted, d.granted, d.refused_by and d.refused_by.split(" ")[1]))
        await led.close()
        return out

    mem = asyncio.run(run(MemoryLedger()))
    red = asyncio.run(run(RedisLedger(redis_url, prefix=f"t{uuid.uuid4().hex[:6]}:")))
    assert mem == red
    # 600 tokens and 0.9 = 900,000 micro-units: the 1st takes 300 tokens (580,000), the 2nd is cut to what
    # the money allows (20 + 150 tokens: 320,000), then not even the prompt of the next ones fits
    assert mem == [(True, 300, None), (True, 170, None)] + [(False, 0, "(money)")] * 3


# -- through the gateway ----------------------------------------------------------------------------


def burst(urls: list[str], key: str, n: int, model: str = "fake-model") -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(
                c.post(urls[i % len(urls)] + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "prompt": f"question {i}", "max_tokens": 40}) for i in range(n)))
    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["memory", "two_gateways_one_redis"])
def test_a_burst_never_spends_past_the_key_or_tenant_budget(store, mode, request):
    key, rec = store.create_key(SECRET, "acme")
    store.set_budget(key_id=rec.id, tokens=1500, duration="1d")
    store.set_budget(tenant="acme", money=5.0, duration="30d")  # 1,500 tokens cost at most 3.0: the key binds
    fake = start_fake()
    if mode == "memory":
        stores = [(MemoryLimiter(), MemoryLedger())]
    else:
        url, pre = request.getfixturevalue("redis_url"), f"g{uuid.uuid4().hex[:8]}:"
        stores = [(RedisLimiter(url, prefix=pre), RedisLedger(url, prefix=pre + "budget:")) for _ in range(2)]
    gws = [start_gateway([fake.url], store, warmup=False, limiter=lim, ledger=led, prices=PRICES)
           for lim, led in stores]
    try:
        for gw in gws:
            wait_until(lambda gw=gw: httpx.get(gw.url + "/health").status_code == 200, what="gateway")
        got = burst([gw.url for gw in gws], key, 60)
        codes = [r.status_code for r in got]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
        refusals = [r.json()["error"] for r in got if r.status_code == 429]
        assert all(f"the budget of key:{rec.id} (tokens) is spent" in e["message"] and e["type"] == "RateLimitError"
                   for e in refusals)
        sent = [r for r in fake.app.state.records if r["endpoint"] == "completions"]
        # what the backend was allowed to do never passes the budget
        assert sum(r["usage"]["prompt_tokens"] + r["body"]["max_tokens"] for r in sent) <= 1500
        wait_until(lambda: all(r.status != "started" for r in store.usage_rows()) and
                   len(store.usage_rows()) == 60, what="usage rows")
        used = sum(r.prompt_tokens + r.completion_tokens for r in store.usage_rows() if r.status == "ok")
        spent = {b["scope"]: b for b in httpx.get(gws[0].url + "/admin/budgets", headers=ADMIN_H).json()["data"]}
        assert spent[f"key:{rec.id}"]["tokens_spent"] == used <= 1500
        cost = sum(PRICES.get("fake-model").cost_micros(r.prompt_tokens, r.cached_tokens,
                                                        r.completion_tokens)
                   for r in store.usage_rows() if r.status == "ok")
        assert spent["tenant:acme"]["spend"] == pytest.approx(cost / 1e6) and cost <= 5_000_000
    finally:
        for gw in gws:
            gw.stop()
        fake.stop()


def test_a_client_that_vanishes_mid_stream_is_charged_what_it_received(store):
    """The stream's reservation (prompt + max_tokens) is settled to the usage the gateway
    saw before the client went away: the budgets hold exactly the usage row's tokens and
    cost, and the rest of the budget is free again."""
    key, rec = store.create_key(SECRET, "acme")
    store.set_budget(key_id=rec.id, tokens=1000, duration="1d")
    store.set_budget(tenant="acme", money=5.0, duration="30d")
    fake = start_fake()
    gw = start_gateway([fake.url], store, warmup=False, prices=PRICES)
    try:
        wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, what="gateway")
        with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30, headers={
                "Authorization": f"Bearer {key}"}, json={"model": "fake-model", "stream": True, "max_tokens": 400,
                                                          "messages": [{"role": "user", "content": "HOLD:3 go"}]}) as r:
            got = []
            for line in r.iter_lines():
                got += [line] if line.startswith("data: ") else []
                if len(got) == 3:
                    break
        wait_until(lambda: [x.status for x in store.usage_rows(rec.id)] == ["client_aborted"], what="the row")
        (row,) = store.usage_rows(rec.id)
        assert row.completion_tokens == 3
        spent = {b["scope"]: b for b in httpx.get(gw.url + "/admin/budgets", headers=ADMIN_H).json()["data"]}
        assert spent[f"key:{rec.id}"]["tokens_spent"] == row.prompt_tokens + 3  # not the 400 reserved
        cost = PRICES.get("fake-model").cost_micros(row.prompt_tokens, row.cached_tokens, 3)
        assert spent["tenant:acme"]["spend"] == pytest.approx(cost / 1e6)
        # what was reserved for the abandoned stream is free again: a request for the rest is granted whole
        left = 1000 - spent[f"key:{rec.id}"]["tokens_spent"]
        ok = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": "fake-model", "prompt": "x", "max_tokens": left - 200})
        assert ok.status_code == 200, ok.text
        assert fake.app.state.records[-1]["body"]["max_tokens"] == left - 200  # (200: room for the prompt bound)
    finally:
        gw.stop()
        fake.stop()


def test_money_budgets_models_and_spend_reports(store, tmp_path):
    key, rec = store.create_key(SECRET, "acme")
    fake = start_fake()
    gw = start_gateway([fake.url], store, warmup=False, prices=PRICES)
    try:
        wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, what="gateway")
        r = httpx.put(gw.url + f"/admin/keys/{rec.id}/budget", headers=ADMIN_H,
                      json={"max_budget": 0.25, "budget_duration": "1d", "models": ["fake-model", "unpriced"]})
        assert r.status_code == 200 and r.json()["models"] == ["fake-model", "unpriced"]
        assert httpx.put(gw.url + f"/admin/keys/{rec.id}/budget", headers=ADMIN_H,
                         json={"budget_duration": "1w"}).status_code == 400
        h = {"Authorization": f"Bearer {key}"}
        other = httpx.post(gw.url + "/v1/completions", headers=h, json={"model": "gpt-x", "prompt": "hi"})
        unpriced = httpx.post(gw.url + "/v1/completions", headers=h, json={"model": "unpriced", "prompt": "hi"})
        codes = [httpx.post(gw.url + "/v1/completions", headers=h, timeout=30,
                            json={"model": "fake-model", "prompt": "hello there", "max_tokens": 20}).status_code
                 for _ in range(12)]
        by_model = httpx.get(gw.url + "/admin/usage", headers=ADMIN_H, params={"group_by": "model"}).json()["data"]
    finally:
        gw.stop()
        fake.stop()
    assert other.status_code == 403 and "may not use model 'gpt-x'" in other.json()["error"]["message"]
    assert unpriced.status_code == 400 and "no price" in unpriced.json()["error"]["message"]
    assert codes[0] == 200 and codes[-1] == 429  # 0.25 pays for a few requests, then the budget is spent
    ok = [r for r in store.usage_rows() if r.status == "ok"]
    cost = sum(PRICES.get("fake-model").cost_micros(r.prompt_tokens, r.cached_tokens, r.completion_tokens)
               for r in ok)
    assert cost <= 250_000
    row = next(r for r in by_model if r["model"] == "fake-model")
    assert row["spend"] == pytest.approx(cost / 1e6) and row["requests"] == 12
    # the same from the command line, with the price table as a file
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"fake-model": {"input": 1000, "cached_input": 500, "output": 2000}}))
    out = subprocess.run([sys.executable, "-m", "hotprefix.cli", "usage", "--by", "model", "--prices", str(prices),
                          "--database-url", store.url, "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    cli = {r["model"]: r for r in json.loads(out.stdout)}
    assert cli["fake-model"]["spend"] == pytest.approx(cost / 1e6)


def test_a_rotated_key_keeps_its_budget_and_models(store):
    _, rec = store.create_key(SECRET, "acme")
    store.set_budget(key_id=rec.id, tokens=500, money=2.5, duration="30d", models=["m1"])
    _, new = store.rotate_key(SECRET, rec.id)
    assert (new.max_budget_tokens, new.max_budget, new.budget_duration, new.models) == (500, 2.5, "30d", ("m1",))
    assert new.budget == Budget(500, 2.5, 30 * 86400)
