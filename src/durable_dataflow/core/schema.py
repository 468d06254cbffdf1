"""Core tables (DESIGN §4): the ledger, its outbox, the leases and the checkpoints. Module-agnostic.

Times are integer microseconds from the database clock (``*_us``), which RFC 8785 can hash
exactly and both engines store exactly.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

MODULE_LENGTH = 64
SUBJECT_LENGTH = 64
KIND_LENGTH = 64
HASH_LENGTH = 71  # "sha256:" + 64 hex digits

ledger_entries = sa.Table(
    "ledger_entries",
    metadata,
    sa.Column("module", sa.String(MODULE_LENGTH), primary_key=True),
    sa.Column("subject_id", sa.String(SUBJECT_LENGTH), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("kind", sa.String(KIND_LENGTH), nullable=False),
    sa.Column("payload_json", sa.Text, nullable=False),
    sa.Column("prev_hash", sa.String(HASH_LENGTH), nullable=False),
    sa.Column("entry_hash", sa.String(HASH_LENGTH), nullable=False),
    sa.Column("entry_mac", sa.String(HASH_LENGTH), nullable=True),
    sa.Column("recorded_at_us", sa.BigInteger, nullable=False),
    # One entry per subject has seq 1: counting subjects per module reads this small index only.
    sa.Index(
        "ix_ledger_entries_first",
        "module",
        postgresql_where=sa.text("seq = 1"),
        sqlite_where=sa.text("seq = 1"),
    ),
)

# The keys of committed ledger entries not yet delivered outside (lineage events, docs/lineage.md):
# written in the transaction that appends the entry, only while the platform's lineage is configured
# (``Database.ledger_outbox``), and deleted once the entry's event was delivered. Owned by core.ledger.
ledger_outbox = sa.Table(
    "ledger_outbox",
    metadata,
    sa.Column("module", sa.String(MODULE_LENGTH), primary_key=True),
    sa.Column("subject_id", sa.String(SUBJECT_LENGTH), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
)

leases = sa.Table(
    "leases",
    metadata,
    sa.Column("module", sa.String(MODULE_LENGTH), primary_key=True),
    sa.Column("subject_id", sa.String(SUBJECT_LENGTH), primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("acquired_at_us", sa.BigInteger, nullable=False),
    sa.Column("expires_at_us", sa.BigInteger, nullable=False),
    sa.Column("released_at_us", sa.BigInteger, nullable=True),
    # Only held leases matter to the sweeper and to Ops: a partial index keeps them small.
    sa.Index(
        "ix_leases_held_expiry",
        "module",
        "expires_at_us",
        postgresql_where=sa.text("released_at_us IS NULL"),
        sqlite_where=sa.text("released_at_us IS NULL"),
    ),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("module", sa.String(MODULE_LENGTH), primary_key=True),
    sa.Column("subject_id", sa.String(SUBJECT_LENGTH), primary_key=True),
    sa.Column("head_seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("head_hash", sa.String(HASH_LENGTH), nullable=False),
    sa.Column("status", sa.String(KIND_LENGTH), nullable=False),
    sa.Column("facts_json", sa.Text, nullable=False),
    sa.Column("verified_at_us", sa.BigInteger, nullable=False),
)
