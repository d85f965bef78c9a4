"""Budgets: per key and per tenant, the most tokens and money per period; per key, the models it may use.

max_budget_tokens / max_budget: caps per period of budget_duration ("30d"; null: never
resets); models: a JSON list of model names (null: any).

Revision ID: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BUDGET = ("max_budget_tokens", "max_budget", "budget_duration")


def _budget_columns() -> list[sa.Column]:
    return [sa.Column("max_budget_tokens", sa.BigInteger, nullable=True),
            sa.Column("max_budget", sa.Float, nullable=True),
            sa.Column("budget_duration", sa.String(16), nullable=True)]


def upgrade() -> None:
    with op.batch_alter_table("tenants") as b:
        for col in _budget_columns():
            b.add_column(col)
    with op.batch_alter_table("api_keys") as b:
        for col in _budget_columns():
            b.add_column(col)
        b.add_column(sa.Column("models", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as b:
        for name in ("models", *reversed(BUDGET)):
            b.drop_column(name)
    with op.batch_alter_table("tenants") as b:
        for name in reversed(BUDGET):
            b.drop_column(name)
