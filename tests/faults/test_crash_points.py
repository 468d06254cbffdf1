"""SIGKILL a real worker process at every crash point, in both modes and with every provider, then
let a fresh worker recover: proven absent and retried before dispatch authorization,
``outcome_unknown`` and untouched after it, at most one publication in the sink, no lost run.
A point that only ``dataflow reconcile`` reaches is never reached by a plain run (its own crash
tests are in test_prepare_inspect_points.py)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from durable_dataflow.core import crashpoints as cp
from durable_dataflow.core import ledger
from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.dataflow.protocol.forward import publication_key
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.platform import Platform
from faults import harness
from support.pg import PostgresServer
from support.s3 import ACCESS_KEY, SECRET_KEY, MotoServer, S3Place

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

DAY = "2026-11-02"
CRASHED_TTL_S = 1.5  # short: the fresh worker waits this long for the dead attempt's lease to expire
FRESH_TTL_S = 5.0  # long enough that a loaded machine never lets the fresh worker's own lease lapse
SINK_SECRET = "FAULT_SINK_DSN"
RETRIED_POINTS = (cp.AFTER_CLAIM, cp.AFTER_PREPARE, cp.DURING_EXECUTION, cp.BEFORE_PREDISPATCH_COMMIT)
UNKNOWN_POINTS = (cp.AFTER_PREDISPATCH_COMMIT, cp.AFTER_PROVIDER_CALL, cp.BEFORE_TERMINAL_COMMIT)
FIRST_POINTS = (cp.AFTER_RECORD, cp.AFTER_TERMINAL_COMMIT)
RECONCILE_ONLY_POINTS = (cp.AFTER_INSPECT,)  # reached only by `dataflow reconcile`, never by a plain run
ATOMIC_POINTS = (
    cp.AFTER_RECORD, cp.AFTER_CLAIM, cp.DURING_EXECUTION, cp.BEFORE_TERMINAL_COMMIT, cp.AFTER_TERMINAL_COMMIT,
)  # fmt: skip
# The provider-specific points: preparing the sink location, and everything from authorization on.
FORWARD_POINTS = (cp.AFTER_PREPARE, cp.BEFORE_PREDISPATCH_COMMIT, *UNKNOWN_POINTS, cp.AFTER_TERMINAL_COMMIT)


@dataclass(frozen=True)
class Case:
    provider: str | None  # None: atomic mode
    point: str

    @property
    def expected(self) -> str:
        """'first': succeeded under attempt 1; 'retried': attempt 1 recovered, 2 succeeded; 'unknown'."""
        if self.point in FIRST_POINTS or self.point in RECONCILE_ONLY_POINTS:
            return "first"
        if self.provider is None or self.point in RETRIED_POINTS:
            return "retried"
        return "unknown"


# On an S3-compatible store (issue 31): the moto server of the session, a bucket per case, a sink location
# s3://<bucket>/daily_revenue, credentials as secret references from the processes' environment.
STORE_PROVIDERS = {"delta-s3": "delta", "parquet-s3": "parquet"}
STORE_TABLE = "daily_revenue"
CASES = (
    [Case(None, p) for p in ATOMIC_POINTS]
    + [Case("parquet", p) for p in cp.POINTS]
    + [Case("delta", p) for p in FORWARD_POINTS]
    + [Case("postgres", p) for p in FORWARD_POINTS]
    + [Case("delta-s3", p) for p in FORWARD_POINTS]
    + [Case("parquet-s3", p) for p in FORWARD_POINTS]
)


def _definition(case: Case, tmp_path: Path, store: S3Place | None) -> Path:
    if case.provider is None:
        return harness.EXAMPLES / "revenue_by_region" / "dataflow.yaml"
    if case.provider in STORE_PROVIDERS:
        assert store is not None
        provider = STORE_PROVIDERS[case.provider]
        return harness.forward_example(tmp_path, provider, location=store.url(STORE_TABLE), options=store.options())
    if case.provider == "postgres":
        return harness.forward_example(
            tmp_path, "postgres", location="daily_revenue", options={"dsn": {"secret": SINK_SECRET}}
        )
    return harness.forward_example(tmp_path, case.provider)


def publications(case: Case, definition: Path, sink_dsn: str, store: S3Place | None) -> list[harness.Publication]:
    if case.provider == "delta-s3":
        assert store is not None
        return harness.delta_store_table(store.client(), store.bucket, STORE_TABLE).publications
    if case.provider == "parquet-s3":
        assert store is not None
        return harness.parquet_store_publications(store.client(), store.bucket, STORE_TABLE)
    if case.provider == "parquet":
        return harness.parquet_publications(definition.parent / "warehouse" / "daily_revenue")
    if case.provider == "delta":
        return harness.delta_publications(definition.parent / "warehouse" / "daily_revenue")
    if case.provider == "postgres":
        return harness.postgres_publications(sink_dsn)
    return []


def crash(case: Case, platform: Platform, definition: Path, url: str, extra: dict[str, str], log: Path) -> Run:
    """Submit the run and kill the process that reaches the crash point; returns the run as recorded."""
    key = f"crash-{case.provider}-{case.point}"
    env = harness.worker_env(url, lease_ttl_s=CRASHED_TTL_S, crash_at=case.point, extra=extra)
    if case.point == cp.AFTER_RECORD:  # a queued submit is the only process that reaches it
        args = ["submit", str(definition), "--param", f"day={DAY}", "--idempotency-key", key]
    else:
        # The submitting process must hold the target's secret too: it is checked before recording.
        with mock.patch.dict(os.environ, extra):
            platform.runs.submit(harness.request_for(definition, {"day": DAY}, key))
        args = harness.worker_args(once=True)
    code = harness.wait_exit(harness.start(args, env, log), log)
    if case.point in RECONCILE_ONLY_POINTS:
        assert code == 0, f"a plain run reached {case.point} or failed (exit {code}):\n{harness.tail(log)}"
    else:
        killed = code == -signal.SIGKILL
        assert killed, f"the process was not killed at {case.point} (exit {code}):\n{harness.tail(log)}"
    with platform.db.read() as conn:
        run = runs.find_by_key(conn, "default", key)
    assert run is not None, "the run was lost"
    return run


@dataclass(frozen=True)
class Outcome:
    run: Run
    entries: list[ledger.Entry]
    pubs: list[harness.Publication]
    report: harness.Report
    log: Path


def run_case(case: Case, server: PostgresServer, moto: MotoServer, tmp_path: Path) -> Outcome:
    """Kill a worker at the case's point, then run a fresh worker until idle; read what is left."""
    tmp_path.mkdir(parents=True)
    url, sink = harness.fresh_database(server, "crash"), harness.fresh_database(server, "sink")
    sink_dsn = sink.replace("postgresql+psycopg://", "postgresql://")
    store = S3Place(moto, moto.new_bucket(), moto.endpoint) if case.provider in STORE_PROVIDERS else None
    definition = _definition(case, tmp_path, store)
    extra = {SINK_SECRET: sink_dsn, "S3_TEST_ACCESS_KEY": ACCESS_KEY, "S3_TEST_SECRET_KEY": SECRET_KEY}
    log = tmp_path / "processes.log"
    with harness.open_platform(url) as platform:
        before = crash(case, platform, definition, url, extra, log)
        fresh_env = harness.worker_env(url, lease_ttl_s=FRESH_TTL_S, extra=extra)
        code = harness.wait_exit(harness.start(harness.worker_args(until_idle=True), fresh_env, log), log)
        assert code == 0, harness.tail(log)
        run = platform.runs.get(before.run_id)
        with platform.db.read() as conn:
            entries = ledger.read(conn, MODULE, run.run_id)
        pubs = publications(case, definition, sink_dsn, store)
        report = harness.check(platform.db, pubs)
    return Outcome(run, entries, pubs, report, log)


@pytest.fixture(scope="module")
def outcomes(
    postgres_server: PostgresServer, moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[Case, Any]:
    """Every case, run CASES_AT_ONCE at a time (each has its own databases, folders and bucket)."""
    root = tmp_path_factory.mktemp("crash")
    return harness.run_concurrently(
        {case: (lambda c=case: run_case(c, postgres_server, moto_server, root / _case_id(c))) for case in CASES}
    )


def _case_id(case: Case) -> str:
    return f"{case.provider or 'atomic'}-{case.point}"


def test_every_crash_point_has_an_expected_outcome() -> None:
    """Every point of crashpoints.POINTS is classified exactly once here: a new point is never judged by a
    default rule it was not meant for (a point before authorization taken for 'unknown', or the reverse)."""
    classified = [*FIRST_POINTS, *RETRIED_POINTS, *UNKNOWN_POINTS, *RECONCILE_ONLY_POINTS]
    assert sorted(classified) == sorted(cp.POINTS)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_killed_worker_is_recovered_by_the_protocol(case: Case, outcomes: dict[Case, Any]) -> None:
    """A worker SIGKILLed at the point leaves a state a fresh worker resolves exactly as DESIGN §6 says."""
    outcome = outcomes[case]
    if isinstance(outcome, BaseException):
        raise outcome
    run, pubs, report, log = outcome.run, outcome.pubs, outcome.report, outcome.log
    kinds = [(e.attempt, e.kind) for e in outcome.entries]
    context = f"{case}: {run.status}/{run.recovery_status} attempt {run.attempt}; ledger {kinds}\n{harness.tail(log)}"
    assert report.violations == [], f"{report.violations}\n{context}"
    if case.expected == "first":
        assert (run.status, run.attempt) == ("succeeded", 1), context
        assert evidence.ATTEMPT_RECOVERED not in {k for _, k in kinds}, context
    elif case.expected == "retried":
        assert (run.status, run.attempt) == ("succeeded", 2), context
        assert (1, evidence.ATTEMPT_RECOVERED) in kinds, "attempt 1 must be proven absent: " + context
    else:
        assert (run.status, run.attempt) == ("outcome_unknown", 1), context
        assert run.warning and "UNRESOLVED" in run.warning, context
        assert (2, evidence.ATTEMPT_STARTED) not in kinds, "no retry after dispatch authorization: " + context
    expected_pubs = 0 if case.provider is None or case.point == cp.AFTER_PREDISPATCH_COMMIT else 1
    assert [p.key for p in pubs] == [publication_key(run)] * expected_pubs, f"sink holds {pubs}; {context}"
