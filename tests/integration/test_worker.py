"""The worker loop in-process on SQLite and PostgreSQL: claiming, sweeping, stopping, back-off.

Real processes, crashes and pauses are in tests/faults; here the loop's own decisions are checked
with the real run service and database, and faults injected by replacing one service method.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from structlog.testing import capture_logs

from durable_dataflow.core import ledger
from durable_dataflow.core.errors import InputError, StorageUnavailable
from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.dataflow.worker import BACKOFF_MAX_S, Backoff, Worker, WorkerOptions
from durable_dataflow.platform import Platform
from faults import harness

FAST = {"sweep_interval_s": 0.05, "poll_interval_s": 0.02, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
JOIN_S = 60.0


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=10) as opened:
        yield opened


@pytest.fixture
def definitions(tmp_path: Path) -> tuple[Path, Path]:
    atomic = harness.inline_definition(tmp_path / "defs", "w_atomic")
    forward = harness.inline_definition(tmp_path / "defs", "w_forward", publish_to="sink")
    return atomic, forward


def submit(platform: Platform, definition: Path, number: int) -> str:
    return platform.runs.submit(harness.request_for(definition, {"n": str(number)}, f"k-{number}")).run.run_id


def test_until_idle_runs_every_queued_run_of_both_modes(platform: Platform, definitions: tuple[Path, Path]) -> None:
    """Queued atomic and forward runs all succeed under --until-idle with 2 threads, then it exits."""
    ids = [submit(platform, definitions[n % 2], n) for n in range(6)]
    summary = Worker(platform.runs, WorkerOptions(concurrency=2, until_idle=True, **FAST)).run()
    assert summary.claimed == 6 and summary.outcomes == {"succeeded": 6}
    assert {platform.runs.get(i).status for i in ids} == {"succeeded"}
    assert len(harness.parquet_publications(definitions[1].parent / "sink")) == 3


def test_once_handles_exactly_one_claim(platform: Platform, definitions: tuple[Path, Path]) -> None:
    """--once claims the oldest queued run, carries it to its end and leaves the next one queued."""
    first, second = submit(platform, definitions[0], 1), submit(platform, definitions[0], 2)
    summary = Worker(platform.runs, WorkerOptions(once=True, **FAST)).run()
    assert summary.claimed == 1
    assert (platform.runs.get(first).status, platform.runs.get(second).status) == ("succeeded", "queued")
    assert Worker(platform.runs, WorkerOptions(once=True, **FAST)).run().claimed == 1
    assert Worker(platform.runs, WorkerOptions(once=True, **FAST)).run().claimed == 0  # nothing queued: exits


def test_until_idle_waits_for_an_expired_lease_and_retries_it(
    platform: Platform, db_url: str, definitions: tuple[Path, Path]
) -> None:
    """A run claimed by a vanished worker is not idle: once its lease expires the worker's sweep
    proves the attempt absent and the worker itself runs attempt 2."""
    run_id = submit(platform, definitions[0], 7)
    with Platform(db_url, lease_ttl_s=10) as vanished:
        claim = vanished.runs.claim_next()
    assert claim is not None and claim.attempt == 1
    platform.db.advance_clock(11)  # this worker's view of the database clock: past the lease
    summary = Worker(platform.runs, WorkerOptions(until_idle=True, **FAST)).run()
    run = platform.runs.get(run_id)
    assert (run.status, run.attempt) == ("succeeded", 2)
    assert summary.swept.get("recovered") == 1
    with platform.db.read() as conn:
        kinds = [(e.attempt, e.kind) for e in ledger.read(conn, runs.MODULE, run_id)]
    assert (1, evidence.ATTEMPT_RECOVERED) in kinds


def test_request_stop_stops_claiming_and_drains(platform: Platform, definitions: tuple[Path, Path]) -> None:
    """A worker meant to run forever stops on request (what SIGTERM does) after its in-flight run ends."""
    worker = Worker(platform.runs, WorkerOptions(**FAST))
    finished = threading.Event()
    real_execute = platform.runs.execute

    def execute_then_stop(claim: Any) -> Any:
        worker.request_stop("test")  # arrives while the attempt is in flight
        run = real_execute(claim)
        finished.set()
        return run

    platform.runs.execute = execute_then_stop  # type: ignore[method-assign]
    ids = [submit(platform, definitions[0], n) for n in range(3)]
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive() and finished.is_set()
    assert worker.summary.stopped_by_request and worker.summary.claimed == 1
    assert [platform.runs.get(i).status for i in ids] == ["succeeded", "queued", "queued"]


def test_a_stop_asked_for_during_a_sweep_claims_nothing_more(
    platform: Platform, definitions: tuple[Path, Path]
) -> None:
    """Proves a stop asked for during a turn's sweep (where a SIGTERM's handler runs when the signal arrives
    while the main thread sweeps) ends the loop before that turn's claim: the queued run stays queued for
    another worker (the code before claimed it, and the signal's interruption then cancelled it)."""
    worker = Worker(platform.runs, WorkerOptions(**FAST))
    real_sweep = worker._sweep

    def sweep_then_stop() -> None:
        real_sweep()
        worker.request_stop("SIGTERM")

    worker._sweep = sweep_then_stop  # type: ignore[method-assign]
    run_id = submit(platform, definitions[0], 1)
    summary = worker.run()
    assert summary.stopped_by_request and summary.claimed == 0
    assert platform.runs.get(run_id).status == "queued"


def test_an_error_escaping_an_attempt_thread_is_logged(platform: Platform, definitions: tuple[Path, Path]) -> None:
    """Proves an error that escapes an attempt thread (here the run observer's, outside the attempt) is
    logged when the loop reaps it (``attempt_thread.failed``), never dropped with its future, and that the
    run's own ``run.finished`` line is written before the observer is called."""

    def broken_observer(run: Any, seconds: float) -> None:
        raise RuntimeError("a bug in the metrics")

    run_id = submit(platform, definitions[0], 1)
    with capture_logs() as logs:
        Worker(platform.runs, WorkerOptions(until_idle=True, **FAST), observe=broken_observer).run()
    failed = [e for e in logs if e["event"] == "attempt_thread.failed"]
    assert len(failed) == 1 and failed[0]["error_type"] == "RuntimeError", failed
    assert failed[0]["run_id"] == run_id
    finished = [e for e in logs if e["event"] == "run.finished"]  # logged before the observer's bug
    assert [(e["run_id"], e["outcome"]) for e in finished] == [(run_id, "succeeded")]
    assert platform.runs.get(run_id).status == "succeeded"


def test_down_database_backs_off_and_retries_only_guarded_steps(
    platform: Platform, definitions: tuple[Path, Path]
) -> None:
    """Claims failing with StorageUnavailable are retried after growing delays; the run then succeeds."""
    run_id = submit(platform, definitions[0], 3)
    real_claim = platform.runs.claim_next
    failures = iter(range(3))

    def flaky_claim() -> Any:
        if next(failures, None) is not None:
            raise StorageUnavailable("the platform database is unavailable: connection refused")
        return real_claim()

    platform.runs.claim_next = flaky_claim  # type: ignore[method-assign]
    with capture_logs() as logs:
        summary = Worker(platform.runs, WorkerOptions(until_idle=True, **FAST)).run()
    delays = [e["retry_in_s"] for e in logs if e["event"] == "storage.unavailable"]
    assert delays == [0.01, 0.02, 0.04] and summary.storage_failures == 3
    assert platform.runs.get(run_id).status == "succeeded"


def test_attempt_that_loses_the_database_is_left_to_the_sweeper(
    platform: Platform, definitions: tuple[Path, Path]
) -> None:
    """An attempt whose execution raises StorageUnavailable is abandoned, never re-executed by the worker."""
    run_id = submit(platform, definitions[1], 4)

    def lost(claim: Any) -> Any:
        raise StorageUnavailable("the database connection failed: server closed the connection")

    platform.runs.execute = lost  # type: ignore[method-assign]
    with capture_logs() as logs:
        summary = Worker(platform.runs, WorkerOptions(once=True, **FAST)).run()
    assert summary.claimed == 1 and summary.abandoned == 1
    run = platform.runs.get(run_id)
    assert (run.status, run.attempt) == ("running", 1)  # its lease decides: the sweeper, not a blind retry
    abandoned = [e for e in logs if e["event"] == "attempt.abandoned"]
    assert abandoned and abandoned[0]["run_id"] == run_id and abandoned[0]["attempt"] == 1


def test_options_and_backoff_are_bounded() -> None:
    """Concurrency and intervals outside their limits are refused; the back-off doubles up to its cap."""
    with pytest.raises(InputError):
        WorkerOptions(concurrency=0)
    with pytest.raises(InputError):
        WorkerOptions(concurrency=9)
    with pytest.raises(InputError):
        WorkerOptions(poll_interval_s=0)
    backoff = Backoff(1.0, BACKOFF_MAX_S)
    delays = [backoff.next_delay_s() for _ in range(8)]
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0] and max(delays) == BACKOFF_MAX_S
    backoff.reset()
    assert backoff.next_delay_s() == 1.0


def test_a_session_ended_by_the_server_is_storage_unavailable(pg_url: str) -> None:
    """A paused worker's transaction ended by idle_in_transaction_session_timeout surfaces as
    StorageUnavailable (an outage the loop backs off from), not as an unexpected driver error."""
    import time

    import sqlalchemy as sa

    from durable_dataflow.core.db import Database

    db = Database(pg_url)
    try:
        with pytest.raises(StorageUnavailable, match="idle-in-transaction"), db.begin() as conn:
            conn.execute(sa.text("set idle_in_transaction_session_timeout = '100ms'"))
            time.sleep(0.5)  # idle inside the transaction past the server's timeout: the thing under test
            conn.execute(sa.text("select 1"))
        with db.read() as conn:
            assert conn.execute(sa.text("select 1")).scalar() == 1  # the pool recovers
    finally:
        db.dispose()


def test_an_idle_worker_reads_whether_anything_is_queued_before_it_claims_again(
    platform: Platform, definitions: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a worker whose claim found nothing polls with one read of the status index (runs.any_queued)
    instead of the claim's transaction, and claims (and runs) a run as soon as one is queued."""
    claims: list[Any] = []
    probes: list[bool] = []
    polled, claimed = threading.Event(), threading.Event()
    claim_next, any_queued = platform.runs.claim_next, runs.any_queued

    def counting_claim() -> Any:
        claims.append(claim := claim_next())
        if claim is not None:
            claimed.set()
        return claim

    def counting_probe(conn: Any) -> bool:
        probes.append(queued := any_queued(conn))
        if len(probes) == 5:
            polled.set()
        return queued

    monkeypatch.setattr(platform.runs, "claim_next", counting_claim)
    monkeypatch.setattr(runs, "any_queued", counting_probe)
    worker = Worker(platform.runs, WorkerOptions(**FAST))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert polled.wait(JOIN_S), "the idle worker polls by reading"
        assert claims == [None], "one claim found nothing; the polls after it did not claim"
        run_id = submit(platform, definitions[0], 1)
        assert claimed.wait(JOIN_S), "a queued run is claimed"
    finally:
        worker.request_stop("test done")
        thread.join(JOIN_S)
    assert True in probes and len(claims) == 2
    assert platform.runs.get(run_id).status == "succeeded"


def _outage_while_lease_writes_time_out(
    platform: Platform, options: dict[str, Any], enough: int, started: Callable[[], None] = lambda: None
) -> list[dict[str, Any]]:
    """Run a worker while every lease write of its threads times out (as behind a long lock) and everything
    else works; ``started`` runs once its thread has started. Stops it at the ``enough``-th failed write
    and returns its ``storage.*`` events."""
    dbapi = platform.runs.db.engine.dialect.loaded_dbapi
    worker_threads: list[threading.Thread] = []
    failures: list[str] = []
    failed_enough = threading.Event()

    def lease_write_times_out(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        writes_a_lease = " leases" in statement and statement.lstrip()[:6].upper() in ("INSERT", "UPDATE")
        if writes_a_lease and threading.current_thread() in worker_threads:
            failures.append(statement)
            if len(failures) == enough:
                failed_enough.set()
            raise dbapi.OperationalError("canceling statement due to lock timeout")

    event.listen(platform.runs.db.engine, "before_cursor_execute", lease_write_times_out)
    worker = Worker(platform.runs, WorkerOptions(**options))
    thread = threading.Thread(target=worker.run)
    worker_threads.append(thread)
    try:
        with capture_logs() as logs:
            thread.start()
            started()
            assert failed_enough.wait(JOIN_S), "its claims fail"
            worker.request_stop("test done")
            thread.join(JOIN_S)
    finally:
        worker.request_stop("test done")
        thread.join(JOIN_S)
        event.remove(platform.runs.db.engine, "before_cursor_execute", lease_write_times_out)
    return [e for e in logs if e["event"].startswith("storage.")]

def test_an_idle_worker_whose_claims_fail_while_reads_work_backs_off_and_logs_one_outage(
    platform: Platform, definitions: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a worker whose claim found nothing, and whose claims then fail (the lease write times out,
    as behind a long lock) while reads still work, backs off with growing delays and logs one outage: the
    idle read's success neither ends the back-off nor logs a recovery (found by a review of the read)."""
    idle = threading.Event()
    claim_next = platform.runs.claim_next

    def claim() -> Any:
        if (found := claim_next()) is None:
            idle.set()
        return found

    def submit_once_idle() -> None:
        assert idle.wait(JOIN_S), "the worker found nothing to claim"
        submit(platform, definitions[0], 1)

    monkeypatch.setattr(platform.runs, "claim_next", claim)
    options = {**FAST, "sweep_interval_s": 60.0, "backoff_max_s": 0.64}
    events = _outage_while_lease_writes_time_out(platform, options, 6, submit_once_idle)
    outage = [(e["event"], e.get("retry_in_s")) for e in events]
    assert [delay for kind, delay in outage[:6]] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32], outage
    assert "storage.recovered" not in [kind for kind, _ in outage], outage


def test_a_worker_whose_claims_fail_while_its_beats_work_keeps_backing_off(
    platform: Platform, definitions: tuple[Path, Path]
) -> None:
    """Proves a heartbeat's success does not end an outage its claims are in: with a run queued and every
    lease write timing out (as behind a long lock) while the worker's heartbeat row is beaten every 0.1 s,
    the claim's delays grow to the maximum and stay there, and no recovery is logged (the code before
    reset the back-off and logged ``storage.recovered`` at every beat, so the delays started over)."""
    submit(platform, definitions[0], 1)
    options = {**FAST, "sweep_interval_s": 60.0, "backoff_max_s": 0.16, "worker_ttl_s": 0.3}  # a beat every 0.1 s
    events = _outage_while_lease_writes_time_out(platform, options, 12)
    assert {e.get("operation") for e in events} == {"claim"}, events  # the beats worked throughout
    outage = [(e["event"], e.get("retry_in_s")) for e in events]
    assert [delay for kind, delay in outage[:10]] == [0.01, 0.02, 0.04, 0.08] + [0.16] * 6, outage
    assert "storage.recovered" not in [kind for kind, _ in outage], outage
