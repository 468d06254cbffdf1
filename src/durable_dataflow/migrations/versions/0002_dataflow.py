"""Dataflow and datasources tables: definitions, runs, results, named datasources.

Revision ID: 0002_dataflow
Revises: 0001_core
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_dataflow"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "definitions",
        sa.Column("definition_hash", sa.String(71), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("body_json", sa.Text, nullable=False),
        sa.Column("registered_at_us", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_definitions_name_version", "definitions", ["name", "version"])
    op.create_table(
        "dataflow_runs",
        sa.Column("run_id", sa.String(36), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("definition_hash", sa.String(71), nullable=False),
        sa.Column("definition_name", sa.String(200), nullable=False),
        sa.Column("request_hash", sa.String(71), nullable=False),
        sa.Column("mode", sa.String(32), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("recovery_status", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("parameters_json", sa.Text, nullable=False),
        sa.Column("provenance_json", sa.Text, nullable=False),
        sa.Column("principal", sa.String(200), nullable=False),
        sa.Column("access_context_digest", sa.String(71), nullable=False),
        sa.Column("target_json", sa.Text, nullable=True),
        sa.Column("base_dir", sa.String(2000), nullable=False),
        sa.Column("row_count", sa.BigInteger, nullable=True),
        sa.Column("output_digest", sa.String(71), nullable=True),
        sa.Column("source_fingerprint_digest", sa.String(71), nullable=True),
        sa.Column("publication_idempotency_key", sa.String(255), nullable=True),
        sa.Column("publication_idempotency_digest", sa.String(71), nullable=True),
        sa.Column("publication_ref", sa.String(1000), nullable=True),
        sa.Column("datasource_ref", sa.String(1000), nullable=True),
        sa.Column("materialization_ref", sa.String(1000), nullable=True),
        sa.Column("warning", sa.Text, nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("updated_at_us", sa.BigInteger, nullable=False),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_dataflow_runs_tenant_key"),
    )
    op.create_index("ix_dataflow_runs_tenant_created", "dataflow_runs", ["tenant", "created_at_us", "run_id"])
    op.create_index("ix_dataflow_runs_status", "dataflow_runs", ["status", "created_at_us"])
    op.create_index("ix_dataflow_runs_recovery_status", "dataflow_runs", ["recovery_status"])
    op.create_table(
        "run_results",
        sa.Column("run_id", sa.String(36), primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("output_digest", sa.String(71), nullable=False),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("row_count", sa.BigInteger, nullable=False),
        sa.Column("bytes", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "datasources",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("provider", sa.String(100), nullable=False),
        sa.Column("location", sa.String(2000), nullable=False),
        sa.Column("options_json", sa.Text, nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("datasources")
    op.drop_table("run_results")
    op.drop_index("ix_dataflow_runs_recovery_status", table_name="dataflow_runs")
    op.drop_index("ix_dataflow_runs_status", table_name="dataflow_runs")
    op.drop_index("ix_dataflow_runs_tenant_created", table_name="dataflow_runs")
    op.drop_table("dataflow_runs")
    op.drop_index("ix_definitions_name_version", table_name="definitions")
    op.drop_table("definitions")
