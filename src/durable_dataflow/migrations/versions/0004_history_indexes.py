"""Indexes for scale: the history page (newest first, overall and per definition), subjects per
module (a partial index of first entries) and held leases (a partial index for sweeper and Ops).

Revision ID: 0004_history_indexes
Revises: 0003_api_tokens
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_history_indexes"
down_revision = "0003_api_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_dataflow_runs_status_pair", "dataflow_runs", ["status", "recovery_status"])
    op.create_index(
        "ix_dataflow_runs_tenant_status_pair", "dataflow_runs", ["tenant", "status", "recovery_status"]
    )
    op.drop_index("ix_leases_expiry", table_name="leases")
    op.create_index(
        "ix_leases_held_expiry",
        "leases",
        ["module", "expires_at_us"],
        postgresql_where=sa.text("released_at_us IS NULL"),
        sqlite_where=sa.text("released_at_us IS NULL"),
    )
    op.create_index(
        "ix_ledger_entries_first",
        "ledger_entries",
        ["module"],
        postgresql_where=sa.text("seq = 1"),
        sqlite_where=sa.text("seq = 1"),
    )
    op.create_index("ix_dataflow_runs_created", "dataflow_runs", ["created_at_us", "run_id"])
    op.create_index(
        "ix_dataflow_runs_definition_created", "dataflow_runs", ["definition_name", "created_at_us", "run_id"]
    )


def downgrade() -> None:
    op.drop_index("ix_dataflow_runs_tenant_status_pair", table_name="dataflow_runs")
    op.drop_index("ix_dataflow_runs_status_pair", table_name="dataflow_runs")
    op.drop_index("ix_ledger_entries_first", table_name="ledger_entries")
    op.drop_index("ix_leases_held_expiry", table_name="leases")
    op.create_index("ix_leases_expiry", "leases", ["module", "released_at_us", "expires_at_us"])
    op.drop_index("ix_dataflow_runs_definition_created", table_name="dataflow_runs")
    op.drop_index("ix_dataflow_runs_created", table_name="dataflow_runs")
