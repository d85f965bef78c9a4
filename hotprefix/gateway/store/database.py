"""The gateway database's connection and schema: SQLAlchemy over SQLite (default) or
PostgreSQL, the schema created and upgraded by Alembic migrations (`Database.migrate`).
Every store method opens its own transaction; they are blocking (the gateway calls
them from a worker thread)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa

from hotprefix.config import ConfigError
from hotprefix.gateway.schema import metadata

MIGRATIONS = Path(__file__).parents[1] / "migrations"
T = TypeVar("T")


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


class Database:
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


def from_columns(cls: type[T], row: Mapping[str, Any], **converted: Any) -> T:
    """A dataclass built from the columns of a database row by name (`converted`: fields
    whose column needs converting, given already converted)."""
    return cls(**{f.name: converted[f.name] if f.name in converted else row[f.name] for f in fields(cls)})
