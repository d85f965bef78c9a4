"""The gateway's database: tenants, the system-prompt pool, API keys and usage rows.

SQLAlchemy over SQLite (default) or PostgreSQL; the schema (schema.py) is created and
upgraded by Alembic migrations (`Store.migrate`). Every method opens its own
transaction; they are blocking (the gateway calls them from a worker thread). One
module per concern: database.py (the connection, migrations, errors), tenants.py
(prompts, tenants, budgets), keys.py (API keys), usage.py (usage rows and reports).
Rows are dataclasses built from their columns by name.
"""

from __future__ import annotations

from hotprefix.gateway.store.database import MIGRATIONS, NotFound, StoreError, normalise_url, utcnow
from hotprefix.gateway.store.keys import MAX_GRACE_S, KeyRecord, KeyStore
from hotprefix.gateway.store.tenants import MAX_MODELS, Prompt, Tenant, check_budget
from hotprefix.gateway.store.usage import (
    USAGE_GROUPS,
    Activity,
    ActivityRow,
    Tokens,
    UsageEnd,
    UsageGroup,
    UsageRow,
    UsageStatus,
    UsageStore,
)

__all__ = ["MAX_GRACE_S", "MAX_MODELS", "MIGRATIONS", "USAGE_GROUPS", "Activity", "ActivityRow", "KeyRecord",
           "NotFound", "Prompt", "Store", "StoreError", "Tenant", "Tokens", "UsageEnd", "UsageGroup", "UsageRow",
           "UsageStatus", "check_budget", "normalise_url", "utcnow"]


class Store(KeyStore, UsageStore):
    """The gateway database at `url` (an SQLAlchemy URL): prompts and tenants, keys, usage.
    Raises ConfigError for a bad URL."""
