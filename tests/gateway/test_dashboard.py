"""The gateway's /dashboard: its data (behind the admin key) after a known sequence of
requests, the same in headless Chromium (no console error, tenant -> keys links, a
screenshot), and the store's activity query on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import httpx

from hotprefix.gateway.store import UsageRow, utcnow
from tests.browser import Browser
from tests.gateway.conftest import ADMIN, SECRET, gateway_over_fake, tenant_store, wait_until

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def chat(gw, key: str, content: str = "hi") -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 5})


def test_the_dashboard_shows_each_tenant_and_key(tmp_path):
    store = tenant_store(tmp_path)
    k1, r1 = store.create_key(SECRET, "acme", "web")
    k2, r2 = store.create_key(SECRET, "acme", "batch", rpm=1)
    k3, r3 = store.create_key(SECRET, "beta", "app")
    store.set_budget(tenant="acme", tokens=100_000, duration="1d")
    with gateway_over_fake(store) as (fake, gw):
        codes = [chat(gw, k1).status_code for _ in range(3)] + [chat(gw, k2).status_code for _ in range(2)]
        codes += [chat(gw, k3).status_code]
        bad = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {k3}"},
                         json={"messages": "not a list"})
        assert codes == [200, 200, 200, 200, 429, 200] and bad.status_code == 400
        wait_until(lambda: all(r.status != "started" for r in store.usage_rows()) and len(store.usage_rows()) == 7,
                   what="usage rows")
        denied = httpx.get(gw.url + "/admin/dashboard")
        data = httpx.get(gw.url + "/admin/dashboard", headers=ADMIN_H).json()
        page = httpx.get(gw.url + "/dashboard")
        with Browser() as b:
            b.goto(gw.url + "/dashboard")
            b.wait_for("document.readyState === 'complete' && !!document.getElementById('key')")
            b.evaluate(f"sessionStorage.setItem('hotprefix-admin-key', {ADMIN!r}); 1")
            b.send("Page.reload")
            b.wait_for("document.readyState === 'complete' && Number(document.body.dataset.loaded || 0) >= 1")
            shown = b.evaluate(
                "({tenants: Object.fromEntries([...document.querySelectorAll('#tenants tr')].map(r => "
                "[r.dataset.tenant, [...r.children].map(c => c.textContent)])), "
                "keys: Object.fromEntries([...document.querySelectorAll('tr[data-key]')].map(r => "
                "[r.dataset.key, [...r.children].map(c => c.textContent)])), "
                "sparks: [...document.querySelectorAll('tr[data-key] svg')].map(s => Number(s.dataset.points)), "
                "links: [...document.querySelectorAll('#tenants a')].map(a => [a.getAttribute('href'), "
                "!!document.getElementById(decodeURIComponent(a.getAttribute('href').slice(1)))]), "
                "backends: [...document.querySelectorAll('#backends tr')].map(r => [...r.children]"
                ".map(c => c.textContent))})")
            shot = b.screenshot(tmp_path / "gateway.png")
            if os.environ.get("HOTPREFIX_SCREENSHOT_DIR"):
                (Path(os.environ["HOTPREFIX_SCREENSHOT_DIR"]) / "gateway-dashboard.png").write_bytes(shot)
            errors = b.console_errors()
    assert denied.status_code == 401 and page.status_code == 200 and "admin key" in page.text
    assert errors == [] and shot.startswith(b"\x89PNG")
    tenants = {t["name"]: t for t in data["tenants"]}
    acme, beta = tenants["acme"], tenants["beta"]
    assert (acme["requests"], acme["ok"], acme["rate_limited"], acme["errors"]) == (5, 4, 1, 0)
    assert (beta["requests"], beta["ok"], beta["rate_limited"], beta["errors"]) == (2, 1, 0, 1)
    keys = {k["id"]: k for t in data["tenants"] for k in t["keys"]}
    assert (keys[r1.id]["requests"], keys[r2.id]["rate_limited"], keys[r3.id]["errors"]) == (3, 1, 1)
    usage = {u.group: u for u in store.usage_report("key")}
    for kid, k in keys.items():  # the dashboard's numbers are the usage rows'
        assert (k["requests"], k["prompt_tokens"], k["completion_tokens"]) == \
            (usage[kid].requests, usage[kid].prompt_tokens, usage[kid].completion_tokens)
    assert sum(p["requests"] for p in data["series"]) == 7
    per_key = {}
    for p in data["key_series"]:
        per_key[p["key"]] = per_key.get(p["key"], 0) + p["requests"]
    assert per_key == {r1.id: 3, r2.id: 2, r3.id: 2}
    acme_used = sum(r.prompt_tokens + r.completion_tokens for r in store.usage_rows()
                    if r.tenant == "acme" and r.status == "ok")
    assert acme["budget"]["tokens_spent"] == acme_used and acme["budget"]["max_budget_tokens"] == 100_000
    assert beta["budget"] is None and keys[r1.id]["budget"] is None
    (backend,) = data["backends"]
    assert backend["healthy"] and backend["url"] == fake.url and set(backend["home_of"]) == {"acme", "beta"}
    # the page shows the same: tenant rows, key rows, working tenant -> keys links, the backend up
    assert shown["tenants"]["acme"][2:6] == ["5", "4", "1", "0"]
    assert shown["tenants"]["beta"][2:6] == ["2", "1", "0", "1"]
    assert shown["tenants"]["acme"][9] == f"{acme_used:,} / 100,000 tokens" and shown["tenants"]["beta"][9] == "none"
    assert shown["keys"][r2.id][3:7] == ["2", "1", "1", "0"]
    assert len(shown["sparks"]) == 3 and all(n >= 1 for n in shown["sparks"])  # each key's requests over time
    assert sorted(shown["links"]) == [["#keys-acme", True], ["#keys-beta", True]]
    assert shown["backends"][0][:2] == [fake.url, "up"]


def test_activity_groups_by_key_status_and_time_bucket(store):
    store.create_tenant("t")
    now = utcnow()
    for i, (key, status, minutes_ago) in enumerate([("a", "ok", 1), ("a", "ok", 1), ("a", "rate_limited", 1),
                                                    ("b", "ok", 3), ("b", "error", 90)]):
        store.record_usage(UsageRow(key, "t", "chat", status=status, http_status=200, latency_s=0.1,
                                    prompt_tokens=10 * (i + 1), cached_tokens=i, completion_tokens=1,
                                    created_at=now - dt.timedelta(minutes=minutes_ago)))
    act = store.usage_activity(now - dt.timedelta(minutes=60), 60)
    totals = {(r.key_id, r.status): (r.requests, r.prompt_tokens) for r in act.totals}
    assert totals == {("a", "ok"): (2, 30), ("a", "rate_limited"): (1, 30), ("b", "ok"): (1, 40)}
    buckets = sorted({r.bucket for r in act.series})
    assert len(buckets) == 2 and all(b % 60 == 0 for b in buckets)
    assert buckets[1] - buckets[0] in (120, 180)  # 1 and 3 minutes ago, in whole-minute buckets


def test_the_page_runs_only_its_own_script_and_the_api_docs_are_off(tmp_path):
    """The page: a CSP that allows its own inline script (by hash) and nothing else, no
    framing, nosniff (it works in Chromium under it: the test above). /docs, /redoc and
    /openapi.json: off unless asked for (--docs: the Swagger page loads from a CDN)."""
    import base64
    import hashlib
    import re

    store = tenant_store(tmp_path)
    with gateway_over_fake(store) as (fake, gw):
        page = httpx.get(gw.url + "/dashboard")
        docs = [httpx.get(gw.url + p).status_code for p in ("/docs", "/redoc", "/openapi.json")]
    with gateway_over_fake(store, docs=True) as (fake, gw):
        on = [httpx.get(gw.url + p).status_code for p in ("/docs", "/redoc", "/openapi.json")]
    (script,) = re.findall(r"<script>(.*?)</script>", page.text, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = dict(part.strip().split(" ", 1) for part in page.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["script-src"] == f"'sha256-{digest}'"
    assert csp["connect-src"] == "'self'" and csp["frame-ancestors"] == "'none'" and csp["base-uri"] == "'none'"
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["x-frame-options"] == "DENY"
    assert docs == [404, 404, 404] and on == [200, 200, 200]
