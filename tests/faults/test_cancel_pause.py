"""Issue 16, item 4: a real `dataflow worker` SIGSTOPped mid-attempt, its run cancelled, then resumed.

Before dispatch authorization the cancel closes the attempt under the fence at once (the lease TTL is
long: nothing waits for an expiry), and the resumed worker commits nothing: no ledger entry, no
projection or result change, no publication. Paused right after the authorization, the cancel is
refused with the reconcile instruction and the resumed worker publishes once and succeeds.

Cancellation in the other tiers: the protocol in process, on both engines, tests/integration/test_cancel.py;
`dataflow cancel` as a real process, tests/acceptance/test_cli_cancel.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.core import crashpoints as cp
from durable_dataflow.core.errors import Conflict
from durable_dataflow.dataflow.protocol import cancel, evidence, runs
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from faults import harness
from faults.test_pause_points import Snapshot, snapshot
from support.pg import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

DAY = "2026-11-02"
LEASE_TTL_S = 60.0  # far longer than the test: the cancel must not wait for an expiry
STOP_WAIT_S = 60.0
OPERATOR = AccessContext("default", "night-operator", ("operator",), (), "test")


@dataclass(frozen=True)
class Case:
    engine: str
    forward: bool
    point: str

    @property
    def cancellable(self) -> bool:
        return self.point != cp.AFTER_PREDISPATCH_COMMIT


POINTS = [
    (False, cp.DURING_EXECUTION),
    (False, cp.BEFORE_TERMINAL_COMMIT),
    (True, cp.AFTER_PREPARE),
    (True, cp.BEFORE_PREDISPATCH_COMMIT),
    (True, cp.AFTER_PREDISPATCH_COMMIT),
]
# On SQLite, a process stopped at the points right before a commit was seen holding the database's
# write lock (WAL write lock in /proc/locks; cause not pinned down), and a stopped process holding it
# stalls every writer of the one file, a cancel included, until it continues. Those two points run on
# PostgreSQL only; see docs/schedules.md#cancellation.
SQLITE_STALLS = frozenset({cp.BEFORE_TERMINAL_COMMIT, cp.BEFORE_PREDISPATCH_COMMIT})
CASES = [Case("postgres", forward, point) for forward, point in POINTS] + [
    Case("sqlite", forward, point) for forward, point in POINTS if point not in SQLITE_STALLS
]


@dataclass(frozen=True)
class Outcome:
    cancelled: Snapshot
    resumed: Snapshot
    refusal: str | None
    pubs: list[harness.Publication]
    paused_exit: int
    report: harness.Report
    log: Path


def run_case(case: Case, server: PostgresServer, tmp_path: Path) -> Outcome:
    tmp_path.mkdir(parents=True)
    url = harness.fresh_database(server, "cancel") if case.engine == "postgres" else f"sqlite:///{tmp_path}/ledger.db"
    if case.forward:
        definition = harness.forward_example(tmp_path, "parquet")
    else:
        definition = harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"
    sink = definition.parent / "warehouse" / "daily_revenue"
    log = tmp_path / "processes.log"
    with harness.open_platform(url) as platform:
        run_id = platform.runs.submit(harness.request_for(definition, {"day": DAY}, f"cancel-{case.point}")).run.run_id
        env = harness.worker_env(url, lease_ttl_s=LEASE_TTL_S, pause_at=case.point)
        # On SQLite a process stopped inside a write transaction blocks every writer (one file, one
        # writer): the worker's loop polls and sweeps rarely here, so its pause comes while it is idle.
        idle = {"poll_interval_s": 30.0, "sweep_interval_s": 30.0} if case.engine == "sqlite" else {}
        paused = harness.start(harness.worker_args(once=True, **idle), env, log)
        try:
            harness.wait_until(
                lambda: harness.is_stopped(paused.pid) or paused.poll() is not None, STOP_WAIT_S, "the pause"
            )
            assert paused.poll() is None, f"exited {paused.returncode} instead of pausing:\n{harness.tail(log)}"
            refusal = None
            try:
                cancel.cancel(platform.runs, run_id, access=OPERATOR,
                              provenance=Provenance("night-operator", "cli"))  # fmt: skip
            except Conflict as refused:
                refusal = refused.message
            cancelled = snapshot(platform, run_id)
        finally:
            if paused.returncode is None:  # never signal a pid already reaped
                harness.resume(paused)
        paused_exit = harness.wait_exit(paused, log)
        resumed = snapshot(platform, run_id)
        pubs = harness.parquet_publications(sink) if case.forward else []
        report = harness.check(platform.db, pubs)
    return Outcome(cancelled, resumed, refusal, pubs, paused_exit, report, log)


def _case_id(case: Case) -> str:
    return f"{case.engine}-{'forward' if case.forward else 'atomic'}-{case.point}"


@pytest.fixture(scope="module")
def outcomes(postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> dict[Case, Any]:
    root = tmp_path_factory.mktemp("cancel")
    return harness.run_concurrently(
        {case: (lambda c=case: run_case(c, postgres_server, root / _case_id(c))) for case in CASES}
    )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_paused_worker_whose_run_was_cancelled_commits_nothing(case: Case, outcomes: dict[Case, Any]) -> None:
    outcome = outcomes[case]
    if isinstance(outcome, BaseException):
        raise outcome
    context = f"{case}: ledger {[(a, k) for _, a, k, _ in outcome.resumed.entries]}\n{harness.tail(outcome.log)}"
    assert outcome.paused_exit == 0, "the resumed worker must survive its refused writes: " + context
    assert outcome.report.violations == [], f"{outcome.report.violations}\n{context}"
    if not case.cancellable:
        assert outcome.refusal is not None and "dataflow reconcile" in outcome.refusal, context
        assert outcome.resumed.run["status"] == runs.RunStatus.SUCCEEDED, context
        assert len(outcome.pubs) == 1, context
        return
    assert outcome.refusal is None, context
    assert (outcome.cancelled.run["status"], outcome.cancelled.run["recovery_status"]) == (
        "cancelled", "no_external_output",
    ), context  # fmt: skip
    assert outcome.cancelled.entries[-1][2] == evidence.RUN_CANCELLED, context
    assert outcome.resumed.entries == outcome.cancelled.entries, "the resumed worker appended: " + context
    assert outcome.resumed.run == outcome.cancelled.run, "the resumed worker changed the projection: " + context
    assert outcome.resumed.result is None, "the resumed worker stored a result: " + context
    assert outcome.pubs == [], "a cancelled run published: " + context
