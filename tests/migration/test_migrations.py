"""A database built by the migrations equals one built from the metadata, on both engines."""

from __future__ import annotations

import json

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


def _old_run(run_id: str, target: dict[str, object] | None, parameters: dict[str, object]) -> dict[str, object]:
    """A dataflow_runs row as revision 0010 stored it."""
    return {
        "run_id": run_id, "tenant": "acme", "idempotency_key": run_id, "definition_hash": "sha256:d",
        "definition_name": "daily", "request_hash": "sha256:r", "mode": "forward_recovery", "status": "succeeded",
        "recovery_status": "verified", "attempt": 1, "max_attempts": 3,
        "parameters_json": json.dumps(parameters), "provenance_json": "{}", "principal": "p",
        "access_context_digest": "sha256:a", "target_json": json.dumps(target) if target is not None else None,
        "base_dir": "/tmp", "created_at_us": 1, "updated_at_us": 1,
    }  # fmt: skip


def test_0011_fills_the_partition_of_runs_recorded_before_it(db_url: str) -> None:
    """Runs recorded at revision 0010 (a partitioned one, one with a literal partition value, an
    unpartitioned one, one whose parameters are damaged) get their datasource and canonical partition
    from the upgrade to 0011; the others stay NULL."""
    db = Database(db_url)
    try:
        migrations.upgrade(db, "0010_unrecorded_locations")
        target = {"datasource": "analytics.daily", "mode": "replace_partition", "partition": {"day": "$day", "n": 3}}
        rows = [
            _old_run("r-partitioned", target, {"day": "2024-03-01", "x": 1}),
            _old_run("r-plain", {"datasource": "analytics.daily", "mode": "append"}, {"day": "2024-03-01"}),
            _old_run("r-atomic", None, {}),
            _old_run("r-damaged", target, {}),
        ]
        with db.begin() as conn:
            conn.execute(sa.table("dataflow_runs", *(sa.column(name) for name in rows[0])).insert(), rows)
        migrations.upgrade(db)
        with db.read() as conn:
            found = conn.execute(
                sa.text("SELECT run_id, partition_datasource, partition_json FROM dataflow_runs ORDER BY run_id")
            ).all()
        assert [tuple(row) for row in found] == [
            ("r-atomic", None, None),
            ("r-damaged", None, None),
            ("r-partitioned", "analytics.daily", '{"day":"2024-03-01","n":3}'),
            ("r-plain", None, None),
        ]
    finally:
        db.dispose()


def test_0017_counts_the_results_stored_before_it_per_tenant(db_url: str) -> None:
    """Results stored at revision 0016 (two of acme's runs, one of globex's, a run of initech without a
    result) are summed per tenant into tenant_result_bytes by the upgrade to 0017; a tenant with no
    stored result gets no row (the quota reads that as 0)."""
    db = Database(db_url)
    try:
        migrations.upgrade(db, "0016_runs_by_tenant_definition")
        owners = {"a1": "acme", "a2": "acme", "g1": "globex", "i1": "initech"}
        runs = [{**_old_run(run_id, None, {}), "tenant": tenant} for run_id, tenant in owners.items()]
        stored = {"a1": 1000, "a2": 234, "g1": 7}
        results = [
            {"run_id": run_id, "attempt": 1, "output_digest": "sha256:o", "format": "f", "row_count": 1,
             "bytes": b"x" * size}
            for run_id, size in stored.items()
        ]  # fmt: skip
        with db.begin() as conn:
            conn.execute(sa.table("dataflow_runs", *(sa.column(name) for name in runs[0])).insert(), runs)
            conn.execute(sa.table("run_results", *(sa.column(name) for name in results[0])).insert(), results)
        migrations.upgrade(db)
        with db.read() as conn:
            found = conn.execute(sa.text("SELECT tenant, stored_bytes FROM tenant_result_bytes ORDER BY tenant")).all()
        assert [tuple(row) for row in found] == [("acme", 1234), ("globex", 7)]
    finally:
        db.dispose()
