"""A database built by the migrations equals one built from the metadata, on both engines."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from durable_dataflow import migrations
from durable_dataflow.core.db import Database


def test_migrations_match_the_metadata(db_url: str) -> None:
    """Alembic's autogenerate finds no difference between the migrated schema and every part's metadata."""
    db = Database(db_url)
    try:
        migrations.upgrade(db)
        combined = sa.MetaData()
        for metadata in migrations.all_metadata():
            for table in metadata.tables.values():
                table.to_metadata(combined)
        with db.read() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            real = [d for d in compare_metadata(context, combined) if not _is_alembic_bookkeeping(d)]
        assert real == [], real
        assert migrations.current_revision(db) == migrations.head_revision()
    finally:
        db.dispose()


def _is_alembic_bookkeeping(diff: object) -> bool:
    return isinstance(diff, tuple) and diff[0] == "remove_table" and diff[1].name == "alembic_version"


def test_upgrade_is_idempotent(db_url: str) -> None:
    """Upgrading twice changes nothing and leaves the head revision."""
    db = Database(db_url)
    try:
        migrations.upgrade(db)
        migrations.upgrade(db)
        with db.read() as conn:
            tables = set(sa.inspect(conn).get_table_names())
        assert {"ledger_entries", "leases", "checkpoints", "dataflow_runs", "run_results"} <= tables
    finally:
        db.dispose()


def test_the_head_revision_constant_is_alembics_head() -> None:
    """Proves HEAD_REVISION (the fast up-to-date check that avoids importing Alembic) names the newest
    migration; it fails when a migration is added without moving the constant."""
    assert migrations.head_revision() == migrations.HEAD_REVISION
