"""`hotprefix gateway` as processes: two of them on one Redis share rate limits;
the `tenants`, `keys` and `usage` commands run the store from the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from hotprefix.gateway.store import Store, UsageRow
from tests.gateway.conftest import start_fake, wait_until
from tests.server.conftest import free_port

SECRET_TEXT = "process-secret-0123456789abcdef"


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "HOTPREFIX_HOME": str(tmp_path / "home"), "HOTPREFIX_GATEWAY_SECRET": SECRET_TEXT,
            "HOTPREFIX_DATABASE_URL": f"sqlite:///{tmp_path / 'gateway.db'}"}


def cli(env, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", *args], capture_output=True, text=True, env=env,
                       timeout=60)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def start_gateway_process(env, backend: str, *extra: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hotprefix.cli", "gateway", "--backend", backend, "--port",
                             str(port), "--health-interval", "0.2", "--no-warmup", *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, "the gateway process exited"
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, timeout=60, what="the gateway process")
    return url, proc


def admitted_over(urls: list[str], key: str, n: int) -> int:
    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*(
                c.post(urls[i % len(urls)] + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {key}"}) for i in range(n)))
    codes = [r.status_code for r in asyncio.run(go())]
    assert set(codes) <= {200, 429}
    return codes.count(200)


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "in-memory"])
def test_two_gateways_share_limits_through_redis(env, redis_url, shared):
    fake = start_fake()
    cli(env, "tenants", "create", "acme")
    key = cli(env, "keys", "create", "--tenant", "acme", "--rpm", "10").stdout.strip()
    extra = ("--redis-url", redis_url) if shared else ()
    gws = [start_gateway_process(env, fake.url, *extra) for _ in range(2)]
    try:
        t0 = time.monotonic()
        got = admitted_over([u for u, _ in gws], key, 50)
        refilled = int((time.monotonic() - t0) * 10 / 60)  # each bucket refills one request every 6 s
        # one Redis: the key's 10 per minute across both; each process on its own admits 10 itself
        limit = 10 if shared else 20
        assert limit <= got <= limit + refilled * (1 if shared else 2)
    finally:
        for _, p in gws:
            p.terminate()
            p.wait(timeout=30)
        fake.stop()


def test_tenants_keys_and_usage_commands(env, tmp_path):
    (tmp_path / "p.txt").write_text("You are Acme's assistant.")
    assert "system prompt acme v1 (private)" in cli(env, "tenants", "create", "acme", "--system-prompt-file",
                                                     str(tmp_path / "p.txt")).stdout
    cli(env, "tenants", "add-prompt", "shared", "--system-prompt", "Be brief.", "--public")
    cli(env, "tenants", "add-prompt", "shared", "--system-prompt", "Be briefer.", "--public")
    assert "shared v2 (public)" in cli(env, "tenants", "create", "beta", "--prompt", "shared").stdout
    tenants = json.loads(cli(env, "tenants", "list", "--json").stdout)
    assert [(t["name"], t["prompt"], t["version"], t["public"]) for t in tenants] == [
        ("acme", "acme", 1, False), ("beta", "shared", 2, True)]
    bad = cli(env, "tenants", "create", "acme", check=False)
    assert bad.returncode == 2 and "hotprefix: error: tenant 'acme' exists" in bad.stderr
    made = json.loads(cli(env, "keys", "create", "--tenant", "acme", "--name", "web", "--rpm", "5",
                          "--expires-in", "30d", "--json").stdout)
    key = made["key"]
    listed = cli(env, "keys", "list").stdout
    assert made["id"] in listed and key not in listed and key[-4:] in listed
    rotated = json.loads(cli(env, "keys", "rotate", made["id"], "--grace", "1h", "--json").stdout)
    assert rotated["rotated_from"] == made["id"] and rotated["rpm"] == 5
    assert "revoked" in cli(env, "keys", "revoke", made["id"]).stdout
    states = {k["id"]: k["active"] for k in json.loads(cli(env, "keys", "list", "--json").stdout)}
    assert states == {made["id"]: False, rotated["id"]: True}
    # the database holds no key, only digests
    store = Store(env["HOTPREFIX_DATABASE_URL"])
    db = open(store.engine.url.database, "rb").read()
    assert key[6:-4].encode() not in db and rotated["key"][6:-4].encode() not in db
    store.record_usage(UsageRow(rotated["id"], "acme", "chat", status="ok", http_status=200, prompt_tokens=12,
                                cached_tokens=8, completion_tokens=3, latency_s=0.2))
    usage = json.loads(cli(env, "usage", "--by", "key", "--json").stdout)
    assert usage == [{"key": rotated["id"], "requests": 1, "ok": 1, "prompt_tokens": 12, "cached_tokens": 8,
                      "completion_tokens": 3}]
    assert "acme" in cli(env, "usage").stdout
    bad = cli(env, "keys", "create", "--tenant", "ghost", check=False)
    assert bad.returncode == 2 and "no tenant 'ghost'" in bad.stderr
