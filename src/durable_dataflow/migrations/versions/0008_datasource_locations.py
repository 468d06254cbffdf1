"""Datasource locations: where each datasource was created, and the provider's identity of what it
created there (``registry.record_location``), so that a registered location that went missing (or
was replaced) is never created again by a later run, and reconcile never reads the new, empty one
as "nothing was published".

A datasource registered before this revision has no recorded place: its location is recorded (as
found) by the first run that prepares it after the upgrade.

Revision ID: 0008_datasource_locations
Revises: 0007_schedules
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_datasource_locations"
down_revision = "0007_schedules"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "datasource_locations",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("place_digest", sa.String(71), nullable=False),
        sa.Column("identity", sa.String(200), nullable=False),
        sa.Column("created_by_run", sa.String(36), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "name", "place_digest", name="pk_datasource_locations"),
    )


def downgrade() -> None:
    op.drop_table("datasource_locations")
