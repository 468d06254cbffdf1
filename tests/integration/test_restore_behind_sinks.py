"""Restoring the platform database behind its sinks (issue 33, item 4; docs/runbooks.md "Backup and restore").

A dump of the platform database taken before a publication, restored after it, has lost the record of
that publication while the sink keeps it. Each test takes a real `pg_dump` of a PostgreSQL platform
database at one moment, publishes to a PostgreSQL table sink in another database of the cluster (never
restored), restores the dump into a fresh database with `pg_restore`, and shows what the restored
platform does, reading the sink back by SQL:

- a run **queued** at the dump is claimed again and finds its publication present (the sink's key is
  the run's, `dataflow/<tenant>/key/<sha256 of its idempotency key>`): succeeded, nothing published twice;
- a run **authorized to dispatch** at the dump is swept to `outcome_unknown`, and `reconcile` finds the
  publication present: `reconciled_present`, nothing published twice;
- a run **submitted after** the dump is unknown to the restored platform: a re-submission of its
  idempotency key records a new run, but its publication key derives from the tenant and the
  idempotency key (not the run id), so the sink already holds it: nothing is published twice.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from durable_dataflow.dataflow.protocol import reconcile, sweeper
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import PublishOutcome, PublishTarget
from durable_dataflow.datasources.postgres_table import PostgresTableProvider
from durable_dataflow.platform import Platform
from support import flows
from support.pg import PostgresServer

pytestmark = pytest.mark.postgres

SINK_SECRET = "TEST_RESTORE_SINK_DSN"
SINK_TABLE = "public.totals"
DUMPING_PROVIDER = "postgres_dump_first"
DUMP_TIMEOUT_S = 60
SWEEP_DEADLINE_TRIES_MAX = 50
# The rows one publication of flows.definition() adds to the sink table (one per region).
ROWS_PER_PUBLICATION = 2


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


class _Cluster:
    """Databases of the test cluster made for one test, dropped afterwards, and its pg_dump/pg_restore."""

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.names: list[str] = []

    def database(self, role: str) -> str:
        name = f"dataflow_{role}_{uuid.uuid4().hex[:12]}"
        self.names.append(name)
        return self.server.create_database(name)

    def dump(self, url: str, file: Path) -> None:
        """`pg_dump -Fc` of the database, from the cluster's own bin directory (as the runbook does)."""
        argv = [str(self.server.bindir / "pg_dump"), "-Fc", "-f", str(file), "-d", _libpq(url)]
        subprocess.run(argv, check=True, capture_output=True, timeout=DUMP_TIMEOUT_S)

    def restore(self, file: Path) -> str:
        """`pg_restore` of a dump into a fresh database; its URL."""
        url = self.database("restored")
        argv = [str(self.server.bindir / "pg_restore"), "--no-owner", "-d", _libpq(url), str(file)]
        subprocess.run(argv, check=True, capture_output=True, timeout=DUMP_TIMEOUT_S)
        return url

    def drop_all(self) -> None:
        for name in self.names:
            self.server.drop_database(name)


@pytest.fixture
def cluster(postgres_server: PostgresServer) -> Iterator[_Cluster]:
    made = _Cluster(postgres_server)
    try:
        yield made
    finally:
        made.drop_all()


@pytest.fixture
def sink_url(cluster: _Cluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """The sink database (never restored), published as the DSN secret the definitions name."""
    url = cluster.database("sink")
    monkeypatch.setenv(SINK_SECRET, _libpq(url))
    return url


def _definition(provider: str = "postgres") -> Any:
    target = {**flows.parquet_target(provider, SINK_TABLE), "options": {"dsn": {"secret": SINK_SECRET}}}
    return flows.definition(target)


def _sink_publications(sink_url: str) -> list[tuple[str, int]]:
    """The sink's own record of publications (key, rows), and the table's rows per key, read by SQL."""
    with psycopg.connect(_libpq(sink_url)) as conn:
        recorded = conn.execute("SELECT idempotency_key, row_count FROM sink_publications ORDER BY 1").fetchall()
        tagged = conn.execute(f"SELECT _publication_key, count(*) FROM {SINK_TABLE} GROUP BY 1 ORDER BY 1").fetchall()
    assert [(str(k), int(n)) for k, n in recorded] == [(str(k), int(n)) for k, n in tagged]
    return [(str(k), int(n)) for k, n in recorded]


def _run_queued(platform: Platform) -> Run:
    """Claim the queued run and carry its attempt to its end, as a worker does."""
    claim = platform.runs.claim_next()
    assert claim is not None
    return platform.runs.execute(claim)


# The runbook's query (docs/runbooks.md, "Restoring", step 4): every sink key a run of the platform
# database publishes, or would publish, under.
KNOWN_KEYS_SQL = """
SELECT publication_idempotency_key FROM dataflow_runs WHERE publication_idempotency_key IS NOT NULL
UNION
SELECT 'dataflow/' || tenant || '/key/' || encode(sha256(convert_to(idempotency_key, 'UTF8')), 'hex')
FROM dataflow_runs
"""


def _unknown_keys(platform: Platform, sink_url: str) -> list[str]:
    """The runbook's check after a restore: publication keys in the sink whose run the platform does not know."""
    with platform.db.read() as conn:
        known = {row[0] for row in conn.exec_driver_sql(KNOWN_KEYS_SQL)}
    return [key for key, _ in _sink_publications(sink_url) if key not in known]


def test_a_run_queued_at_the_dump_finds_its_publication_after_the_restore(
    cluster: _Cluster, pg_url: str, sink_url: str, tmp_path: Path
) -> None:
    """Queued at the dump, published, restored: the restored platform runs it again, the sink answers already
    published with the same digest, the run succeeds, and the sink still holds one publication."""
    with Platform(pg_url) as before:
        queued = before.runs.submit(flows.request(_definition(), tmp_path, "rev-1")).run
        cluster.dump(pg_url, tmp_path / "platform.dump")
        published = _run_queued(before)
    assert published.status == "succeeded"
    assert _sink_publications(sink_url) == [(published.publication_idempotency_key, ROWS_PER_PUBLICATION)]

    with Platform(cluster.restore(tmp_path / "platform.dump")) as restored:
        assert restored.runs.get(queued.run_id).status == "queued"  # the record of the publication is lost
        again = _run_queued(restored)
        assert _unknown_keys(restored, sink_url) == []
    assert (again.status, again.recovery_status) == ("succeeded", "verified")
    assert again.publication_idempotency_key == published.publication_idempotency_key
    assert _sink_publications(sink_url) == [(published.publication_idempotency_key, ROWS_PER_PUBLICATION)]


class _DumpFirst(PostgresTableProvider):
    """The PostgreSQL table provider, except that each publish first dumps the platform database: the dump
    then holds the run as it is between its dispatch authorization and the sink's commit."""

    def __init__(self, dump: Any) -> None:
        super().__init__()
        self._dump = dump

    def publish(self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget) -> PublishOutcome:
        self._dump()
        return super().publish(key, token, table, digest, target)


def test_a_run_authorized_at_the_dump_is_reconciled_present_after_the_restore(
    cluster: _Cluster, pg_url: str, sink_url: str, tmp_path: Path
) -> None:
    """Dumped after dispatch authorization, published, restored: the sweep makes it outcome_unknown (its holder's
    lock is not held in the restored database), and reconcile finds the publication present, publishing nothing."""
    dump = tmp_path / "platform.dump"
    registry.register_provider(DUMPING_PROVIDER, lambda: _DumpFirst(lambda: cluster.dump(pg_url, dump)))
    try:
        with Platform(pg_url) as before:
            before.runs.submit(flows.request(_definition(DUMPING_PROVIDER), tmp_path, "rev-2"))
            published = _run_queued(before)
        assert published.status == "succeeded"
        with Platform(cluster.restore(dump)) as restored:
            assert restored.runs.get(published.run_id).recovery_status == "dispatch_authorized"
            decided = _sweep_until_decided(restored, published.run_id)
            assert (decided.status, decided.recovery_status) == ("outcome_unknown", "outcome_unknown")
            access = AccessContext("acme", "tester", ("operator",), (), "test")
            settled = reconcile.reconcile(
                restored.runs, published.run_id, access=access, provenance=Provenance("tester", "cli")
            ).run
    finally:
        registry.unregister_provider(DUMPING_PROVIDER)
    assert (settled.status, settled.recovery_status) == ("succeeded", "reconciled_present")
    assert _sink_publications(sink_url) == [(published.publication_idempotency_key, ROWS_PER_PUBLICATION)]


def _sweep_until_decided(platform: Platform, run_id: str) -> Run:
    """Sweep until the run's attempt is decided (its holder's lock is free at once in a restored database)."""
    for _ in range(SWEEP_DEADLINE_TRIES_MAX):
        sweeper.sweep_run(platform.db, run_id, evidence_key=platform.runs.config.evidence_key)
        run = platform.runs.get(run_id)
        if run.status != "running":
            return run
    raise AssertionError(f"run {run_id} was not decided after {SWEEP_DEADLINE_TRIES_MAX} sweeps")


def test_a_run_submitted_after_the_dump_and_submitted_again_is_not_published_twice(
    cluster: _Cluster, pg_url: str, sink_url: str, tmp_path: Path
) -> None:
    """Submitted after the dump, published, restored: the platform has no record of the run, and
    re-submitting its idempotency key records a NEW run. Its publication key derives from the tenant
    and the idempotency key, not the run id, so it is the lost run's key: the sink already holds it
    with the same digest (AlreadyPublished), the new run succeeds, and nothing is published twice. The
    runbook's check (sink keys of runs the platform does not know) still lists the lost publication."""
    with Platform(pg_url) as before:
        cluster.dump(pg_url, tmp_path / "platform.dump")
        before.runs.submit(flows.request(_definition(), tmp_path, "rev-3"))
        lost = _run_queued(before)
    assert lost.status == "succeeded"

    with Platform(cluster.restore(tmp_path / "platform.dump")) as restored:
        assert _unknown_keys(restored, sink_url) == [lost.publication_idempotency_key]
        resubmitted = restored.runs.submit(flows.request(_definition(), tmp_path, "rev-3"))
        assert resubmitted.created, "the restored platform has no record of the key: a new run is recorded"
        again = _run_queued(restored)
    assert again.run_id != lost.run_id and again.publication_idempotency_key == lost.publication_idempotency_key
    assert again.status == "succeeded" and again.output_digest == lost.output_digest
    assert _sink_publications(sink_url) == [(lost.publication_idempotency_key, ROWS_PER_PUBLICATION)]


def test_a_run_without_a_key_publishes_under_a_key_of_its_own(pg_url: str, sink_url: str, tmp_path: Path) -> None:
    """Runs submitted without an idempotency key are distinct requests: each publishes under its own key."""
    with Platform(pg_url) as platform:
        first = platform.runs.run_inline(flows.request(_definition(), tmp_path, None)).run
        second = platform.runs.run_inline(flows.request(_definition(), tmp_path, None)).run
    assert first.status == second.status == "succeeded"
    assert first.publication_idempotency_key != second.publication_idempotency_key
    assert len(_sink_publications(sink_url)) == 2
