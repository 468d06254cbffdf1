"""Workers you can see (issue 33): one heartbeat row per worker process and per `dataflow serve` sweeper.

``workers`` is owned by ``dataflow.protocol.fleet``; ``ix_workers_beat`` serves the pruning of old rows.

Revision ID: 0013_workers
Revises: 0012_fair_work
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_workers"
down_revision = "0012_fair_work"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("holder", sa.String(200), primary_key=True),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("started_at_us", sa.BigInteger, nullable=False),
        sa.Column("beat_at_us", sa.BigInteger, nullable=False),
        sa.Column("stopped_at_us", sa.BigInteger, nullable=True),
        sa.Column("inflight", sa.Integer, nullable=False),
        sa.Column("concurrency", sa.Integer, nullable=False),
        sa.Column("ttl_us", sa.BigInteger, nullable=False),
        sa.Column("holder_locked", sa.Boolean, nullable=False),
    )
    op.create_index("ix_workers_beat", "workers", ["beat_at_us"])


def downgrade() -> None:
    op.drop_index("ix_workers_beat", table_name="workers")
    op.drop_table("workers")
