"""A partitioned run's datasource and partition on its row: ``dataflow_runs.partition_datasource`` and
``dataflow_runs.partition_json`` (issue 27, partition status).

Partition status lists one tenant's runs of one datasource by partition; without these columns it
would parse the target of every run the tenant ever made. Runs recorded before this revision are
filled in here from what they recorded: the target's datasource and its partition, each ``$name``
resolved with the run's canonical parameters (exactly what ``dataflow.protocol.forward.run_partition`` does),
as RFC 8785 JSON. A run whose stored target or parameters cannot be read is left NULL (it is shown by
``dataflow verify``, not by partition status).

Revision ID: 0011_run_partitions
Revises: 0010_unrecorded_locations
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import InputError

revision = "0011_run_partitions"
down_revision = "0010_unrecorded_locations"
branch_labels = None
depends_on = None

_BATCH_ROWS = 1000  # rows read and updated per statement while filling existing runs


def upgrade() -> None:
    op.add_column("dataflow_runs", sa.Column("partition_datasource", sa.String(200), nullable=True))
    op.add_column("dataflow_runs", sa.Column("partition_json", sa.Text, nullable=True))
    op.create_index(
        "ix_dataflow_runs_partition", "dataflow_runs", ["tenant", "partition_datasource", "created_at_us"]
    )
    _fill_existing_runs()


def _fill_existing_runs() -> None:
    """Every recorded run whose target has a partition gets its datasource and partition values."""
    conn = op.get_bind()
    runs = sa.table(
        "dataflow_runs",
        sa.column("run_id", sa.String),
        sa.column("target_json", sa.Text),
        sa.column("parameters_json", sa.Text),
        sa.column("partition_datasource", sa.String),
        sa.column("partition_json", sa.Text),
    )
    after = ""
    while True:  # bounded: each pass moves past _BATCH_ROWS run ids, in order
        rows = conn.execute(
            sa.select(runs.c.run_id, runs.c.target_json, runs.c.parameters_json)
            .where(runs.c.run_id > after, runs.c.target_json.like('%"partition":%'))
            .order_by(runs.c.run_id)
            .limit(_BATCH_ROWS)
        ).all()
        if not rows:
            return
        for row in rows:
            values = _partition_of(row.target_json, row.parameters_json)
            if values is not None:
                conn.execute(sa.update(runs).where(runs.c.run_id == row.run_id).values(**values))
        after = rows[-1].run_id


def _partition_of(target_json: str, parameters_json: str) -> dict[str, Any] | None:
    try:
        target = json.loads(target_json)
        parameters = json.loads(parameters_json)
        partition = target.get("partition")
        if not isinstance(partition, dict) or not partition:
            return None
        resolved = {
            column: parameters[value[1:]] if isinstance(value, str) and value.startswith("$") else value
            for column, value in partition.items()
        }
        if any(value is None for value in resolved.values()):
            return None
        return {
            "partition_datasource": str(target["datasource"]),
            "partition_json": hashing.canonical_json(resolved).decode("utf-8"),
        }
    except (ValueError, KeyError, TypeError, AttributeError, InputError):
        return None


def downgrade() -> None:
    op.drop_index("ix_dataflow_runs_partition", table_name="dataflow_runs")
    with op.batch_alter_table("dataflow_runs") as batch:
        batch.drop_column("partition_json")
        batch.drop_column("partition_datasource")
