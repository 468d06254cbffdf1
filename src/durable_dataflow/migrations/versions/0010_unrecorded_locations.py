"""Datasources registered before locations were recorded: ``datasources.locations_unrecorded``.

A datasource that a publication registered before revision 0008 has no recorded place, so the first
run after the upgrade could not tell a location the platform created and lost (a volume not mounted)
from one it never created, and created it afresh: a later reconcile could then find an earlier run's
key absent there. Every such registration (created by a run, no place recorded yet) is marked here;
where nothing is found at a place of a marked datasource, a run fails before dispatch and reconcile
stays undecided, until a platform operator runs ``dataflow datasources forget``, which clears it.

Revision ID: 0010_unrecorded_locations
Revises: 0009_partition_tokens
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_unrecorded_locations"
down_revision = "0009_partition_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "datasources", sa.Column("locations_unrecorded", sa.Boolean, nullable=False, server_default=sa.false())
    )
    op.execute(
        "UPDATE datasources SET locations_unrecorded = TRUE WHERE created_by_run IS NOT NULL AND NOT EXISTS "
        "(SELECT 1 FROM datasource_locations l WHERE l.tenant = datasources.tenant AND l.name = datasources.name)"
    )


def downgrade() -> None:
    with op.batch_alter_table("datasources") as batch:
        batch.drop_column("locations_unrecorded")
