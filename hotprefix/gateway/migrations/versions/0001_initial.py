"""Initial gateway schema: system prompts, tenants, API keys, usage.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _create_tenants_and_keys()
    _create_usage()


def _create_tenants_and_keys() -> None:
    op.create_table(
        "system_prompts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("public", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("name", "version", name="uq_system_prompts_name_version"),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("prompt_name", sa.String(128), nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("hint", sa.String(8), nullable=False),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(128), nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=True),
        sa.Column("revoked_at", sa.DateTime, nullable=True),
        sa.Column("rotated_from", sa.String(32), nullable=True),
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.Integer, nullable=True),
        sa.Column("max_concurrent", sa.Integer, nullable=True),
    )


def _create_usage() -> None:
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("prompt_name", sa.String(128), nullable=True),
        sa.Column("prompt_version", sa.Integer, nullable=True),
        sa.Column("backend", sa.String(256), nullable=True),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("http_status", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("cached_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("ttft_s", sa.Float, nullable=True),
        sa.Column("latency_s", sa.Float, nullable=False),
    )
    op.create_index("ix_usage_created_at", "usage", ["created_at"])
    op.create_index("ix_usage_key_id", "usage", ["key_id"])
    op.create_index("ix_usage_tenant", "usage", ["tenant"])


def downgrade() -> None:
    for name in ("ix_usage_tenant", "ix_usage_key_id", "ix_usage_created_at"):
        op.drop_index(name, table_name="usage")
    for table in ("usage", "api_keys", "tenants", "system_prompts"):
        op.drop_table(table)
