"""Alembic environment: runs on the connection handed in by :func:`durable_dataflow.migrations.upgrade`."""

from __future__ import annotations

from alembic import context

from durable_dataflow.migrations import all_metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=all_metadata(),
    render_as_batch=connection.dialect.name == "sqlite",
    transaction_per_migration=False,
)
with context.begin_transaction():
    context.run_migrations()
