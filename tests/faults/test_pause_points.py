"""SIGSTOP a real worker at every pause point past its lease, let a fresh worker take over and
finish, then SIGCONT the first: none of its writes commits — no ledger entry, no projection or
result change — and the sink still holds at most one publication. A point that only ``dataflow
reconcile`` reaches is never reached by a plain run: that worker finishes without pausing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import crashpoints as cp
from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.dataflow.protocol.runs import MODULE
from durable_dataflow.dataflow.schema import run_results
from durable_dataflow.platform import Platform
from faults import harness
from support.pg import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

DAY = "2026-11-02"
PAUSED_TTL_S = 1.5
FRESH_TTL_S = 5.0
STOP_WAIT_S = 60.0
BEFORE_AUTHORIZATION = (cp.AFTER_CLAIM, cp.AFTER_PREPARE, cp.DURING_EXECUTION, cp.BEFORE_PREDISPATCH_COMMIT)
AFTER_AUTHORIZATION = (cp.AFTER_PREDISPATCH_COMMIT, cp.AFTER_PROVIDER_CALL, cp.BEFORE_TERMINAL_COMMIT)
FIRST_POINTS = (cp.AFTER_RECORD, cp.AFTER_TERMINAL_COMMIT)
RECONCILE_ONLY_POINTS = (cp.AFTER_INSPECT,)  # reached only by `dataflow reconcile`, never by a plain run
ATOMIC_POINTS = (cp.AFTER_CLAIM, cp.DURING_EXECUTION, cp.BEFORE_TERMINAL_COMMIT, cp.AFTER_TERMINAL_COMMIT)


@dataclass(frozen=True)
class Case:
    forward: bool
    point: str

    @property
    def expected(self) -> tuple[str, int]:
        """(status, attempt) once the fresh worker is done."""
        if self.point in FIRST_POINTS or self.point in RECONCILE_ONLY_POINTS:
            return ("succeeded", 1)
        if not self.forward or self.point in BEFORE_AUTHORIZATION:
            return ("succeeded", 2)
        return ("outcome_unknown", 1)


CASES = [Case(False, p) for p in ATOMIC_POINTS] + [Case(True, p) for p in cp.POINTS]


@dataclass(frozen=True)
class Snapshot:
    """Everything the platform database holds about the run."""

    entries: tuple[tuple[int, int, str, str], ...]
    run: dict[str, Any]
    result: tuple[Any, ...] | None


@dataclass(frozen=True)
class Outcome:
    taken_over: Snapshot
    resumed: Snapshot
    pubs_taken_over: list[harness.Publication]
    pubs_resumed: list[harness.Publication]
    paused_exit: int
    report: harness.Report
    log: Path


def snapshot(platform: Platform, run_id: str) -> Snapshot:
    with platform.db.read() as conn:
        entries = tuple((e.seq, e.attempt, e.kind, e.entry_hash) for e in ledger.read(conn, MODULE, run_id))
        run = runs.get(conn, run_id).model_dump()
        row = conn.execute(
            sa.select(run_results.c.attempt, run_results.c.output_digest).where(run_results.c.run_id == run_id)
        ).one_or_none()
    return Snapshot(entries, run, tuple(row) if row is not None else None)


def _definition(case: Case, tmp_path: Path) -> Path:
    if case.forward:
        return harness.forward_example(tmp_path, "parquet")
    return harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"


def run_case(case: Case, server: PostgresServer, tmp_path: Path) -> Outcome:
    tmp_path.mkdir(parents=True)
    url = harness.fresh_database(server, "pause")
    definition = _definition(case, tmp_path)
    sink = definition.parent / "warehouse" / "daily_revenue"
    log = tmp_path / "processes.log"
    key = f"pause-{case.forward}-{case.point}"
    with harness.open_platform(url) as platform:
        paused_env = harness.worker_env(url, lease_ttl_s=PAUSED_TTL_S, pause_at=case.point)
        submit_args = ["submit", str(definition), "--param", f"day={DAY}", "--idempotency-key", key]
        if case.point == cp.AFTER_RECORD:
            paused = harness.start(submit_args, paused_env, log)
        else:
            platform.runs.submit(harness.request_for(definition, {"day": DAY}, key))
            paused = harness.start(harness.worker_args(once=True), paused_env, log)
        harness.wait_until(
            lambda: harness.is_stopped(paused.pid) or paused.poll() is not None, STOP_WAIT_S, "the pause"
        )
        if case.point in RECONCILE_ONLY_POINTS:
            if paused.poll() is None:  # it stopped at a point no plain run may reach
                paused.kill()
                paused.wait()
                raise AssertionError(f"a plain run paused at {case.point}:\n{harness.tail(log)}")
            assert paused.returncode == 0, f"exited {paused.returncode}:\n{harness.tail(log)}"
        else:
            assert paused.poll() is None, f"exited {paused.returncode} instead of pausing:\n{harness.tail(log)}"
        try:
            fresh_env = harness.worker_env(url, lease_ttl_s=FRESH_TTL_S)
            code = harness.wait_exit(harness.start(harness.worker_args(until_idle=True), fresh_env, log), log)
            assert code == 0, harness.tail(log)
            with platform.db.read() as conn:
                found = runs.find_by_key(conn, "default", key)
            assert found is not None, "the run was lost"
            taken_over = snapshot(platform, found.run_id)
            pubs_taken_over = harness.parquet_publications(sink) if case.forward else []
        finally:
            if paused.returncode is None:  # never signal a pid already reaped: it may be another process now
                harness.resume(paused)
        paused_exit = harness.wait_exit(paused, log)
        resumed = snapshot(platform, found.run_id)
        pubs_resumed = harness.parquet_publications(sink) if case.forward else []
        report = harness.check(platform.db, pubs_resumed)
    return Outcome(taken_over, resumed, pubs_taken_over, pubs_resumed, paused_exit, report, log)


def _case_id(case: Case) -> str:
    return f"{'forward' if case.forward else 'atomic'}-{case.point}"


@pytest.fixture(scope="module")
def outcomes(postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> dict[Case, Any]:
    root = tmp_path_factory.mktemp("pause")
    return harness.run_concurrently(
        {case: (lambda c=case: run_case(c, postgres_server, root / _case_id(c))) for case in CASES}
    )


def test_every_pause_point_has_an_expected_outcome() -> None:
    """Every point of crashpoints.POINTS is classified exactly once here, so none is judged by a default rule."""
    classified = [*FIRST_POINTS, *BEFORE_AUTHORIZATION, *AFTER_AUTHORIZATION, *RECONCILE_ONLY_POINTS]
    assert sorted(classified) == sorted(cp.POINTS)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_resumed_stale_worker_commits_nothing(case: Case, outcomes: dict[Case, Any]) -> None:
    """After a takeover, the resumed worker's writes are all fenced off: the database is unchanged."""
    outcome = outcomes[case]
    if isinstance(outcome, BaseException):
        raise outcome
    before, after = outcome.taken_over, outcome.resumed
    context = f"{case}: ledger {[(a, k) for _, a, k, _ in after.entries]}\n{harness.tail(outcome.log)}"
    assert (before.run["status"], before.run["attempt"]) == case.expected, context
    if case.expected == ("succeeded", 2):
        assert any(a == 1 and k == evidence.ATTEMPT_RECOVERED for _, a, k, _ in before.entries), context
        assert before.result is not None and before.result[0] == 2, "the result is the new attempt's: " + context
    assert after.entries == before.entries, "the resumed worker appended to the ledger: " + context
    assert after.run == before.run, "the resumed worker changed the projection: " + context
    assert after.result == before.result, "the resumed worker replaced the result: " + context
    assert outcome.paused_exit == 0, "the resumed worker must survive its refused writes: " + context
    assert len(outcome.pubs_resumed) <= 1, f"{outcome.pubs_resumed}; {context}"
    assert outcome.pubs_taken_over == outcome.pubs_resumed or case.point == cp.AFTER_PREDISPATCH_COMMIT, context
    assert outcome.report.violations == [], f"{outcome.report.violations}\n{context}"
