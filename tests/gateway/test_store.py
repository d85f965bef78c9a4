"""The gateway store on SQLite and on a real PostgreSQL: migrations, prompts,
tenants, keys (HMAC only), usage reports."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

from hotprefix.gateway import keys as K
from hotprefix.gateway.budgets import PriceTable
from hotprefix.gateway.store import (
    MIGRATIONS,
    Store,
    StoreError,
    Tokens,
    UsageEnd,
    UsageGroup,
    UsageRow,
    UsageStatus,
    utcnow,
)
from tests.gateway.conftest import SECRET


def test_migrations_create_exactly_the_schema_and_are_idempotent(store):
    assert store.migrate() == "0003"
    assert store.migrate() == "0003"
    assert store.schema_diff() == []
    names = set(sa.inspect(store.engine).get_table_names())
    assert {"tenants", "system_prompts", "api_keys", "usage", "alembic_version"} <= names


def test_prompt_pool_versions_and_tenants(store):
    assert store.add_prompt("support", "v1 text", public=True).version == 1
    assert store.add_prompt("support", "v2 text", public=False).version == 2
    assert store.add_prompt("other", "x", public=False).version == 1
    t = store.create_tenant("acme", "support")
    p = store.tenant_prompt(t)
    assert (p.name, p.version, p.text, p.public) == ("support", 2, "v2 text", False)
    assert store.prompt("support", 1).text == "v1 text"
    with pytest.raises(StoreError, match="exists"):
        store.create_tenant("acme")
    with pytest.raises(StoreError, match="no system prompt 'nope'"):
        store.create_tenant("beta", "nope")
    assert store.set_tenant_prompt("acme", None).prompt_name is None
    assert store.tenant_prompt(store.tenant("acme")) is None
    with pytest.raises(StoreError, match="no tenant"):
        store.set_tenant_prompt("ghost", None)
    assert [t.name for t in store.list_tenants()] == ["acme"]
    assert [(r["name"], r["version"]) for r in store.list_prompts()] == [("other", 1), ("support", 1), ("support", 2)]


def test_keys_are_stored_only_as_hmac(store):
    store.create_tenant("acme")
    key, rec = store.create_key(SECRET, "acme", "ci", rpm=5, tpm=100, max_concurrent=2)
    assert key.startswith("sk-hp-") and len(key) == 6 + 32  # 24 random bytes, url-safe base64
    assert (rec.tenant, rec.name, rec.rpm, rec.tpm, rec.max_concurrent) == ("acme", "ci", 5, 100, 2)
    with store.engine.connect() as c:
        rows = [dict(r._mapping) for r in c.execute(sa.text("SELECT * FROM api_keys"))]
    assert len(rows) == 1
    assert rows[0]["digest"] == K.digest(SECRET, key)
    secret_part = key[len("sk-hp-"):]
    for value in rows[0].values():  # no column holds the key or more than its last 4 characters
        assert secret_part[:-4] not in str(value) and key not in str(value)
    if store.engine.dialect.name == "sqlite":
        db_bytes = open(store.engine.url.database, "rb").read()
        for suffix in ("-wal", ""):
            try:
                db_bytes += open(store.engine.url.database + suffix, "rb").read()
            except FileNotFoundError:
                pass
        assert secret_part[:-4].encode() not in db_bytes
    assert store.authenticate(SECRET, key).id == rec.id
    assert store.authenticate(SECRET, key + "x") is None
    assert store.authenticate(b"another-secret-0123456789", key) is None


def test_revoke_expire_and_rotate(store):
    store.create_tenant("acme")
    k1, r1 = store.create_key(SECRET, "acme")
    assert store.revoke_key(r1.id).revoked_at is not None
    assert store.authenticate(SECRET, k1) is None
    store.revoke_key(r1.id)  # idempotent
    with pytest.raises(StoreError, match="no key"):
        store.revoke_key("key_nope")
    k2, _ = store.create_key(SECRET, "acme", expires_at=utcnow() - dt.timedelta(seconds=1))
    assert store.authenticate(SECRET, k2) is None
    k3, r3 = store.create_key(SECRET, "acme", "svc", rpm=7)
    k4, r4 = store.rotate_key(SECRET, r3.id, grace_s=3600)
    assert (r4.rotated_from, r4.rpm, r4.name) == (r3.id, 7, "svc")
    assert store.authenticate(SECRET, k3).id == r3.id  # still inside the grace period
    assert store.authenticate(SECRET, k4).id == r4.id
    k5, r5 = store.rotate_key(SECRET, r4.id)  # no grace: the old key stops now
    assert store.authenticate(SECRET, k4) is None and store.authenticate(SECRET, k5).id == r5.id
    with pytest.raises(StoreError, match="revoked or expired"):
        store.rotate_key(SECRET, r4.id)


def test_usage_report_groups(store):
    day1, day2 = dt.datetime(2026, 11, 20, 10), dt.datetime(2026, 11, 21, 23, 59)
    rows = [("k1", "acme", day1, "ok", 10, 4, 5), ("k1", "acme", day2, "ok", 20, 16, 7),
            ("k2", "beta", day2, "client_aborted", 30, 0, 2), ("k2", "beta", day2, "rate_limited", None, None, None)]
    for kid, tenant, at, status, p, c, o in rows:
        store.record_usage(UsageRow(kid, tenant, "chat", status=status, http_status=200, latency_s=0.1,
                                    prompt_tokens=p, cached_tokens=c, completion_tokens=o, created_at=at))
    assert store.usage_report("tenant") == [UsageGroup("acme", 2, 2, 30, 20, 12), UsageGroup("beta", 2, 0, 30, 0, 2)]
    assert [(r.group, r.requests, r.prompt_tokens) for r in store.usage_report("day")] == [
        ("2026-11-20", 1, 10), ("2026-11-21", 3, 50)]
    assert [r.group for r in store.usage_report("key", since=dt.datetime(2026, 11, 21))] == ["k1", "k2"]
    assert [r.to_json("key", False) for r in store.usage_report("key", until=dt.datetime(2026, 11, 21))] == [
        {"key": "k1", "requests": 1, "ok": 1, "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 5}]
    with pytest.raises(StoreError):
        store.usage_report("region")
    # by model, and priced: acme's rows are model m1 (priced), beta's have none (no price: spend None)
    with store.engine.begin() as c:
        c.exec_driver_sql("UPDATE usage SET model = 'm1' WHERE tenant = 'acme'")
    prices = PriceTable.from_dict({"m1": {"input": 1.0, "cached_input": 0.5, "output": 2.0}})
    by_model = {r.group: (r.requests, r.spend) for r in store.usage_report("model", prices=prices)}
    assert by_model["m1"] == (2, pytest.approx(((30 - 20) * 1.0 + 20 * 0.5 + 12 * 2.0) / 1e6))
    assert by_model["None"] == (2, None)
    spend = {r.group: r.spend for r in store.usage_report("tenant", prices=prices)}
    assert spend == {"acme": pytest.approx(44e-6), "beta": None}


def test_a_usage_row_is_started_at_admission_and_ended_once(store):
    base = {"key_id": "key_1", "tenant": "acme", "endpoint": "chat", "stream": True, "reserved_tokens": 600}
    store.start_usage(UsageRow(**base, request_id="gw-a", gateway_id="gw1"))
    store.start_usage(UsageRow(**base, request_id="gw-b", gateway_id="gw1"))
    store.start_usage(UsageRow(**base, request_id="gw-c", gateway_id="gw2"))
    store.heartbeat_usage({"gw-b": Tokens(prompt_tokens=40, completion_tokens=7), "gw-c": Tokens()})
    assert store.finish_usage("gw-a", UsageEnd(UsageStatus.OK, 200, 1.5,
                                                tokens=Tokens(prompt_tokens=40, completion_tokens=9)))
    assert not store.finish_usage("gw-a", UsageEnd(UsageStatus.ERROR, 500, 0.1))  # ends once
    assert store.close_orphans(gateway_id="gw1") == 1  # gw1 restarted: its running row is orphaned
    assert store.close_orphans(silent_since=utcnow() - dt.timedelta(seconds=60)) == 0  # gw2 beat just now
    assert store.close_orphans(silent_since=utcnow() + dt.timedelta(seconds=1)) == 1
    rows = {r.request_id: r for r in store.usage_rows()}
    got = [(rows[k].status, rows[k].prompt_tokens, rows[k].completion_tokens) for k in ("gw-a", "gw-b", "gw-c")]
    assert got == [(UsageStatus.OK, 40, 9), (UsageStatus.INTERRUPTED, 40, 7), (UsageStatus.INTERRUPTED, None, None)]
    assert all(r.reserved_tokens == 600 and r.stream and isinstance(r.created_at, dt.datetime)
               for r in rows.values())


def test_a_usage_row_has_exactly_the_columns_of_the_table():
    from dataclasses import fields

    from hotprefix.gateway.schema import usage

    assert {f.name for f in fields(UsageRow)} == set(usage.c.keys())
    with pytest.raises(ValueError, match="'done' is not a valid UsageStatus"):
        UsageRow("k", "t", "chat", status="done")


def test_migrations_0002_and_0003_upgrade_a_database_with_rows(tmp_path):
    from alembic import command
    from alembic.config import Config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    st = Store(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with st.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    st.record_usage(UsageRow("k", "t", "chat", status="ok", http_status=200, latency_s=0.1))
    with st.engine.begin() as conn:  # a tenant as 0001 had them (0003 adds its budget columns)
        conn.exec_driver_sql("INSERT INTO tenants (name, prompt_name, created_at) VALUES ('t', NULL, "
                             "'2026-01-01 00:00:00')")
    assert st.migrate() == "0003" and st.schema_diff() == []
    (row,) = st.usage_rows()
    assert row.status is UsageStatus.OK and row.request_id is None
    t = st.tenant("t")
    assert (t.max_budget_tokens, t.max_budget, t.budget_duration) == (None, None, None) and not t.budget.active
