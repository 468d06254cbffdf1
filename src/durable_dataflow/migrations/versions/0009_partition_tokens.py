"""Partition tokens: the monotonic token per tenant, datasource and partition that each dispatch
authorization of a `mode: replace_partition` run takes (`dataflow.protocol.partition_tokens`).

Revision ID: 0009_partition_tokens
Revises: 0008_datasource_locations
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_partition_tokens"
down_revision = "0008_datasource_locations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "partition_tokens",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("datasource", sa.String(200), nullable=False),
        sa.Column("partition_digest", sa.String(71), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("tenant", "datasource", "partition_digest", name="pk_partition_tokens"),
    )


def downgrade() -> None:
    op.drop_table("partition_tokens")
