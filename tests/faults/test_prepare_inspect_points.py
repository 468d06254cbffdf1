"""The crash points ``after_prepare`` and ``after_inspect`` with real processes and real sinks.

- ``after_prepare``: a worker dies (SIGKILL) or stops (SIGSTOP) once the target was preflighted and the
  sink location prepared, before anything is authorized: the attempt is proven absent and retried, and
  the prepared location never counts as a publication.
- ``after_inspect``: ``dataflow reconcile`` dies once the sink answered its fenced inspection (a fence
  may now be at the sink) and before anything is recorded in the platform database: the sweeper returns
  the run to ``outcome_unknown``, never to the queue, and a later reconcile decides it at its own fence.

Every process here holds a LEASE_TTL_S lease, far longer than a test takes, so no lease lapses by
itself: a lease expires only when the test moves its own view of the database clock past it
(:func:`Bench.sweep`). Each sweep therefore decides exactly the attempt the test killed or stopped, and
nothing waits for time to pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest
import sqlalchemy as sa

from durable_dataflow.core import checkpoints, ledger
from durable_dataflow.core import crashpoints as cp
from durable_dataflow.dataflow.protocol import evidence, runs, sweeper
from durable_dataflow.dataflow.protocol.forward import publication_key
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.dataflow.schema import run_results
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.contract import LOCATION_MISSING
from durable_dataflow.platform import Platform
from faults import harness
from support.pg import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DAY = "2026-11-02"
LEASE_TTL_S = 30.0  # every process's lease: never lapses during a test on its own
PAST_LEASE_S = LEASE_TTL_S + 5.0  # how far a sweep moves the test's view of the database clock
SINK_SECRET = "FAULT_SINK_DSN"
PROVIDERS = ("parquet", "delta", "postgres")
MOVED_AWAY = "moved_away"  # where a test moves the sink location: a sibling folder, or a PostgreSQL schema
STOP_WAIT_S = 60.0
EXIT_OK, EXIT_UNRESOLVED, EXIT_CONFLICT = 0, 3, 5  # `dataflow reconcile` (cli/common.py)


# ---- sinks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sink:
    """One real sink of the run's target and how to read it back without the platform."""

    provider: str
    definition: Path
    dsn: str | None  # the PostgreSQL sink's database; None for file sinks

    @property
    def location(self) -> Path:
        """A file sink's folder (the example's target location, under its sink root)."""
        return self.definition.parent / "warehouse" / "daily_revenue"

    @property
    def env(self) -> dict[str, str]:
        """What every process needs in its environment: the PostgreSQL sink's DSN secret."""
        return {SINK_SECRET: self.dsn} if self.dsn is not None else {}

    def publications(self) -> list[harness.Publication]:
        if self.provider == "parquet":
            return harness.parquet_publications(self.location)
        if self.provider == "delta":
            return harness.delta_publications(self.location)
        assert self.dsn is not None
        return harness.postgres_publications(self.dsn)

    def fences(self, key: str) -> list[int]:
        """The fence tokens the sink holds for ``key``: the one current fence record (parquet, PostgreSQL),
        or every fence commit in log order (delta, whose log keeps them all)."""
        if self.provider == "parquet":
            path = self.location / "_manifests" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
            if not path.exists():
                return []
            manifest = json.loads(path.read_bytes())
            return [int(manifest["token"])] if manifest["kind"] == "fence" else []
        if self.provider == "delta":
            found = []
            for path in sorted((self.location / "_delta_log").glob("*.json")):
                for line in path.read_text().splitlines():
                    info = json.loads(line).get("commitInfo") if line.strip() else None
                    if info and info.get("dataflow_kind") == "fence" and info.get("dataflow_key") == key:
                        found.append(int(info["dataflow_token"]))
            return found
        assert self.dsn is not None
        with psycopg.connect(self.dsn) as conn:
            exists = conn.execute("select to_regclass('sink_fences') is not null").fetchone()
            if not exists or not exists[0]:
                return []
            rows = conn.execute("select token from sink_fences where idempotency_key = %s", (key,)).fetchall()
        return [int(token) for (token,) in rows]

    def location_exists(self) -> bool:
        """Whether what `prepare` creates is where the target says: the folder (file sinks), or the record
        tables `sink_publications` and `sink_fences` in the sink database (PostgreSQL)."""
        if self.provider != "postgres":
            return self.location.is_dir()
        assert self.dsn is not None
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                "select to_regclass('sink_publications') is not null and to_regclass('sink_fences') is not null"
            ).fetchone()
        return bool(row and row[0])

    def move_away(self) -> None:
        """Move the sink location out of the target's reach, as an operator or a remount might: the folder
        is renamed; the PostgreSQL sink's tables move to another schema (its DSN's search path misses it)."""
        if self.provider != "postgres":
            self.location.rename(self.location.with_name(MOVED_AWAY))
            return
        assert self.dsn is not None
        with psycopg.connect(self.dsn) as conn:
            conn.execute(f"create schema {MOVED_AWAY}")
            for table in _pg_tables(conn, "public"):
                conn.execute(f'alter table public."{table}" set schema {MOVED_AWAY}')

    def move_back(self) -> None:
        if self.provider != "postgres":
            self.location.with_name(MOVED_AWAY).rename(self.location)
            return
        assert self.dsn is not None
        with psycopg.connect(self.dsn) as conn:
            for table in _pg_tables(conn, MOVED_AWAY):
                conn.execute(f'alter table {MOVED_AWAY}."{table}" set schema public')
            conn.execute(f"drop schema {MOVED_AWAY}")

    def assert_prepared_and_empty(self, platform: Platform, run: Run) -> None:
        """The location exists as `prepare` made it and the datasource's registration is recorded (before
        authorization), yet the sink holds no publication."""
        with platform.db.read() as conn:
            assert registry.registration_of(conn, run.tenant, run.target) is not None, "the target was not registered"
        assert self.location_exists(), f"the {self.provider} sink location was not prepared"
        if self.provider == "parquet":
            assert all((self.location / sub).is_dir() for sub in ("_locks", "_manifests", "data")), self.location
        assert self.publications() == [], f"nothing was authorized, yet the sink holds {self.publications()}"


def _pg_tables(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    rows = conn.execute(
        "select table_name from information_schema.tables where table_schema = %s and table_type = 'BASE TABLE'",
        (schema,),
    ).fetchall()
    return [str(name) for (name,) in rows]


def make_sink(provider: str, tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    if provider == "postgres":
        dsn: str = request.getfixturevalue("sink_dsn")  # a fresh database of the throwaway server
        definition = harness.forward_example(
            tmp_path, "postgres", location="daily_revenue", options={"dsn": {"secret": SINK_SECRET}}
        )
        return Sink(provider, definition, dsn)
    return Sink(provider, harness.forward_example(tmp_path, provider), None)


# ---- the bench: one platform database, one sink, real processes ----------------------------


@dataclass
class Bench:
    platform: Platform
    url: str
    sink: Sink
    log: Path

    def env(self, *, crash_at: str | None = None, pause_at: str | None = None) -> dict[str, str]:
        return harness.worker_env(
            self.url, lease_ttl_s=LEASE_TTL_S, crash_at=crash_at, pause_at=pause_at, extra=self.sink.env
        )

    def submit(self, key: str, *, max_attempts: int | None = None) -> Run:
        request = harness.request_for(self.sink.definition, {"day": DAY}, key)
        if max_attempts is not None:
            request = dataclasses.replace(request, max_attempts=max_attempts)
        # The submitting process must hold the target's secret too: it is checked before recording.
        with mock.patch.dict(os.environ, self.sink.env):
            return self.platform.runs.submit(request).run

    def start_worker(self, *, crash_at: str | None = None, pause_at: str | None = None) -> subprocess.Popen[bytes]:
        return harness.start(harness.worker_args(once=True), self.env(crash_at=crash_at, pause_at=pause_at), self.log)

    def crash_worker(self, point: str) -> None:
        code = harness.wait_exit(self.start_worker(crash_at=point), self.log)
        assert code == -signal.SIGKILL, f"the worker was not killed at {point} (exit {code}):\n{self.tail()}"

    def drain(self) -> None:
        """A fresh worker (no fault) until no queued run is left."""
        code = harness.wait_exit(harness.start(harness.worker_args(until_idle=True), self.env(), self.log), self.log)
        assert code == 0, self.tail()

    def reconcile(
        self, run_id: str, *, resume: bool = False, crash_at: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """`dataflow reconcile RUN --json [--resume]` in its own process: (exit status, its JSON or {})."""
        args = [*harness.WORKER_CMD, "reconcile", run_id, "--json", *(["--resume"] if resume else [])]
        done = subprocess.run(
            args, env=self.env(crash_at=crash_at), cwd=harness.REPO, capture_output=True,
            timeout=harness.PROCESS_WAIT_S, check=False,
        )  # fmt: skip
        with self.log.open("ab") as log:
            log.write(f"$ reconcile resume={resume} crash_at={crash_at} -> {done.returncode}\n".encode())
            log.write(done.stdout + done.stderr)
        try:
            body: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
        except json.JSONDecodeError:
            body = {}
        return done.returncode, body

    def sweep(self) -> list[tuple[int, str]]:
        """Sweep as a sweeper does once the leases of now have expired: this platform's view of the database
        clock moves past LEASE_TTL_S and back, so the next process's lease is judged on the real clock."""
        self.platform.db.advance_clock(PAST_LEASE_S)
        try:
            decisions = sweeper.sweep(self.platform.db)
        finally:
            self.platform.db.advance_clock(-PAST_LEASE_S)
        return [(d.attempt, str(d.decision)) for d in decisions]

    def get(self, run_id: str) -> Run:
        return self.platform.runs.get(run_id)

    def entries(self, run_id: str) -> list[ledger.Entry]:
        with self.platform.db.read() as conn:
            return ledger.read(conn, MODULE, run_id)

    def kinds(self, run_id: str) -> list[tuple[int, str]]:
        return [(e.attempt, e.kind) for e in self.entries(run_id)]

    def result_row(self, run_id: str) -> tuple[Any, ...] | None:
        with self.platform.db.read() as conn:
            row = conn.execute(
                sa.select(run_results.c.attempt, run_results.c.output_digest).where(run_results.c.run_id == run_id)
            ).one_or_none()
        return tuple(row) if row is not None else None

    def violations(self) -> list[str]:
        return harness.check(self.platform.db, self.sink.publications()).violations

    def tail(self) -> str:
        return harness.tail(self.log, 60)


@pytest.fixture
def bench(request: pytest.FixtureRequest, db_url: str, tmp_path: Path) -> Iterator[Bench]:
    """A platform database on the engine of ``db_url`` and a real sink of the provider ``request.param``."""
    sink = make_sink(request.param, tmp_path / "defs", request)
    with harness.open_platform(db_url) as platform:
        yield Bench(platform, db_url, sink, tmp_path / "processes.log")


# ---- crash at after_prepare -------------------------------------------------------------------


def _crash_after_prepare(bench: Bench, key: str, max_attempts: int | None = None) -> Run:
    """Submit, kill the claiming worker at after_prepare, and check what it left: attempt 1 started, the
    location prepared, nothing authorized, no result stored."""
    run = bench.submit(key, max_attempts=max_attempts)
    bench.crash_worker(cp.AFTER_PREPARE)
    crashed = bench.get(run.run_id)
    assert (crashed.status, crashed.attempt) == ("running", 1), bench.tail()
    assert bench.kinds(run.run_id) == [(0, evidence.RUN_RECORDED), (1, evidence.ATTEMPT_STARTED)]
    assert bench.result_row(run.run_id) is None, "nothing may be stored before authorization"
    bench.sink.assert_prepared_and_empty(bench.platform, crashed)
    return crashed


@pytest.mark.parametrize("bench", PROVIDERS, indirect=True)
def test_crash_after_prepare_is_proven_absent_and_published_once_by_the_retry(bench: Bench) -> None:
    """Invariants 9 and 6: an attempt killed after the sink location was prepared but before dispatch was
    authorized is proven absent by the sweeper (attempt.recovered, queued again, not outcome_unknown), and
    the retry publishes exactly once, under its own attempt as fence token: the prepared location never
    counts as a publication, and nothing is published by the dead attempt."""
    run = _crash_after_prepare(bench, "prepare-retried")
    assert bench.sweep() == [(1, "recovered")], bench.kinds(run.run_id)
    queued = bench.get(run.run_id)
    assert (queued.status, queued.recovery_status) == ("queued", "recovered")
    bench.drain()
    final = bench.get(run.run_id)
    kinds = bench.kinds(run.run_id)
    assert (final.status, final.attempt) == ("succeeded", 2), f"{kinds}\n{bench.tail()}"
    assert (1, evidence.ATTEMPT_RECOVERED) in kinds and (1, evidence.DISPATCH_AUTHORIZED) not in kinds
    pubs = bench.sink.publications()
    assert [(p.key, p.digest, p.token) for p in pubs] == [(publication_key(final), final.output_digest, 2)], pubs
    assert bench.violations() == []


@pytest.mark.parametrize("bench", ["parquet"], indirect=True)  # the sweep decides without the sink
def test_crash_after_prepare_with_one_attempt_fails_with_no_external_output(bench: Bench) -> None:
    """Invariants 6 and 7 (failure side): with max_attempts 1, the sweeper closes the attempt killed after
    prepare as failed / no_external_output (attempts_exhausted) with a verified checkpoint of the whole chain,
    and no worker runs it again: the prepared location stays without any publication."""
    run = _crash_after_prepare(bench, "prepare-exhausted", max_attempts=1)
    assert bench.sweep() == [(1, "failed")], bench.kinds(run.run_id)
    failed = bench.get(run.run_id)
    assert (failed.status, failed.recovery_status, failed.error_code) == (
        "failed", "no_external_output", "attempts_exhausted"
    )  # fmt: skip
    with bench.platform.db.read() as conn:
        checkpoint = checkpoints.latest(conn, MODULE, run.run_id)
        verification = checkpoints.verify_subject(conn, MODULE, run.run_id)
    entries = bench.entries(run.run_id)
    assert checkpoint is not None, "a terminal state without a checkpoint"
    assert (checkpoint.head_seq, checkpoint.status) == (entries[-1].seq, "failed")
    assert checkpoint.facts["recovery_status"] == "no_external_output"
    assert verification.ok, verification.reason
    assert [e.kind for e in entries][-2:] == [evidence.ATTEMPT_RECOVERED, evidence.RUN_FAILED]
    bench.drain()  # nothing is queued: a failed run is never claimed again
    assert bench.get(run.run_id) == failed
    assert bench.sink.publications() == []
    assert bench.violations() == []


# ---- crash at after_inspect during `dataflow reconcile` ----------------------------------------

# How the run became outcome_unknown: the worker was killed right after dispatch authorization (the
# sink never saw the key: absent) or right after the sink committed (present), and the sweeper found
# the authorized attempt's lease expired.
UNKNOWN_FROM = {"absent": cp.AFTER_PREDISPATCH_COMMIT, "present": cp.AFTER_PROVIDER_CALL}
# Every sink and both findings, without their full product (make test stays inside its time budget):
# each sink's inspection fence and presence answers are also proven by tests/integration/test_provider_*.
INSPECT_CASES = [("parquet", "absent"), ("parquet", "present"), ("delta", "absent"), ("postgres", "present")]
MOVED_CASES = [("parquet", "absent"), ("delta", "present"), ("postgres", "absent")]


def _outcome_unknown(bench: Bench, key: str, how: str) -> Run:
    run = bench.submit(key)
    bench.crash_worker(UNKNOWN_FROM[how])
    assert bench.sweep() == [(1, "outcome_unknown")], bench.kinds(run.run_id)
    unknown = bench.get(run.run_id)
    assert (unknown.status, unknown.recovery_status, unknown.attempt) == ("outcome_unknown", "outcome_unknown", 1)
    tokens = [p.token for p in bench.sink.publications()]
    assert tokens == ([] if how == "absent" else [1]), f"the sink holds {tokens} after a {UNKNOWN_FROM[how]} crash"
    return unknown


def _crash_reconcile_after_inspect(bench: Bench, run: Run, how: str) -> None:
    """`dataflow reconcile` is killed at after_inspect: it took attempt 2 and the sink answered (for an absent
    key, with the fence 2 now at the sink), and nothing of the answer is in the platform database."""
    key = publication_key(run)
    code, _ = bench.reconcile(run.run_id, crash_at=cp.AFTER_INSPECT)
    assert code == -signal.SIGKILL, f"reconcile was not killed at after_inspect (exit {code}):\n{bench.tail()}"
    crashed = bench.get(run.run_id)
    assert (crashed.status, crashed.attempt) == ("outcome_unknown", 2)
    assert bench.kinds(run.run_id)[-1] == (2, evidence.RECONCILE_STARTED), "the finding must not be recorded"
    assert bench.sink.fences(key) == ([2] if how == "absent" else []), "the inspection fences an absent key at 2"
    # While the dead inspection's lease lives, no other reconcile may take the run.
    before = bench.kinds(run.run_id)
    code, _ = bench.reconcile(run.run_id)
    assert code not in (EXIT_OK, EXIT_UNRESOLVED, -signal.SIGKILL), f"exit {code}: a live lease was taken over"
    assert bench.kinds(run.run_id) == before
    # Its lease expires: back to outcome_unknown, under no circumstance queued (that would re-execute it).
    assert bench.sweep() == [(2, "outcome_unknown")], bench.kinds(run.run_id)
    swept = bench.get(run.run_id)
    assert (swept.status, swept.recovery_status, swept.attempt) == ("outcome_unknown", "outcome_unknown", 2)
    assert bench.kinds(run.run_id)[-1] == (2, evidence.ATTEMPT_OUTCOME_UNKNOWN)
    assert swept.warning and "UNRESOLVED" in swept.warning


def _decide(bench: Bench, run: Run, how: str, fences_before: list[int]) -> None:
    """A reconcile decides the run, then `--resume` (twice) publishes at most once in total."""
    key = publication_key(run)
    code, body = bench.reconcile(run.run_id)
    decided = bench.get(run.run_id)
    m = decided.attempt
    assert m > 2, f"the deciding inspection runs under a new attempt, not {m}"
    if how == "present":
        assert (code, body.get("finding")) == (EXIT_OK, "present"), f"{code} {body}\n{bench.tail()}"
        assert (decided.status, decided.recovery_status) == ("succeeded", "reconciled_present")
        assert bench.sink.fences(key) == [], "a present key is never fenced"
    else:
        assert (code, body.get("finding")) == (EXIT_OK, "absent"), f"{code} {body}\n{bench.tail()}"
        assert (decided.status, decided.recovery_status) == ("failed", "reconciled_absent")
        absent = [e for e in bench.entries(run.run_id) if e.kind == evidence.RECONCILE_ABSENT]
        assert [(e.attempt, e.payload.get("fenced_at")) for e in absent] == [(m, m)], "fenced at its own attempt"
        # The dead inspection's fence (2) is lower; the new one is this attempt's: the log of a delta
        # table keeps both commits, a parquet manifest and a PostgreSQL row hold the raised one.
        expected = [*fences_before, m] if bench.sink.provider == "delta" else [m]
        assert fences_before == [2] and bench.sink.fences(key) == expected, bench.sink.fences(key)
        code, body = bench.reconcile(run.run_id, resume=True)
        assert (code, body.get("resumed")) == (EXIT_OK, True), f"{code} {body}\n{bench.tail()}"
    final = bench.get(run.run_id)
    assert final.status == "succeeded", final
    expected_token = 1 if how == "present" else m + 1  # found as published, or published by the resume
    pubs = bench.sink.publications()
    assert [(p.key, p.digest, p.token) for p in pubs] == [(key, final.output_digest, expected_token)], pubs
    code, _ = bench.reconcile(run.run_id, resume=True)  # a succeeded run has nothing left to resume
    assert code == EXIT_CONFLICT, f"exit {code}:\n{bench.tail()}"
    assert bench.sink.publications() == pubs and bench.get(run.run_id) == final
    assert bench.violations() == []


@pytest.mark.parametrize(("bench", "how"), INSPECT_CASES, indirect=["bench"])
def test_reconcile_killed_after_inspect_is_swept_back_and_decided_later(bench: Bench, how: str) -> None:
    """Invariants 8 and 14: a reconcile killed after the sink answered its fenced inspection leaves the run
    outcome_unknown once its lease expires — never queued, never retried — and a later reconcile decides it:
    an absent key is fenced at the new attempt (above the dead inspection's fence) before it is called absent,
    a present key is found; `--resume` then publishes at most once in total, and a second resume nothing."""
    run = _outcome_unknown(bench, f"inspect-{how}", how)
    _crash_reconcile_after_inspect(bench, run, how)
    _decide(bench, run, how, bench.sink.fences(publication_key(run)))


@pytest.mark.parametrize(("bench", "how"), MOVED_CASES, indirect=["bench"])
def test_reconcile_after_a_killed_inspection_with_the_sink_moved_away_is_undecided(bench: Bench, how: str) -> None:
    """Honest absence after a killed inspection: with the sink location moved away (the folder, or the
    PostgreSQL record tables), neither a reconcile nor a `--resume` may call the key absent — both stay
    undecided, publish nothing and recreate nothing, and the run stays outcome_unknown; moved back, a reconcile
    decides it (absent at its own fence, or present) and the sink ends with at most one publication."""
    run = _outcome_unknown(bench, f"moved-{how}", how)
    key = publication_key(run)
    _crash_reconcile_after_inspect(bench, run, how)
    fences, pubs = bench.sink.fences(key), bench.sink.publications()
    bench.sink.move_away()
    for resume in (False, True):
        code, body = bench.reconcile(run.run_id, resume=resume)
        assert (code, body.get("finding"), body.get("resumed")) == (EXIT_UNRESOLVED, "undecided", False), body
        assert LOCATION_MISSING in str(body.get("detail")), body
        undecided = bench.get(run.run_id)
        assert (undecided.status, undecided.recovery_status) == ("outcome_unknown", "outcome_unknown")
        assert not bench.sink.location_exists(), "an inspection or a resume recreated the moved sink location"
    assert evidence.DISPATCH_AUTHORIZED not in {k for a, k in bench.kinds(run.run_id) if a > 1}
    bench.sink.move_back()
    assert (bench.sink.fences(key), bench.sink.publications()) == (fences, pubs), "the undecided ones wrote"
    _decide(bench, run, how, fences)


# ---- pause at after_prepare ---------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    entries: tuple[tuple[int, int, str, str], ...]
    run: dict[str, Any]
    result: tuple[Any, ...] | None
    pubs: tuple[harness.Publication, ...]


def _snapshot(bench: Bench, run_id: str) -> Snapshot:
    entries = tuple((e.seq, e.attempt, e.kind, e.entry_hash) for e in bench.entries(run_id))
    with bench.platform.db.read() as conn:
        run = runs.get(conn, run_id).model_dump()
    return Snapshot(entries, run, bench.result_row(run_id), tuple(bench.sink.publications()))


@pytest.fixture
def pg_bench(request: pytest.FixtureRequest, postgres_server: PostgresServer, tmp_path: Path) -> Iterator[Bench]:
    """PostgreSQL only: a stopped process inside a transaction (its heartbeat thread may be in one) would hold
    SQLite's file lock for good; on PostgreSQL `idle_in_transaction_session_timeout` ends such a transaction."""
    sink = make_sink(request.param, tmp_path / "defs", request)
    url = harness.fresh_database(postgres_server, "prepare_pause")
    with harness.open_platform(url) as platform:
        yield Bench(platform, url, sink, tmp_path / "processes.log")


@pytest.mark.postgres
@pytest.mark.parametrize("pg_bench", ["parquet", "postgres"], indirect=True)
def test_worker_paused_after_prepare_is_fenced_off_after_a_takeover(pg_bench: Bench) -> None:
    """Invariants 3 and 6: a worker stopped after prepare until past its lease is proven absent; another worker
    retries and publishes; the stopped one, resumed (SIGCONT), computes on and is refused at its pre-dispatch
    commit: it appends nothing to the ledger, changes neither the projection nor the stored result, and the
    sink still holds the one publication of the retry."""
    bench = pg_bench
    run = bench.submit("prepare-paused")
    paused = bench.start_worker(pause_at=cp.AFTER_PREPARE)
    try:
        # Bounded poll on an observed condition: the worker stops itself (state T) at the point, or exits.
        harness.wait_until(
            lambda: harness.is_stopped(paused.pid) or paused.poll() is not None, STOP_WAIT_S, "the pause"
        )
        assert paused.poll() is None, f"exited {paused.returncode} instead of pausing:\n{bench.tail()}"
        stopped = bench.get(run.run_id)
        assert bench.kinds(run.run_id) == [(0, evidence.RUN_RECORDED), (1, evidence.ATTEMPT_STARTED)]
        bench.sink.assert_prepared_and_empty(bench.platform, stopped)
        assert bench.sweep() == [(1, "recovered")], bench.kinds(run.run_id)
        bench.drain()
        taken_over = _snapshot(bench, run.run_id)
    finally:
        if paused.returncode is None:  # never signal a pid already reaped: it may be another process now
            harness.resume(paused)
    paused_exit = harness.wait_exit(paused, bench.log)
    resumed = _snapshot(bench, run.run_id)
    context = f"ledger {[(a, k) for _, a, k, _ in resumed.entries]}\n{bench.tail()}"
    assert (taken_over.run["status"], taken_over.run["attempt"]) == ("succeeded", 2), context
    assert taken_over.result is not None and taken_over.result[0] == 2, context
    assert [p.token for p in taken_over.pubs] == [2], context
    assert resumed == taken_over, "the resumed worker committed something: " + context
    assert paused_exit == 0, "the resumed worker must survive its refused writes: " + context
    assert bench.violations() == [], context
