"""Alembic environment: run against the connection the Store hands over."""

from alembic import context

from hotprefix.gateway.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
