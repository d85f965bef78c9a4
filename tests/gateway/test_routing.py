"""Prefix-affinity routing: rendezvous ranking, bounded load, failover when a backend dies."""

from __future__ import annotations

import asyncio
import collections
import os
import signal

import httpx
import pytest

from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.monitor import BackendMonitor
from hotprefix.gateway.routing import Backend, Router, route_key
from hotprefix.gateway.store import Store
from tests.gateway.conftest import SECRET, free_port, start_fake, start_fake_process, start_gateway, wait_until


def test_rendezvous_ranking_moves_only_the_keys_of_a_removed_backend():
    urls = [f"http://b{i}:8000" for i in range(4)]
    keys = [route_key(f"prompt {i}", False, f"t{i}") for i in range(200)]
    full = Router([Backend(u, healthy=True) for u in urls])
    home = {k: full.order(k)[0].url for k in keys}
    assert set(collections.Counter(home.values())) == set(urls)  # every backend is home to some keys
    assert max(collections.Counter(home.values()).values()) < 80  # and none to most of them
    three = Router([Backend(u, healthy=u != urls[0]) for u in urls])
    for k in keys:
        new = three.order(k)[0].url
        assert new == home[k] if home[k] != urls[0] else new == full.ranking(k)[1].url


def test_public_prompts_route_together_and_private_ones_by_tenant():
    assert route_key("same text", True, "a") == route_key("same text", True, "b")
    assert route_key("same text", False, "a") != route_key("same text", False, "b")


def test_bounded_load_skips_an_overloaded_home():
    bs = [Backend(f"http://b{i}", healthy=True) for i in range(3)]
    r = Router(bs, load_factor=1.25, min_cap=1)
    k = route_key("hot tenant", False, "hot")
    home = r.order(k)[0]
    home.inflight = 4  # cap = ceil(1.25 * 5 / 3) = 3: the home is over it
    second = r.order(k)[0]
    assert second is not home and second is r.ranking(k)[1]
    assert r.order(k)[1:] == [b for b in r.ranking(k) if b is not second]  # the rest stay as failovers
    home.inflight = 2  # cap = ceil(1.25 * 3 / 3) = 2: still at the cap
    assert r.order(k)[0] is second
    home.inflight = 1  # cap = ceil(1.25 * 2 / 3) = 1
    assert r.order(k)[0] is second
    home.inflight = 0
    assert r.order(k)[0] is home
    floor = Router(bs, load_factor=1.25, min_cap=4)  # a few requests of one tenant stay with their cache
    home.inflight = 3
    assert floor.order(k)[0] is home
    home.inflight = 4
    assert floor.order(k)[0] is second
    with pytest.raises(ValueError):
        Router(bs, load_factor=0.5)
    assert Router([Backend("http://x")]).order(k) == []  # nothing healthy


def test_killing_a_backend_moves_its_tenants_to_the_others(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'gateway.db'}")
    store.migrate()
    tenants = [f"t{i}" for i in range(8)]
    keys = {}
    for t in tenants:
        store.add_prompt(t, f"You are the assistant of tenant {t}.", public=False)
        store.create_tenant(t, t)
        keys[t] = store.create_key(SECRET, t)[0]
    procs = [start_fake_process(f"b{i}") for i in range(3)]
    gw = start_gateway([u for u, _ in procs], store, warmup=False, health_interval=0.2)
    try:
        wait_until(lambda: all(b.healthy for b in gw.app.state.router.backends), what="backends up")

        def run_round() -> dict[str, str]:
            where = {}
            for t in tenants:
                for _ in range(2):
                    r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {keys[t]}"},
                                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=30)
                    assert r.status_code == 200, r.text
                rows = store.usage_rows()
                assert rows[-1].backend == rows[-2].backend  # both on one backend
                where[t] = rows[-1].backend
            return where

        before = run_round()
        load = collections.Counter(before.values())
        victim_url, victim = max(procs, key=lambda p: load[p[0]])
        assert load[victim_url] >= 1
        os.kill(victim.pid, signal.SIGKILL)  # no health check has noticed yet: requests fail over by themselves
        victim.wait()
        after = run_round()
        for t in tenants:
            if before[t] == victim_url:
                assert after[t] != victim_url
            else:
                assert after[t] == before[t]  # tenants elsewhere keep their backend (and its cache)
        wait_until(lambda: not next(b for b in gw.app.state.router.backends if b.url == victim_url).healthy,
                   what="the health check to mark the dead backend")
        assert run_round() == after
    finally:
        gw.stop()
        for _, p in procs:
            p.kill()
            p.wait()


def test_a_backend_that_comes_back_is_warmed_and_gets_its_tenants_back(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'gateway.db'}")
    store.migrate()
    tenants = [f"t{i}" for i in range(6)]
    for t in tenants:
        store.add_prompt(t, f"System prompt of tenant {t}.", public=False)
        store.create_tenant(t, t)
    procs = [start_fake_process(f"b{i}") for i in range(2)]
    gw = start_gateway([u for u, _ in procs], store, health_interval=0.2)
    router = gw.app.state.router
    home = {t: router.ranking(route_key(f"System prompt of tenant {t}.", False, t), healthy_only=False)[0].url
            for t in tenants}

    def warmed(url: str) -> set[str]:
        recs = httpx.get(url + "/_requests").json()
        return {r["body"]["messages"][0]["content"].split()[-1].rstrip(".") for r in recs
                if r["body"].get("max_tokens") == 1 and r["body"]["messages"][-1]["content"] == "."}

    try:
        # at start, each backend is warmed with the prompts it is home to (the first one up may also
        # get the others', while it is the only backend up)
        for url, _ in procs:
            wait_until(lambda url=url: warmed(url) >= {t for t in tenants if home[t] == url}, what="warm-up")
        victim_url, victim = next(p for p in procs if any(home[t] == p[0] for t in tenants))
        victim.kill()
        victim.wait()
        wait_until(lambda: not next(b for b in router.backends if b.url == victim_url).healthy, what="down")
        port = int(victim_url.rsplit(":", 1)[1])
        procs = [p for p in procs if p[0] != victim_url] + [start_fake_process("again", port)]
        wait_until(lambda: warmed(victim_url) == {t for t in tenants if home[t] == victim_url},
                   what="the returning backend's warm-up")  # a new process: only what is its own now
        key = store.create_key(SECRET, next(t for t in tenants if home[t] == victim_url))[0]
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": "back?"}]}, timeout=30)
        assert r.status_code == 200 and store.usage_rows()[-1].backend == victim_url
    finally:
        gw.stop()
        for _, p in procs:
            p.kill()
            p.wait()


def test_health_checks_that_time_out_mark_a_backend_down_only_after_health_fails_in_a_row(tmp_path):
    """A busy backend answers its health check late: that alone (up to --health-fails
    times in a row) does not take it out of routing; a refused connection does at once."""
    fake = start_fake()
    refused = f"http://127.0.0.1:{free_port()}"
    cfg = GatewayConfig(backends=(fake.url, refused), health_interval=0.2, health_fails=3, warmup=False)
    router = Router([Backend(fake.url, healthy=True), Backend(refused, healthy=True)])
    store = Store(f"sqlite:///{tmp_path / 'g.db'}")
    store.migrate()
    slow, dead = router.backends

    async def go() -> tuple[list[bool], bool, bool]:
        async with httpx.AsyncClient() as c:
            mon = BackendMonitor(cfg, store, SECRET, router, c, c, spawn=lambda coro: coro.close())
            fake.app.state.health_delay = cfg.health_timeout + 1
            seen = []
            for _ in range(3):
                await mon.check(slow)
                seen.append(slow.healthy)
            fake.app.state.health_delay = 0.0
            await mon.check(slow)
            back = slow.healthy
            await mon.check(dead)
            return seen, back, dead.healthy

    try:
        seen, back, dead_healthy = asyncio.run(go())
    finally:
        fake.stop()
    assert seen == [True, True, False]
    assert back and slow.last_error is None and slow.model == "fake-model"  # up again, probed
    assert not dead_healthy and "ConnectError" in dead.last_error


@pytest.mark.parametrize("kw,needle", [
    ({"health_fails": 0}, "--health-fails must be >= 1, got 0"),
    ({"timeout_keep_alive": 0.0}, "--timeout-keep-alive must be > 0, got 0.0"),
    ({"timeout_keep_alive": float("nan")}, "--timeout-keep-alive must be > 0, got nan"),
])
def test_health_and_keep_alive_settings_out_of_range_are_refused(kw, needle):
    from hotprefix.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        GatewayConfig(backends=("http://127.0.0.1:1",), **kw)
