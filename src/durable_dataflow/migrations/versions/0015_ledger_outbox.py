"""The ledger outbox (issue 32): the keys of committed ledger entries awaiting delivery as lineage events.

``ledger_outbox`` is owned by ``core.ledger``: written in the transaction that appends an entry while
lineage is configured, deleted once the entry's event was delivered (docs/lineage.md).

Revision ID: 0015_ledger_outbox
Revises: 0014_result_storage
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_ledger_outbox"
down_revision = "0014_result_storage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_outbox",
        sa.Column("module", sa.String(64), primary_key=True),
        sa.Column("subject_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    )


def downgrade() -> None:
    op.drop_table("ledger_outbox")
