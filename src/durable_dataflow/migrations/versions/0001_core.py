"""Core tables: ledger entries, leases, checkpoints.

Revision ID: 0001_core
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_entries",
        sa.Column("module", sa.String(64), primary_key=True),
        sa.Column("subject_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("payload_json", sa.Text, nullable=False),
        sa.Column("prev_hash", sa.String(71), nullable=False),
        sa.Column("entry_hash", sa.String(71), nullable=False),
        sa.Column("entry_mac", sa.String(71), nullable=True),
        sa.Column("recorded_at_us", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "leases",
        sa.Column("module", sa.String(64), primary_key=True),
        sa.Column("subject_id", sa.String(64), primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("acquired_at_us", sa.BigInteger, nullable=False),
        sa.Column("expires_at_us", sa.BigInteger, nullable=False),
        sa.Column("released_at_us", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_leases_expiry", "leases", ["module", "released_at_us", "expires_at_us"])
    op.create_table(
        "checkpoints",
        sa.Column("module", sa.String(64), primary_key=True),
        sa.Column("subject_id", sa.String(64), primary_key=True),
        sa.Column("head_seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("head_hash", sa.String(71), nullable=False),
        sa.Column("status", sa.String(64), nullable=False),
        sa.Column("facts_json", sa.Text, nullable=False),
        sa.Column("verified_at_us", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
    op.drop_index("ix_leases_expiry", table_name="leases")
    op.drop_table("leases")
    op.drop_table("ledger_entries")
