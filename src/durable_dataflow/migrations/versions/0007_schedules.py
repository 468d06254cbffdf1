"""Schedules (docs/schedules.md): applied schedules and one decision per tick.

Revision ID: 0007_schedules
Revises: 0006_datasource_registrations
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_schedules"
down_revision = "0006_datasource_registrations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("definition_hash", sa.String(71), nullable=False),
        sa.Column("definition_json", sa.Text, nullable=False),
        sa.Column("schedule_json", sa.Text, nullable=False),
        sa.Column("workspace_json", sa.Text, nullable=False),
        sa.Column("applied_by", sa.String(200), nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False),
        sa.Column("applied_at_us", sa.BigInteger, nullable=False),
        sa.Column("updated_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("tenant", "name", name="pk_schedules"),
    )
    op.create_table(
        "schedule_ticks",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("tick_us", sa.BigInteger, nullable=False),
        sa.Column("decision", sa.String(32), nullable=False),
        sa.Column("run_id", sa.String(36), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("decided_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("tenant", "name", "tick_us", name="pk_schedule_ticks"),
    )


def downgrade() -> None:
    op.drop_table("schedule_ticks")
    op.drop_table("schedules")
