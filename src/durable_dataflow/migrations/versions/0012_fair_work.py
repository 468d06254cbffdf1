"""Fair work (issue 29): an index for the fair claim, and the schedules' next-due column.

``ix_dataflow_runs_status_tenant_created`` serves ``runs.fairest_queued``: the tenants that have queued
runs, walked one index probe each, and each tenant's oldest queued run.

``schedules.next_due_us`` (indexed with the tenant and name) is when an evaluation next has work for a
schedule; evaluations read only the schedules due by it, in its order, through every tenant. Schedules
applied before this revision are made due at their apply instant when they are not paused: the first
evaluation after the upgrade decides them as before and stores their real next-due instant (NULL for a
schedule with ``enabled: false``, which only its parsed block can tell).

Revision ID: 0012_fair_work
Revises: 0011_run_partitions
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_fair_work"
down_revision = "0011_run_partitions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_dataflow_runs_status_tenant_created", "dataflow_runs", ["status", "tenant", "created_at_us"]
    )
    op.add_column("schedules", sa.Column("next_due_us", sa.BigInteger, nullable=True))
    schedules = sa.table(
        "schedules",
        sa.column("paused", sa.Boolean),
        sa.column("applied_at_us", sa.BigInteger),
        sa.column("next_due_us", sa.BigInteger),
    )
    op.execute(
        sa.update(schedules).where(schedules.c.paused == sa.false()).values(next_due_us=schedules.c.applied_at_us)
    )
    op.create_index("ix_schedules_next_due", "schedules", ["next_due_us", "tenant", "name"])


def downgrade() -> None:
    op.drop_index("ix_schedules_next_due", table_name="schedules")
    with op.batch_alter_table("schedules") as batch:
        batch.drop_column("next_due_us")
    op.drop_index("ix_dataflow_runs_status_tenant_created", table_name="dataflow_runs")
