"""The gateway's database: tenants, the system-prompt pool, API keys and usage rows.

SQLAlchemy over SQLite (default) or PostgreSQL; the schema is created and
upgraded by Alembic migrations (`Store.migrate`). Every method opens its own
transaction; they are blocking (the gateway calls them from a worker thread).
"""

from __future__ import annotations

import datetime as dt
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from hotprefix.config import ConfigError
from hotprefix.gateway import keys as K
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

    def active(self, at: dt.datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > at)

    def public(self) -> dict[str, Any]:
        """The record as JSON-able data (no secret in it: the store holds none)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("created_at", "expires_at", "revoked_at"):
            d[k] = d[k].isoformat() + "Z" if d[k] else None
        return d


USAGE_GROUPS = ("key", "tenant", "day")


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
                tid = c.execute(tenants.insert().values(name=name, prompt_name=prompt_name,
                                                        created_at=utcnow())).inserted_primary_key[0]
        except IntegrityError:
            raise StoreError(f"tenant {name!r} exists") from None
        return Tenant(tid, name, prompt_name)

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
        return Tenant(row.id, row.name, row.prompt_name)

    def list_tenants(self) -> list[Tenant]:
        with self.engine.connect() as c:
            return [Tenant(r.id, r.name, r.prompt_name)
                    for r in c.execute(sa.select(tenants).order_by(tenants.c.name))]

    def tenant_prompt(self, tenant: Tenant) -> Prompt | None:
        """The newest version of the tenant's pool prompt, or None."""
        return None if tenant.prompt_name is None else self.prompt(tenant.prompt_name)

    # --- keys ---------------------------------------------------------------------------------------

    def create_key(self, secret: bytes, tenant: str, name: str | None = None,
                   expires_at: dt.datetime | None = None, rpm: int | None = None, tpm: int | None = None,
                   max_concurrent: int | None = None, rotated_from: str | None = None) -> tuple[str, KeyRecord]:
        """A new key for `tenant`: returns (the key, shown this once; its record)."""
        t = self.tenant(tenant)
        for v, flag in ((rpm, "rpm"), (tpm, "tpm"), (max_concurrent, "max-concurrent")):
            if v is not None and v < 1:
                raise StoreError(f"--{flag} must be >= 1")
        key, kid = K.new_key(), K.new_key_id()
        with self.engine.begin() as c:
            c.execute(api_keys.insert().values(id=kid, digest=K.digest(secret, key), hint=key[-4:], tenant_id=t.id,
                                               name=name, created_at=utcnow(), expires_at=expires_at,
                                               rotated_from=rotated_from, rpm=rpm, tpm=tpm,
                                               max_concurrent=max_concurrent))
        return key, self.key(kid)

    def _keys_query(self):
        return sa.select(api_keys, tenants.c.name.label("tenant")).join(tenants, tenants.c.id == api_keys.c.tenant_id)

    @staticmethod
    def _record(r) -> KeyRecord:
        return KeyRecord(r.id, r.tenant, r.tenant_id, r.name, r.hint, r.created_at, r.expires_at, r.revoked_at,
                         r.rotated_from, r.rpm, r.tpm, r.max_concurrent)

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
        working after `grace_s` seconds (now when 0). Raises StoreError for an
        unknown or inactive key."""
        old = self.key(key_id)
        now = utcnow()
        if not old.active(now):
            raise StoreError(f"key {key_id!r} is revoked or expired")
        key, rec = self.create_key(secret, old.tenant, old.name, old.expires_at, old.rpm, old.tpm,
                                   old.max_concurrent, rotated_from=old.id)
        ends = now + dt.timedelta(seconds=grace_s)
        with self.engine.begin() as c:
            if grace_s > 0:
                c.execute(api_keys.update().where(api_keys.c.id == key_id).values(expires_at=ends))
            else:
                c.execute(api_keys.update().where(api_keys.c.id == key_id).values(revoked_at=now))
        return key, rec

    # --- usage --------------------------------------------------------------------------------------

    def record_usage(self, row: dict[str, Any]) -> None:
        """Insert one usage row (the columns of schema.usage; created_at defaults to now)."""
        with self.engine.begin() as c:
            c.execute(usage.insert().values({"created_at": utcnow(), **row}))

    def usage_rows(self, key_id: str | None = None) -> list[dict[str, Any]]:
        q = sa.select(usage).order_by(usage.c.id)
        if key_id is not None:
            q = q.where(usage.c.key_id == key_id)
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(q)]

    def usage_report(self, group_by: str = "tenant", since: dt.datetime | None = None,
                     until: dt.datetime | None = None) -> list[dict[str, Any]]:
        """Requests and token sums grouped by key, tenant or day (UTC), oldest window
        first. Raises StoreError for an unknown grouping."""
        if group_by not in USAGE_GROUPS:
            raise StoreError(f"group by one of {', '.join(USAGE_GROUPS)}, not {group_by!r}")
        col = {"key": usage.c.key_id, "tenant": usage.c.tenant,
               "day": sa.func.date(usage.c.created_at)}[group_by].label(group_by)
        q = sa.select(col, sa.func.count().label("requests"),
                      sa.func.sum(sa.case((usage.c.status == "ok", 1), else_=0)).label("ok"),
                      sa.func.coalesce(sa.func.sum(usage.c.prompt_tokens), 0).label("prompt_tokens"),
                      sa.func.coalesce(sa.func.sum(usage.c.cached_tokens), 0).label("cached_tokens"),
                      sa.func.coalesce(sa.func.sum(usage.c.completion_tokens), 0).label("completion_tokens"),
                      ).group_by(col).order_by(col)
        if since is not None:
            q = q.where(usage.c.created_at >= since)
        if until is not None:
            q = q.where(usage.c.created_at < until)
        with self.engine.connect() as c:
            rows = [dict(r._mapping) for r in c.execute(q)]
        for r in rows:
            r[group_by] = str(r[group_by])
            for k in ("requests", "ok", "prompt_tokens", "cached_tokens", "completion_tokens"):
                r[k] = int(r[k])
        return rows
