"""Issue 15, item 6: a SIGKILLed worker's run is recovered at once, whatever its lease TTL (PostgreSQL:
the dead process's session, and with it its holder lock, ended; core/holders.py). A paused worker keeps
its session: the TTL still decides for it. A lease granted before the server started (whose holder's
lock a restart may have ended) waits for its TTL. On SQLite the TTL decides."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow.core import crashpoints as cp
from durable_dataflow.core import leases, ledger
from durable_dataflow.core.schema import leases as lease_rows
from durable_dataflow.dataflow.protocol import evidence, reconcile, runs, sweeper
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import MODULE
from faults import harness
from support.pg import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DAY = "2026-11-02"
LEASE_TTL_S = 30.0  # the test never waits for it
STOP_WAIT_S = 60.0
PROVENANCE = Provenance(actor="fault-test", trigger="cli")


def _start_worker(url: str, tmp_path: Path, definition: Path, key: str, **points: str) -> tuple[str, object]:
    log = tmp_path / f"{key}.log"
    with harness.open_platform(url) as platform:
        run_id = platform.runs.submit(harness.request_for(definition, {"day": DAY}, key)).run.run_id
    env = harness.worker_env(url, lease_ttl_s=LEASE_TTL_S, **points)
    return run_id, (harness.start(harness.worker_args(once=True), env, log), log)


def _lease_expires_us(url: str, run_id: str) -> int:
    with harness.open_platform(url) as platform, platform.db.read() as conn:
        lease = leases.current(conn, MODULE, run_id)
    assert lease is not None
    return lease.expires_at_us


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("forward", "point", "decision"),
    [(False, cp.DURING_EXECUTION, "recovered"), (True, cp.AFTER_PREDISPATCH_COMMIT, "outcome_unknown")],
    ids=["atomic-before-authorization", "forward-after-authorization"],
)
def test_a_killed_workers_attempt_is_decided_before_its_ttl(
    postgres_server: PostgresServer, tmp_path: Path, forward: bool, point: str, decision: str
) -> None:
    url = harness.fresh_database(postgres_server, "gone")
    definition = (
        harness.forward_example(tmp_path, "parquet") if forward
        else harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"
    )  # fmt: skip
    run_id, (killed, log) = _start_worker(url, tmp_path, definition, f"gone-{point}", crash_at=point)
    assert harness.wait_exit(killed, log) == -9, harness.tail(log)
    expires_us = _lease_expires_us(url, run_id)
    with harness.open_platform(url) as platform:
        decided = sweeper.sweep(platform.db)
        with platform.db.read() as conn:
            now_us = platform.db.now_us(conn)
            entries = ledger.read(conn, MODULE, run_id)
        assert [(d.run_id, d.attempt, str(d.decision)) for d in decided] == [(run_id, 1, decision)]
        assert now_us < expires_us, "decided only once the lease had expired"
        closing = entries[-1] if decision == "outcome_unknown" else next(
            e for e in entries if e.kind == evidence.ATTEMPT_RECOVERED
        )  # fmt: skip
        assert closing.payload.get("holder_gone") is True, closing.payload
        if decision == "recovered":  # a fresh worker finishes it under attempt 2
            fresh = harness.start(harness.worker_args(until_idle=True), harness.worker_env(url, lease_ttl_s=5), log)
            assert harness.wait_exit(fresh, log) == 0, harness.tail(log)
            run = platform.runs.get(run_id)
            assert (run.status, run.attempt) == (runs.RunStatus.SUCCEEDED, 2)
        report = harness.check(
            platform.db,
            harness.parquet_publications(definition.parent / "warehouse" / "daily_revenue") if forward else [],
        )
        assert report.violations == [], report.violations
        if forward:  # the stored error names the real cause, and a settled reconcile supersedes it (issue 33)
            unknown = platform.runs.get(run_id)
            assert unknown.error_message == "the attempt's holder process is gone after dispatch authorization"
            settled = reconcile.reconcile(
                platform.runs, run_id, access=AccessContext.local(), provenance=PROVENANCE
            ).run
            assert settled.recovery_status == runs.RecoveryStatus.RECONCILED_ABSENT, settled
            assert settled.error_code == "publication_absent"
            assert settled.error_message is not None and "proved the publication absent" in settled.error_message
            resumed = reconcile.reconcile(
                platform.runs, run_id, access=AccessContext.local(), provenance=PROVENANCE, resume=True
            ).run
            assert (resumed.status, resumed.error_code) == (runs.RunStatus.SUCCEEDED, None)
            published = harness.parquet_publications(definition.parent / "warehouse" / "daily_revenue")
            assert harness.check(platform.db, published).violations == []


@pytest.mark.postgres
def test_a_paused_worker_keeps_its_lease_until_the_ttl(postgres_server: PostgresServer, tmp_path: Path) -> None:
    """SIGSTOP keeps the process's session and its holder lock: the sweep decides nothing, and the resumed
    worker finishes its own attempt."""
    url = harness.fresh_database(postgres_server, "paused")
    definition = harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"
    run_id, (paused, log) = _start_worker(url, tmp_path, definition, "paused", pause_at=cp.DURING_EXECUTION)
    try:
        harness.wait_until(lambda: harness.is_stopped(paused.pid) or paused.poll() is not None, STOP_WAIT_S,
                           "the pause")  # fmt: skip
        assert paused.poll() is None, harness.tail(log)
        with harness.open_platform(url) as platform:
            assert sweeper.sweep(platform.db) == [], "a paused holder was taken for dead"
    finally:
        if paused.returncode is None:
            harness.resume(paused)
    assert harness.wait_exit(paused, log) == 0, harness.tail(log)
    with harness.open_platform(url) as platform:
        run = platform.runs.get(run_id)
    assert (run.status, run.attempt) == (runs.RunStatus.SUCCEEDED, 1)


@pytest.mark.postgres
def test_a_lease_granted_before_the_server_started_waits_for_its_ttl(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """A restart ends live holders' sessions too: a lease older than the server's start is never taken for a
    dead holder's (the same killed worker's lease, dated back, is left to its TTL; restored, it is decided)."""
    url = harness.fresh_database(postgres_server, "restarted")
    definition = harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"
    run_id, (killed, log) = _start_worker(url, tmp_path, definition, "restarted", crash_at=cp.DURING_EXECUTION)
    assert harness.wait_exit(killed, log) == -9, harness.tail(log)
    with harness.open_platform(url) as platform:
        with platform.db.begin() as conn:
            acquired = conn.execute(
                sa.select(lease_rows.c.acquired_at_us).where(lease_rows.c.subject_id == run_id)
            ).scalar_one()
            conn.execute(lease_rows.update().where(lease_rows.c.subject_id == run_id).values(acquired_at_us=0))
        assert sweeper.sweep(platform.db) == []
        with platform.db.begin() as conn:
            conn.execute(lease_rows.update().where(lease_rows.c.subject_id == run_id).values(acquired_at_us=acquired))
        assert [str(d.decision) for d in sweeper.sweep(platform.db)] == ["recovered"]


def test_on_sqlite_a_killed_workers_run_waits_for_its_ttl(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    definition = harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"
    _, (killed, log) = _start_worker(url, tmp_path, definition, "sqlite", crash_at=cp.DURING_EXECUTION)
    assert harness.wait_exit(killed, log) == -9, harness.tail(log)
    with harness.open_platform(url) as platform:
        assert sweeper.sweep(platform.db) == []
        platform.db.advance_clock(LEASE_TTL_S + 1)
        assert [str(d.decision) for d in sweeper.sweep(platform.db)] == ["recovered"]


@pytest.mark.postgres
def test_the_holder_lock_session_is_idle_outside_any_transaction(postgres_server: PostgresServer) -> None:
    """The lock's session must never sit idle in a transaction: idle_in_transaction_session_timeout (which
    docs/deployment.md recommends, and the fault databases set) would end it and with it the lock, and
    sweepers would take the live process for dead."""
    url = harness.fresh_database(postgres_server, "lockidle")
    with harness.open_platform(url) as platform:
        platform.runs.holder_lock.ensure()
        assert platform.runs.holder_lock.held
        with platform.db.read() as conn:
            states = conn.execute(
                sa.text(
                    "SELECT a.state FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()"
                )
            ).scalars().all()
        assert states == ["idle"], states
