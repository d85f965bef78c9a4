"""The gateway's database: tenants, the system-prompt pool, API keys and usage rows.

SQLAlchemy over SQLite (default) or PostgreSQL; the schema is created and
upgraded by Alembic migrations (`Store.migrate`). Every method opens its own
transaction; they are blocking (the gateway calls them from a worker thread).
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from hotprefix.config import ConfigError
from hotprefix.gateway import keys as K
from hotprefix.gateway.budgets import Budget, PriceTable
from hotprefix.gateway.budgets import parse_duration as parse_budget_duration
from hotprefix.gateway.schema import api_keys, metadata, system_prompts, tenants, usage

MIGRATIONS = Path(__file__).parent / "migrations"


class StoreError(ConfigError):
    """A store operation that cannot be done (unknown tenant, duplicate name, ...): a one-line message."""


class NotFound(StoreError):
    """The tenant, prompt or key named does not exist."""


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def normalise_url(url: str) -> str:
    """postgresql:// and postgres:// use psycopg 3 (the driver we install)."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    return url


@dataclass(frozen=True)
class Prompt:
    name: str
    version: int
    text: str
    public: bool


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    prompt_name: str | None
    max_budget_tokens: int | None = None
    max_budget: float | None = None
    budget_duration: str | None = None

    @property
    def budget(self) -> Budget:
        return Budget(self.max_budget_tokens, self.max_budget, parse_budget_duration(self.budget_duration))


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant: str
    tenant_id: int
    name: str | None
    hint: str
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    rotated_from: str | None
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    max_budget_tokens: int | None = None
    max_budget: float | None = None
    budget_duration: str | None = None
    models: tuple[str, ...] | None = None  # the models it may use (None: any)

    @property
    def budget(self) -> Budget:
        return Budget(self.max_budget_tokens, self.max_budget, parse_budget_duration(self.budget_duration))

    def active(self, at: dt.datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > at)

    def public(self) -> dict[str, Any]:
        """The record as JSON-able data (no secret in it: the store holds none)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("created_at", "expires_at", "revoked_at"):
            d[k] = d[k].isoformat() + "Z" if d[k] else None
        d["models"] = None if self.models is None else list(self.models)
        return d


USAGE_GROUPS = ("key", "tenant", "day", "model")
MAX_MODELS = 100  # models one key may be limited to
MAX_GRACE_S = 365 * 86400.0  # a rotated key's grace period: at most a year


class UsageStatus(str, Enum):
    """A usage row's status. `started` is written at admission; every other one ends it."""

    STARTED = "started"
    OK = "ok"  # the backend answered 200 and the response reached the client
    CLIENT_ABORTED = "client_aborted"  # the client went away; the backend was told
    ERROR = "error"  # the backend answered 4xx
    BACKEND_ERROR = "backend_error"  # no backend answered, or one failed mid-way
    TIMEOUT = "timeout"  # the backend did not answer within --backend-timeout
    RATE_LIMITED = "rate_limited"
    INVALID = "invalid"  # refused by the gateway before any backend
    INTERRUPTED = "interrupted"  # its gateway died; closed by a gateway that saw it orphaned


def _in_window(q, since: dt.datetime | None, until: dt.datetime | None):
    """q restricted to usage rows created in [since, until) (either end open when None)."""
    if since is not None:
        q = q.where(usage.c.created_at >= since)
    if until is not None:
        q = q.where(usage.c.created_at < until)
    return q


def check_budget(tokens: int | None, money: float | None, duration: str | None) -> Budget:
    """The budget these values make. Raises StoreError (an HTTP 400) for a bad one."""
    try:
        return Budget(tokens, money, parse_budget_duration(duration))
    except ConfigError as e:
        raise StoreError(str(e)) from None


class Store:
    """The gateway database at `url` (an SQLAlchemy URL). Raises ConfigError for a bad URL."""

    def __init__(self, url: str) -> None:
        self.url = normalise_url(url)
        try:
            if self.url.startswith("sqlite:///") and self.url != "sqlite:///:memory:":
                Path(self.url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            self.engine = sa.create_engine(self.url, pool_pre_ping=True)
        except (sa.exc.ArgumentError, ImportError, sa.exc.NoSuchModuleError) as e:
            raise ConfigError(f"bad --database-url {url!r}: {e}") from None
        if self.engine.dialect.name == "sqlite":
            @sa.event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(conn, _record) -> None:  # concurrent readers and one writer, waiting on locks
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA busy_timeout=10000")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

    # --- schema -------------------------------------------------------------------------------------

    def migrate(self) -> str:
        """Upgrade the schema to the newest migration; return its revision. Idempotent."""
        from alembic import command
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        try:
            with self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
            with self.engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision() or ""
        except sa.exc.OperationalError as e:
            raise ConfigError(f"cannot open the gateway database {self.engine.url!r}: {e.orig}") from None

    def schema_diff(self) -> list:
        """Differences between the migrated database and schema.py (empty when they agree)."""
        from alembic.autogenerate import compare_metadata
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), metadata)

    # --- prompts and tenants ------------------------------------------------------------------------

    def add_prompt(self, name: str, text: str, public: bool) -> Prompt:
        """Add a new version of pool prompt `name` (version 1 when new)."""
        if not name or not text:
            raise StoreError("a prompt needs a name and a non-empty text")
        with self.engine.begin() as c:
            last = c.execute(sa.select(sa.func.max(system_prompts.c.version))
                             .where(system_prompts.c.name == name)).scalar()
            version = (last or 0) + 1
            c.execute(system_prompts.insert().values(name=name, version=version, text=text, public=public,
                                                     created_at=utcnow()))
        return Prompt(name, version, text, public)

    def prompt(self, name: str, version: int | None = None) -> Prompt:
        """Pool prompt `name` at `version` (default: the newest). Raises StoreError when unknown."""
        q = sa.select(system_prompts).where(system_prompts.c.name == name)
        q = q.where(system_prompts.c.version == version) if version else q.order_by(
            system_prompts.c.version.desc()).limit(1)
        with self.engine.connect() as c:
            row = c.execute(q).first()
        if row is None:
            raise NotFound(f"no system prompt {name!r}" + (f" version {version}" if version else ""))
        return Prompt(row.name, row.version, row.text, row.public)

    def list_prompts(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(system_prompts).order_by(system_prompts.c.name,
                                                                 system_prompts.c.version)).all()
        return [{"name": r.name, "version": r.version, "public": r.public, "chars": len(r.text),
                 "created_at": r.created_at.isoformat() + "Z"} for r in rows]

    def create_tenant(self, name: str, prompt_name: str | None = None) -> Tenant:
        """A new tenant, optionally using pool prompt `prompt_name`. Raises StoreError
        on a duplicate name or an unknown prompt."""
        if not name:
            raise StoreError("a tenant needs a name")
        if prompt_name is not None:
            self.prompt(prompt_name)
        try:
            with self.engine.begin() as c:
                c.execute(tenants.insert().values(name=name, prompt_name=prompt_name, created_at=utcnow()))
        except IntegrityError:
            raise StoreError(f"tenant {name!r} exists") from None
        return self.tenant(name)

    def set_tenant_prompt(self, name: str, prompt_name: str | None) -> Tenant:
        """Point tenant `name` at pool prompt `prompt_name` (None: no forced prompt)."""
        if prompt_name is not None:
            self.prompt(prompt_name)
        with self.engine.begin() as c:
            n = c.execute(tenants.update().where(tenants.c.name == name).values(prompt_name=prompt_name)).rowcount
        if not n:
            raise NotFound(f"no tenant {name!r}")
        return self.tenant(name)

    def tenant(self, name: str) -> Tenant:
        with self.engine.connect() as c:
            row = c.execute(sa.select(tenants).where(tenants.c.name == name)).first()
        if row is None:
            raise NotFound(f"no tenant {name!r}")
        return self._tenant(row)

    @staticmethod
    def _tenant(r) -> Tenant:
        return Tenant(r.id, r.name, r.prompt_name, r.max_budget_tokens, r.max_budget, r.budget_duration)

    def list_tenants(self) -> list[Tenant]:
        with self.engine.connect() as c:
            return [self._tenant(r) for r in c.execute(sa.select(tenants).order_by(tenants.c.name))]

    def set_budget(self, *, tenant: str | None = None, key_id: str | None = None, tokens: int | None = None,
                   money: float | None = None, duration: str | None = None,
                   models: list[str] | None = None) -> None:
        """Replace the budget of a tenant or a key (None: no cap), and a key's models (None:
        any). Raises StoreError for a bad value (nothing changes) or NotFound."""
        check_budget(tokens, money, duration)
        values: dict[str, Any] = {"max_budget_tokens": tokens, "max_budget": money, "budget_duration": duration}
        if key_id is not None:
            if models is not None and (len(models) > MAX_MODELS or not all(
                    isinstance(m, str) and 0 < len(m) <= 256 for m in models)):
                raise StoreError(f"models: at most {MAX_MODELS} names of 1-256 characters")
            values["models"] = None if models is None else json.dumps(list(models))
        table, cond = ((api_keys, api_keys.c.id == key_id) if key_id is not None
                       else (tenants, tenants.c.name == tenant))
        with self.engine.begin() as c:
            if not c.execute(table.update().where(cond).values(**values)).rowcount:
                raise NotFound(f"no {'key' if key_id is not None else 'tenant'} {key_id or tenant!r}")

    def tenant_prompt(self, tenant: Tenant) -> Prompt | None:
        """The newest version of the tenant's pool prompt, or None."""
        return None if tenant.prompt_name is None else self.prompt(tenant.prompt_name)

    # --- keys ---------------------------------------------------------------------------------------

    def create_key(self, secret: bytes, tenant: str, name: str | None = None,
                   expires_at: dt.datetime | None = None, rpm: int | None = None, tpm: int | None = None,
                   max_concurrent: int | None = None) -> tuple[str, KeyRecord]:
        """A new key for `tenant`: returns (the key, shown this once; its record)."""
        with self.engine.begin() as c:
            key, kid = self._insert_key(c, secret, tenant, name, expires_at, rpm, tpm, max_concurrent, None)
        return key, self.key(kid)

    def _insert_key(self, c, secret: bytes, tenant: str, name: str | None, expires_at: dt.datetime | None,
                    rpm: int | None, tpm: int | None, max_concurrent: int | None,
                    rotated_from: str | None) -> tuple[str, str]:
        t = self.tenant(tenant)
        for v, flag in ((rpm, "rpm"), (tpm, "tpm"), (max_concurrent, "max-concurrent")):
            if v is not None and v < 1:
                raise StoreError(f"--{flag} must be >= 1")
        key, kid = K.new_key(), K.new_key_id()
        c.execute(api_keys.insert().values(id=kid, digest=K.digest(secret, key), hint=key[-4:], tenant_id=t.id,
                                           name=name, created_at=utcnow(), expires_at=expires_at,
                                           rotated_from=rotated_from, rpm=rpm, tpm=tpm,
                                           max_concurrent=max_concurrent))
        return key, kid

    def _keys_query(self):
        return sa.select(api_keys, tenants.c.name.label("tenant")).join(tenants, tenants.c.id == api_keys.c.tenant_id)

    @staticmethod
    def _record(r) -> KeyRecord:
        return KeyRecord(r.id, r.tenant, r.tenant_id, r.name, r.hint, r.created_at, r.expires_at, r.revoked_at,
                         r.rotated_from, r.rpm, r.tpm, r.max_concurrent, r.max_budget_tokens, r.max_budget,
                         r.budget_duration, None if r.models is None else tuple(json.loads(r.models)))

    def key(self, key_id: str) -> KeyRecord:
        with self.engine.connect() as c:
            r = c.execute(self._keys_query().where(api_keys.c.id == key_id)).first()
        if r is None:
            raise NotFound(f"no key {key_id!r}")
        return self._record(r)

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        q = self._keys_query().order_by(api_keys.c.created_at)
        if tenant is not None:
            q = q.where(tenants.c.name == tenant)
        with self.engine.connect() as c:
            return [self._record(r) for r in c.execute(q)]

    def authenticate(self, secret: bytes, key: str) -> KeyRecord | None:
        """The active record of `key`, or None (unknown, revoked or expired). The
        lookup is by HMAC digest, which reveals nothing of the key; the final
        comparison is constant-time."""
        d = K.digest(secret, key)
        with self.engine.connect() as c:
            r = c.execute(self._keys_query().where(api_keys.c.digest == d)).first()
        if r is None or not hmac.compare_digest(r.digest, d):
            return None
        rec = self._record(r)
        return rec if rec.active(utcnow()) else None

    def revoke_key(self, key_id: str) -> KeyRecord:
        """Revoke now (idempotent). Raises StoreError for an unknown id."""
        with self.engine.begin() as c:
            c.execute(api_keys.update().where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                      .values(revoked_at=utcnow()))
        return self.key(key_id)  # raises StoreError for an unknown id

    def rotate_key(self, secret: bytes, key_id: str, grace_s: float = 0.0) -> tuple[str, KeyRecord]:
        """A new key with the old one's tenant, name and limits; the old one stops
        working after `grace_s` seconds (now when 0), at most MAX_GRACE_S. Both
        happen in one transaction. Raises StoreError for an unknown or inactive
        key or a grace out of range (then nothing changed)."""
        if not 0 <= grace_s <= MAX_GRACE_S:
            raise StoreError(f"the grace period must be between 0 and {MAX_GRACE_S:.0f} seconds, got {grace_s}")
        old = self.key(key_id)
        now = utcnow()
        if not old.active(now):
            raise StoreError(f"key {key_id!r} is revoked or expired")
        ends = now + dt.timedelta(seconds=grace_s)
        change = {"expires_at": ends} if grace_s > 0 else {"revoked_at": now}
        with self.engine.begin() as c:
            key, kid = self._insert_key(c, secret, old.tenant, old.name, old.expires_at, old.rpm, old.tpm,
                                        old.max_concurrent, old.id)
            c.execute(api_keys.update().where(api_keys.c.id == kid).values(
                max_budget_tokens=old.max_budget_tokens, max_budget=old.max_budget,
                budget_duration=old.budget_duration, models=None if old.models is None else json.dumps(old.models)))
            c.execute(api_keys.update().where(api_keys.c.id == key_id).values(**change))
        return key, self.key(kid)

    # --- usage --------------------------------------------------------------------------------------

    def record_usage(self, row: dict[str, Any]) -> None:
        """Insert one finished usage row (the columns of schema.usage; created_at defaults to now)."""
        with self.engine.begin() as c:
            c.execute(usage.insert().values({"created_at": utcnow(), **row}))

    def start_usage(self, row: dict[str, Any]) -> None:
        """Insert the row of an admitted request, status `started` (one transaction).
        row holds request_id, key_id, tenant, endpoint, stream, reserved_tokens, ..."""
        now = utcnow()
        with self.engine.begin() as c:
            c.execute(usage.insert().values({"created_at": now, "updated_at": now, "http_status": 0,
                                             "latency_s": 0.0, **row, "status": UsageStatus.STARTED.value}))

    def finish_usage(self, request_id: str, fields: dict[str, Any]) -> bool:
        """Complete a started row (one transaction). False if it is not started
        (unknown, or already finished: a request ends once)."""
        with self.engine.begin() as c:
            n = c.execute(usage.update().where(usage.c.request_id == request_id,
                                               usage.c.status == UsageStatus.STARTED.value)
                          .values({**fields, "updated_at": utcnow()})).rowcount
        return n == 1

    def heartbeat_usage(self, progress: dict[str, dict[str, Any]]) -> None:
        """Mark running requests alive, with their usage so far (request_id -> the
        token columns, possibly empty); one transaction for all."""
        if not progress:
            return
        now = utcnow()
        with self.engine.begin() as c:
            for rid, fields in progress.items():
                c.execute(usage.update().where(usage.c.request_id == rid,
                                               usage.c.status == UsageStatus.STARTED.value)
                          .values({**fields, "updated_at": now}))

    def close_orphans(self, gateway_id: str | None = None, silent_since: dt.datetime | None = None) -> int:
        """End as `interrupted` the started rows of `gateway_id` (a restarted gateway's
        former self) and those no heartbeat touched since `silent_since` (their
        gateway died). They keep the usage last reported. Returns how many."""
        conds = []
        if gateway_id is not None:
            conds.append(usage.c.gateway_id == gateway_id)
        if silent_since is not None:
            conds.append(usage.c.updated_at < silent_since)
        if not conds:
            return 0
        with self.engine.begin() as c:
            return c.execute(usage.update().where(usage.c.status == UsageStatus.STARTED.value, sa.or_(*conds))
                             .values(status=UsageStatus.INTERRUPTED.value, http_status=0,
                                     updated_at=utcnow())).rowcount

    def usage_rows(self, key_id: str | None = None) -> list[dict[str, Any]]:
        q = sa.select(usage).order_by(usage.c.id)
        if key_id is not None:
            q = q.where(usage.c.key_id == key_id)
        with self.engine.connect() as c:
            return [dict(m) for m in c.execute(q).mappings()]

    def usage_report(self, group_by: str = "tenant", since: dt.datetime | None = None,
                     until: dt.datetime | None = None, prices: PriceTable | None = None) -> list[dict[str, Any]]:
        """Requests and token sums grouped by key, tenant, day (UTC) or model, oldest window
        first; with a price table, each group's `spend` (None when a model in it has no
        price). Raises StoreError for an unknown grouping."""
        if group_by not in USAGE_GROUPS:
            raise StoreError(f"group by one of {', '.join(USAGE_GROUPS)}, not {group_by!r}")
        col = {"key": usage.c.key_id, "tenant": usage.c.tenant, "model": usage.c.model,
               "day": sa.func.date(usage.c.created_at)}[group_by].label(group_by)
        q = sa.select(col, sa.func.count().label("requests"),
                      sa.func.sum(sa.case((usage.c.status == UsageStatus.OK.value, 1), else_=0)).label("ok"),
                      sa.func.coalesce(sa.func.sum(usage.c.prompt_tokens), 0).label("prompt_tokens"),
                      sa.func.coalesce(sa.func.sum(usage.c.cached_tokens), 0).label("cached_tokens"),
                      sa.func.coalesce(sa.func.sum(usage.c.completion_tokens), 0).label("completion_tokens"),
                      ).group_by(col).order_by(col)
        q = _in_window(q, since, until)
        with self.engine.connect() as c:
            rows = [dict(m) for m in c.execute(q).mappings()]
        spend = self._spend(col, since, until, prices) if prices is not None else {}
        for r in rows:
            if prices is not None:
                r["spend"] = spend.get(r[group_by])
            r[group_by] = str(r[group_by])
            for k in ("requests", "ok", "prompt_tokens", "cached_tokens", "completion_tokens"):
                r[k] = int(r[k])
        return rows

    def _spend(self, col, since: dt.datetime | None, until: dt.datetime | None,
               prices: PriceTable) -> dict[Any, float | None]:
        """Per group: what its usage cost at `prices` (None if a model of it has no price)."""
        q = sa.select(col, usage.c.model, *(sa.func.coalesce(sa.func.sum(c), 0) for c in (
            usage.c.prompt_tokens, usage.c.cached_tokens, usage.c.completion_tokens))).group_by(col, usage.c.model)
        q = _in_window(q, since, until)
        out: dict[Any, float | None] = {}
        with self.engine.connect() as c:
            for group, model, prompt, cached, completion in c.execute(q):
                price = prices.get(model)
                cost = None if price is None else price.cost_micros(int(prompt), int(cached), int(completion)) / 1e6
                out[group] = None if cost is None or (group in out and out[group] is None) else \
                    out.get(group, 0.0) + cost
        return out

    def usage_activity(self, since: dt.datetime, bucket_s: int) -> dict[str, list[dict[str, Any]]]:
        """Usage rows created since `since`: `totals` per (tenant, key, status) and `series` per
        (tenant, key, status, time bucket of bucket_s seconds; `bucket` is its start, UNIX seconds),
        each with requests and token sums (the gateway's dashboard)."""
        epoch = sa.cast(sa.extract("epoch", usage.c.created_at), sa.BigInteger)
        bucket = ((epoch // bucket_s) * bucket_s).label("bucket")
        sums = [sa.func.count().label("requests"),
                sa.func.coalesce(sa.func.sum(usage.c.prompt_tokens), 0).label("prompt_tokens"),
                sa.func.coalesce(sa.func.sum(usage.c.cached_tokens), 0).label("cached_tokens"),
                sa.func.coalesce(sa.func.sum(usage.c.completion_tokens), 0).label("completion_tokens")]
        out: dict[str, list[dict[str, Any]]] = {}
        with self.engine.connect() as c:
            for name, cols in (("totals", [usage.c.tenant, usage.c.key_id, usage.c.status]),
                               ("series", [usage.c.tenant, usage.c.key_id, usage.c.status, bucket])):
                q = sa.select(*cols, *sums).where(usage.c.created_at >= since).group_by(*cols).order_by(*cols)
                out[name] = [{k: int(v) if k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                                                 "bucket") else v for k, v in m.items()}
                             for m in c.execute(q).mappings()]
        return out
