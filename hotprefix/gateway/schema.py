"""The gateway's tables (SQLAlchemy Core). The migrations in migrations/versions
create exactly these; a test compares the two."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

# The pool of system prompts. A prompt is named; each change adds a version.
# `public`: its KV is shared across tenants (salted after the prompt); private
# prompts are salted per tenant from the first token.
system_prompts = Table(
    "system_prompts", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False),
    Column("version", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Column("public", Boolean, nullable=False),
    Column("created_at", DateTime, nullable=False),
    UniqueConstraint("name", "version", name="uq_system_prompts_name_version"),
)

tenants = Table(
    "tenants", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("prompt_name", String(128), nullable=True),  # uses the latest version of this pool prompt
    Column("created_at", DateTime, nullable=False),
    # 0003: budgets (gateway/budgets.py)
    Column("max_budget_tokens", BigInteger, nullable=True),
    Column("max_budget", Float, nullable=True),
    Column("budget_duration", String(16), nullable=True),
)

# Keys are stored only as HMAC-SHA256(server secret, key); `hint` is the last 4
# characters, for people telling keys apart.
api_keys = Table(
    "api_keys", metadata,
    Column("id", String(32), primary_key=True),
    Column("digest", String(64), nullable=False, unique=True),
    Column("hint", String(8), nullable=False),
    Column("tenant_id", Integer, ForeignKey("tenants.id"), nullable=False),
    Column("name", String(128), nullable=True),
    Column("created_at", DateTime, nullable=False),
    Column("expires_at", DateTime, nullable=True),
    Column("revoked_at", DateTime, nullable=True),
    Column("rotated_from", String(32), nullable=True),
    Column("rpm", Integer, nullable=True),
    Column("tpm", Integer, nullable=True),
    Column("max_concurrent", Integer, nullable=True),
    # 0003: budgets, and the models the key may use (a JSON list; null: any)
    Column("max_budget_tokens", BigInteger, nullable=True),
    Column("max_budget", Float, nullable=True),
    Column("budget_duration", String(16), nullable=True),
    Column("models", Text, nullable=True),
)

usage = Table(
    "usage", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("created_at", DateTime, nullable=False),
    Column("key_id", String(32), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("model", String(256), nullable=True),
    Column("prompt_name", String(128), nullable=True),
    Column("prompt_version", Integer, nullable=True),
    Column("backend", String(256), nullable=True),
    Column("stream", Boolean, nullable=False),
    Column("status", String(32), nullable=False),
    Column("http_status", Integer, nullable=False),
    Column("finish_reason", String(32), nullable=True),
    Column("prompt_tokens", Integer, nullable=True),
    Column("cached_tokens", Integer, nullable=True),
    Column("completion_tokens", Integer, nullable=True),
    Column("ttft_s", Float, nullable=True),
    Column("latency_s", Float, nullable=False),
    # 0002: written at admission as `started`, completed when the request ends
    Column("request_id", String(64), nullable=True),
    Column("gateway_id", String(128), nullable=True),
    Column("reserved_tokens", Integer, nullable=True),
    Column("updated_at", DateTime, nullable=True),
)
Index("ix_usage_created_at", usage.c.created_at)
Index("ix_usage_key_id", usage.c.key_id)
Index("ix_usage_tenant", usage.c.tenant)
Index("ix_usage_request_id", usage.c.request_id, unique=True)
Index("ix_usage_status", usage.c.status)
