"""An index of a tenant's runs by definition (issue 30's charts): ``(tenant, definition_name, created_at_us)``.

The run history's definition filter and its charts read one tenant's runs of one definition. Without this
index, SQLite's planner chose ``ix_dataflow_runs_definition_created`` (every tenant's runs of that name)
and dropped the other tenants' rows after reading them: the time of a request then grew with another
tenant's runs of that name, which told a tenant that the name is in use elsewhere and how much.

Revision ID: 0016_runs_by_tenant_definition
Revises: 0015_ledger_outbox
"""

from __future__ import annotations

from alembic import op

revision = "0016_runs_by_tenant_definition"
down_revision = "0015_ledger_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_dataflow_runs_tenant_definition_created",
        "dataflow_runs",
        ["tenant", "definition_name", "created_at_us", "run_id"],
    )


def downgrade() -> None:
    op.drop_index("ix_dataflow_runs_tenant_definition_created", table_name="dataflow_runs")
