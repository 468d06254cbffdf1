"""The run's workspace: where its sources may read, where its sinks may write and which secrets
it may name, recorded with the run (``dataflow.execution.workspace``). NULL for runs recorded before: they
keep the rules they were accepted under.

Revision ID: 0005_run_workspace
Revises: 0004_history_indexes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_run_workspace"
down_revision = "0004_history_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("dataflow_runs", sa.Column("workspace_json", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dataflow_runs") as batch:
        batch.drop_column("workspace_json")
