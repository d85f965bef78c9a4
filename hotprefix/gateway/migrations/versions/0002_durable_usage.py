"""Durable usage rows: written at admission (status `started`), completed at the end.

request_id: the gateway's id of the request (x-request-id), unique; gateway_id:
which gateway process wrote it (a restarted one closes its own orphans);
reserved_tokens: what admission reserved; updated_at: the last heartbeat of a
running request (a row left `started` and silent is an orphan of a dead gateway).

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage") as b:
        b.add_column(sa.Column("request_id", sa.String(64), nullable=True))
        b.add_column(sa.Column("gateway_id", sa.String(128), nullable=True))
        b.add_column(sa.Column("reserved_tokens", sa.Integer, nullable=True))
        b.add_column(sa.Column("updated_at", sa.DateTime, nullable=True))
    op.create_index("ix_usage_request_id", "usage", ["request_id"], unique=True)
    op.create_index("ix_usage_status", "usage", ["status"])


def downgrade() -> None:
    op.drop_index("ix_usage_status", table_name="usage")
    op.drop_index("ix_usage_request_id", table_name="usage")
    with op.batch_alter_table("usage") as b:
        for name in ("updated_at", "reserved_tokens", "gateway_id", "request_id"):
            b.drop_column(name)
