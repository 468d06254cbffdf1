"""Atomic-mode runs on both engines: record before execute, all-or-nothing, evidence, idempotency."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_dataflow.core import checkpoints, crashpoints, fencing, hashing, leases, ledger, schema
from durable_dataflow.core.errors import Conflict, InputError, StaleAttempt
from durable_dataflow.core.invariants import InvariantViolation
from durable_dataflow.core.schema import ledger_entries, ledger_outbox
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.definitions.definitions import canonical_body, definition_hash
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.protocol import attempt, runs, sweeper, transitions
from durable_dataflow.dataflow.protocol.runs import RunStatus
from durable_dataflow.dataflow.protocol.submit import Submitter
from durable_dataflow.dataflow.schema import dataflow_runs, definitions, run_results, tenant_result_bytes
from durable_dataflow.platform import Platform
from support import flows


@pytest.fixture
def platform(db_url: str) -> Iterator[Platform]:
    with Platform(db_url, lease_ttl_s=flows.LEASE_TTL_S) as opened:
        yield opened
    crashpoints.set_hook(None)


def test_inline_atomic_run_succeeds_with_verified_evidence(platform: Platform, tmp_path: Path) -> None:
    """A run records, claims, executes and commits; the ledger, checkpoint and result agree."""
    run = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1")).run
    assert (run.status, run.recovery_status, run.attempt, run.row_count) == ("succeeded", "verified", 1, 2)
    assert flows.kinds(platform, run.run_id) == ["run.recorded", "attempt.started", "result.committed", "run.succeeded"]
    with platform.db.read() as conn:
        checkpoint = checkpoints.latest(conn, "dataflow", run.run_id)
        stored = conn.execute(sa.select(run_results.c.output_digest)).scalar_one()
    assert checkpoint is not None and checkpoint.status == "succeeded"
    assert stored == run.output_digest


def test_record_before_execute(platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 1: when sources are read, run.recorded and attempt.started are already committed (seen from
    another connection)."""
    seen: list[list[str]] = []
    real = attempt.sources.resolve_sources

    def probe(defn: object, ctx: object) -> object:
        with platform.db.read() as conn:  # a separate connection sees only committed rows
            run_id = conn.execute(sa.text("SELECT run_id FROM dataflow_runs")).scalar_one()
            seen.append([e.kind for e in ledger.read(conn, "dataflow", run_id)])
        return real(defn, ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(attempt.sources, "resolve_sources", probe)
    platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1"))
    assert seen == [["run.recorded", "attempt.started"]]


def test_terminal_commit_is_all_or_nothing(platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 4: a failure inside the terminal transaction leaves no result, no success and no checkpoint,
    and counts no stored bytes. The failure comes at the lease's release, the transition's last check:
    after its statement, on PostgreSQL the one that wrote the entries, the checkpoint, the projection,
    the result and its count too."""

    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full while releasing")

    monkeypatch.setattr(attempt.leases, "released", explode)
    with pytest.raises(RuntimeError):
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1"))
    with platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(run_results)).scalar_one() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(tenant_result_bytes)).scalar_one() == 0
        run_id = conn.execute(sa.text("SELECT run_id FROM dataflow_runs")).scalar_one()
        assert checkpoints.latest(conn, "dataflow", run_id) is None
    run = platform.runs.get(run_id)
    assert run.status == "running" and run.output_digest is None
    assert "result.committed" not in flows.kinds(platform, run_id)


def test_tampered_ledger_blocks_success(platform: Platform, tmp_path: Path) -> None:
    """Invariant 10: an entry edited before the terminal commit makes verification fail: evidence_failed,
    no success projection, no checkpoint, a warning."""

    def tamper(point: str) -> None:
        if point == crashpoints.BEFORE_TERMINAL_COMMIT:
            with platform.db.begin() as conn:
                conn.execute(ledger_entries.update().where(ledger_entries.c.seq == 1).values(payload_json='{"x":1}'))

    crashpoints.set_hook(tamper)
    run = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1")).run
    assert (run.status, run.recovery_status) == ("evidence_failed", "evidence_failed")
    assert run.warning and "UNRESOLVED" in run.warning and "failed" not in run.warning.lower().split("verif")[0]
    assert "run.succeeded" not in flows.kinds(platform, run.run_id)
    with platform.db.read() as conn:
        assert checkpoints.latest(conn, "dataflow", run.run_id) is None
        assert conn.execute(sa.select(sa.func.count()).select_from(run_results)).scalar_one() == 0


def test_replay_returns_the_existing_run_and_executes_nothing(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 11: the same key returns the same run, writes nothing and reads no source."""
    first = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1")).run
    before = flows.row_counts(platform)
    calls: list[object] = []
    monkeypatch.setattr(attempt.sources, "resolve_sources", lambda *a: calls.append(a))
    again = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1"))
    assert (again.created, again.run.run_id, again.run.status) == (False, first.run_id, "succeeded")
    assert calls == []
    assert flows.row_counts(platform) == before


def test_conflicting_replay_writes_nothing(platform: Platform, tmp_path: Path) -> None:
    """Invariant 11: the same key with other parameters is a Conflict and leaves every table unchanged."""
    platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1"))
    before = flows.row_counts(platform)
    with pytest.raises(Conflict, match="different request"):
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1", params={"factor": "2"}))
    assert flows.row_counts(platform) == before


def test_replay_of_an_unfinished_run_returns_it(platform: Platform, tmp_path: Path) -> None:
    """A replay of a queued (never executed) run returns that run as it is."""
    queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1")).run
    again = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1"))
    assert (again.created, again.run.run_id, again.run.status) == (False, queued.run_id, "queued")


@pytest.mark.parametrize("inline", [False, True], ids=["queued", "inline"])
def test_a_run_and_its_first_entries_are_written_by_one_statement_on_postgresql(
    platform: Platform, tmp_path: Path, inline: bool
) -> None:
    """On PostgreSQL the recording transaction writes the run's row and its first ledger entries (with
    ``attempt.started`` too, inline) in one statement, the ledger's INSERT a CTE of the run's: a round
    trip less a run; inline, attempt 1's lease is granted by the quota's read (a CTE it selects from),
    another. On SQLite, where a statement is no round trip, each is its own. The chain verifies and
    starts at the run's own time (inline, its lease's grant time) either way. The code before sent two
    INSERTs on both, and the grant on its own."""
    platform.runs.submit(flows.request(flows.definition(), tmp_path, "k0"))  # the definition is stored
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    sa.event.listen(platform.db.engine, "before_cursor_execute", seen)
    try:
        request = flows.request(flows.definition(), tmp_path, "k1")
        run = (platform.runs.run_inline(request) if inline else platform.runs.submit(request)).run
    finally:
        sa.event.remove(platform.db.engine, "before_cursor_execute", seen)
    writes = [s for s in statements if "INSERT INTO dataflow_runs" in s]
    assert len(writes) == 1
    together = "INSERT INTO ledger_entries" in writes[0]
    assert together == (platform.db.dialect == "postgresql")
    grants = [s for s in statements if "INSERT INTO leases" in s]
    assert len(grants) == (1 if inline else 0)
    if inline:  # with the quota's read (of the stored-bytes counter) on PostgreSQL
        assert ("tenant_result_bytes" in grants[0]) == (platform.db.dialect == "postgresql")
    with platform.db.read() as conn:
        verification = ledger.verify(conn, "dataflow", run.run_id)
        entries = ledger.read(conn, "dataflow", run.run_id)
    assert verification.ok
    first = ["run.recorded", "attempt.started"] if inline else ["run.recorded"]
    assert [e.kind for e in entries][: len(first)] == first
    assert {e.recorded_at_us for e in entries[: len(first)]} == {run.created_at_us}
    if inline:
        with platform.db.read() as conn:
            assert _lease_row(conn, run.run_id).acquired_at_us == run.created_at_us


def test_a_terminal_transition_is_written_by_one_statement_on_postgresql(platform: Platform, tmp_path: Path) -> None:
    """On PostgreSQL the atomic success writes its entries, checkpoint, projection, the lease's release,
    the result (one piece) and the tenant's stored-bytes count in one statement (data-modifying CTEs of
    the projection's UPDATE), after the fence's read: five round trips less a run. On SQLite, where a
    statement is no round trip, they stay six. Either way the chain verifies against the checkpoint,
    which holds the ledger's head, the lease is released, and the stored bytes and the counter agree.
    The code before sent six statements on both (four, then two, on PostgreSQL)."""
    platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k0"))  # statements are built
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    sa.event.listen(platform.db.engine, "before_cursor_execute", seen)
    try:
        run = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1")).run
    finally:
        sa.event.remove(platform.db.engine, "before_cursor_execute", seen)
    projections = [s for s in statements if "UPDATE dataflow_runs" in s]
    assert len(projections) == 1
    parts = (
        "INSERT INTO ledger_entries", "INSERT INTO checkpoints", "UPDATE leases", "INSERT INTO run_results",
        "INSERT INTO tenant_result_bytes",
    )  # fmt: skip
    assert all((part in projections[0]) == (platform.db.dialect == "postgresql") for part in parts)
    if platform.db.dialect == "postgresql":  # the terminal transaction: the fence's read, then this one
        assert statements[-1] == projections[0] and statements[-2].startswith("SELECT leases."), statements[-2:]
    with platform.db.read() as conn:
        verification = ledger.verify(conn, "dataflow", run.run_id)
        checkpoint = checkpoints.latest(conn, "dataflow", run.run_id)
        lease = _lease_row(conn, run.run_id)
        stored = results.stored_bytes(conn, run.run_id)
        counted = conn.execute(sa.select(tenant_result_bytes.c.stored_bytes)).scalar_one()
        by_results = conn.execute(sa.select(sa.func.sum(sa.func.length(run_results.c.bytes)))).scalar_one()
    assert verification.ok and run.status == "succeeded"
    assert results.decode_ipc(stored).num_rows == run.row_count
    assert counted == by_results and counted > 0
    assert checkpoint is not None and (checkpoint.head_seq, checkpoint.head_hash, checkpoint.status) == (
        verification.head_seq, verification.head_hash, "succeeded")
    assert checkpoint.facts["output_digest"] == run.output_digest
    assert lease.attempt == 1 and lease.released_at_us is not None


def _lease_row(conn: sa.Connection, run_id: str) -> sa.Row[Any]:
    return conn.execute(sa.select(schema.leases).where(schema.leases.c.subject_id == run_id)).one()


@pytest.mark.parametrize(("refusal", "outcome"), [
    ("projection", transitions.Outcome.DISPATCH_AUTHORIZED),  # no release: the guard is the only check
    ("projection", transitions.Outcome.FAILED_BEFORE_DISPATCH),
    ("release", transitions.Outcome.FAILED_BEFORE_DISPATCH),
])  # fmt: skip
def test_a_transition_whose_guard_refuses_writes_nothing(
    platform: Platform, tmp_path: Path, refusal: str, outcome: transitions.Outcome
) -> None:
    """A transition's projection is written only while the row names the expected attempt, and its lease
    released only while it is that attempt's live one: either refusal is StaleAttempt, and nothing of the
    transition remains (no entry, no checkpoint, the row and the lease as they were), on PostgreSQL where
    one statement wrote them all before its checks, as on SQLite where the check stops the writes. A
    transition that releases nothing (dispatch.authorized) is refused by its guard alone."""
    platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1"))
    claim = platform.runs.claim_next()
    assert claim is not None
    run_id, before = claim.run.run_id, flows.kinds(platform, claim.run.run_id)
    payloads = [{"code": "x", "message": "refused", "no_external_output": True}]
    with pytest.raises(StaleAttempt), fencing.fenced_chain(platform.db, "dataflow", run_id, 1) as (conn, held):
        if refusal == "release":  # in this transaction, after the fence: the lease is no longer live
            conn.execute(sa.update(schema.leases).where(schema.leases.c.subject_id == run_id).values(released_at_us=1))
        transitions.apply(
            conn, platform.db, claim.run, 1, outcome, payloads, evidence_key=None,
            row_attempt=2 if refusal == "projection" else None, held=held,
        )  # fmt: skip
    assert flows.kinds(platform, run_id) == before
    with platform.db.read() as conn:
        assert checkpoints.latest(conn, "dataflow", run_id) is None
        lease = _lease_row(conn, run_id)
    assert (lease.attempt, lease.released_at_us) == (1, None)
    assert platform.runs.get(run_id).status == "running"


def test_a_terminal_whose_guard_refuses_leaves_no_stored_result_and_no_count(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The terminal commit of an inline run whose projection guard refuses (the row named as another
    attempt's, forced through the guard's bind parameter): StaleAttempt, and neither the result's row nor
    the tenant's stored-bytes counter remains, on PostgreSQL where the one statement wrote both (its
    CTEs) before the guard's check, as on SQLite where they are statements of the rolled-back
    transaction."""
    real = runs.update_parameters

    def another_attempt(run_id: str, values: Any, expected_attempt: int | None) -> dict[str, Any]:
        parameters = real(run_id, values, expected_attempt)
        if values.get("status") == RunStatus.SUCCEEDED:
            parameters["match_run_attempt"] = 99
        return parameters

    monkeypatch.setattr(runs, "update_parameters", another_attempt)
    with pytest.raises(StaleAttempt):
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1"))
    with platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(run_results)).scalar_one() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(tenant_result_bytes)).scalar_one() == 0
        assert conn.execute(sa.select(dataflow_runs.c.status)).scalar_one() == "running"


def test_a_transition_refuses_the_held_chain_of_another_run(platform: Platform, tmp_path: Path) -> None:
    """A transition appends only to the chain its fence read for the same run: given another run's held
    chain it is refused (InputError) before anything is written, on PostgreSQL's one-statement path as
    on SQLite's (where ``append_many`` checked it first; the PostgreSQL path had lost the check)."""
    for key in ("k1", "k2"):
        platform.runs.submit(flows.request(flows.definition(), tmp_path, key))
    first, second = platform.runs.claim_next(), platform.runs.claim_next()
    assert first is not None and second is not None
    before = flows.kinds(platform, second.run.run_id)
    with pytest.raises(InputError, match="held chain"), fencing.fenced_chain(
        platform.db, "dataflow", first.run.run_id, 1
    ) as (conn, held):
        transitions.apply(
            conn, platform.db, second.run, 1, transitions.Outcome.DISPATCH_AUTHORIZED, [{}], evidence_key=None,
            held=held,
        )  # fmt: skip
    assert flows.kinds(platform, second.run.run_id) == before


def test_the_one_statement_record_writes_keyed_entries_and_follows_the_outbox_setting(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an evidence key the first entries carry their MACs and verify with it; the outbox rows
    follow ``Database.ledger_outbox`` as it is when each run is recorded, also after a run recorded
    with the other setting (the statement is cached per setting; one cached without outbox rows would
    have dropped lineage's events silently). An inline run is recorded at its lease's grant time."""
    monkeypatch.setenv("DATAFLOW_EVIDENCE_KEY", "canary-evidence-key-record-7f3a")
    key = Secret("DATAFLOW_EVIDENCE_KEY", "canary-evidence-key-record-7f3a")
    with Platform(db_url, lease_ttl_s=5) as platform:
        platform.db.ledger_outbox = False
        quiet = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k0")).run
        platform.db.ledger_outbox = True
        queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1")).run
        inline = platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k2")).run
        platform.db.ledger_outbox = False
        last = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k3")).run
        with platform.db.read() as conn:
            for run in (quiet, queued, inline, last):
                verification = ledger.verify(conn, "dataflow", run.run_id, evidence_key=key)
                assert verification.ok, verification.reason
                assert all(e.entry_mac for e in ledger.read(conn, "dataflow", run.run_id))

            def outbox(run_id: str) -> list[int]:
                where = ledger_outbox.c.subject_id == run_id
                return list(conn.execute(sa.select(ledger_outbox.c.seq).where(where).order_by("seq")).scalars())

            assert [outbox(r.run_id) for r in (quiet, queued, last)] == [[], [1], []]
            assert outbox(inline.run_id)[:2] == [1, 2]  # run.recorded, attempt.started (then the rest)
            lease = leases.current(conn, "dataflow", inline.run_id)
            started = [e for e in ledger.read(conn, "dataflow", inline.run_id) if e.kind == "attempt.started"]
        assert lease is not None and lease.attempt == 1
        assert inline.created_at_us == started[0].recorded_at_us == lease.acquired_at_us


def test_a_read_connection_refuses_a_statement_that_writes_in_a_cte(pg_url: str) -> None:
    """The read-only guard (``core.db._refuse_writes``) also refuses ``WITH … AS (INSERT …) SELECT``, the
    shape of the one-statement record: it starts with WITH, so the code before let it through on
    PostgreSQL's autocommit read connections (SQLite's reads are transactions rolled back). Nothing is
    written."""
    inserted = ledger_outbox.insert().values(module="test", subject_id="cte", seq=1).cte("written")
    statement = sa.select(sa.literal(1)).add_cte(inserted)
    with Platform(pg_url) as platform:
        with pytest.raises(InvariantViolation, match="read-only connection"), platform.db.read() as conn:
            conn.execute(statement)
        with platform.db.read() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(ledger_outbox)).scalar_one() == 0


def test_a_replay_is_answered_though_its_placement_is_now_refused(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay is answered with its run although the placement checks would refuse it now (a secret
    revoked since, say), and a conflicting one is still a Conflict, while a new key gets the refusal."""
    queued = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1")).run

    def refuse(*_args: object) -> None:
        raise InputError("secret 'token' is not granted here")

    monkeypatch.setattr(Submitter, "check_placement", refuse)
    again = platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1"))
    assert (again.created, again.run.run_id) == (False, queued.run_id)
    with pytest.raises(Conflict, match="different request"):
        platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1", params={"factor": "2"}))
    before = flows.row_counts(platform)
    for key in ("k2", None):
        with pytest.raises(InputError, match="not granted"):
            platform.runs.submit(flows.request(flows.definition(), tmp_path, key))
    assert flows.row_counts(platform) == before


def test_stale_attempt_leaves_no_trace_and_is_retried(platform: Platform, tmp_path: Path) -> None:
    """A lease that expires before the terminal commit refuses the commit; the sweeper proves the attempt
    absent (invariant 9) and the next attempt succeeds."""

    def expire(point: str) -> None:
        if point == crashpoints.BEFORE_TERMINAL_COMMIT:
            flows.expire_leases(platform)

    crashpoints.set_hook(expire)
    with pytest.raises(Exception, match="lost its lease"):
        platform.runs.run_inline(flows.request(flows.definition(), tmp_path, "k1"))
    crashpoints.set_hook(None)
    with platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(run_results)).scalar_one() == 0
    decisions = sweeper.sweep(platform.db)
    assert [d.decision for d in decisions] == ["recovered"]
    claim = platform.runs.claim_next()
    assert claim is not None and claim.attempt == 2
    run = platform.runs.execute(claim)
    assert (run.status, run.attempt) == ("succeeded", 2)
    assert flows.kinds(platform, run.run_id).count("attempt.recovered") == 1


def test_attempts_exhausted_fail_with_no_external_output(platform: Platform, tmp_path: Path) -> None:
    """With max_attempts=1, an expired attempt is recovered and the run fails, recording no external output."""
    platform.runs.submit(flows.request(flows.definition(), tmp_path, "k1", max_attempts=1))
    claim = platform.runs.claim_next()
    assert claim is not None
    flows.expire_leases(platform)
    assert [d.decision for d in sweeper.sweep(platform.db)] == ["failed"]
    run = platform.runs.get(claim.run.run_id)
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "attempts_exhausted")
    assert platform.runs.claim_next() is None


@pytest.mark.parametrize(
    ("sql", "problem"),
    [
        ("select * from read_csv('/etc/passwd')", "external"),
        ("copy (select 1) to '/tmp/x.csv'", "COPY"),
        ("attach '/tmp/x.db'", "ATTACH"),
        ("drop view sales", "DROP"),
        ("select 1; select 2", "statement"),
    ],
)
def test_hostile_sql_is_refused_and_writes_nothing(platform: Platform, tmp_path: Path, sql: str, problem: str) -> None:
    """Hostile SQL gets a clear error; gate failures write nothing, sandbox refusals fail the run cleanly."""
    before = flows.row_counts(platform)
    defn = flows.definition(sql=sql)
    try:
        run = platform.runs.run_inline(flows.request(defn, tmp_path, "k1")).run
    except InputError as error:
        assert problem.lower() in error.message.lower() or "select" in error.message.lower()
        assert flows.row_counts(platform) == before
        return
    assert run.status == "failed" and run.recovery_status == "no_external_output"
    assert run.error_message
    with platform.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(run_results)).scalar_one() == 0


def test_source_path_escape_is_refused_before_recording(platform: Platform, tmp_path: Path) -> None:
    """A csv source outside the allowed roots is an InputError naming the source; nothing is written."""
    before = flows.row_counts(platform)
    extra = {"leak": {"kind": "csv", "path": "../../../etc/passwd"}}
    with pytest.raises(InputError, match="leak"):
        platform.runs.run_inline(flows.request(flows.definition(extra_sources=extra), tmp_path, "k1"))
    assert flows.row_counts(platform) == before


def test_a_run_executes_its_pinned_definition(platform: Platform, tmp_path: Path) -> None:
    """A queued run executes the body it recorded, even after a newer version of the same name ran."""
    v1 = flows.definition()
    queued = platform.runs.submit(flows.request(v1, tmp_path, "pinned")).run
    v2 = flows.definition(sql="select 'other' as region, 0::DECIMAL(18,2) as total, 0::BIGINT as n")
    newer = platform.runs.run_inline(flows.request(v2, tmp_path, "newer")).run
    assert newer.definition_hash != queued.definition_hash and newer.row_count == 1
    claim = platform.runs.claim_next()
    assert claim is not None and claim.run.run_id == queued.run_id
    run = platform.runs.execute(claim)
    assert (run.status, run.row_count, run.definition_hash) == ("succeeded", 2, queued.definition_hash)


def test_two_first_submits_of_one_definition_race_without_a_conflict(pg_url: str, tmp_path: Path) -> None:
    """Proves the content-addressed definition row tolerates a concurrent first insert: platform A has
    inserted the definition in an open transaction, platform B's submit of the same definition (another
    key) waits on that row, and once A commits, B records its run instead of answering Conflict."""
    defn = flows.definition()
    row = {"definition_hash": definition_hash(defn), "name": defn.name, "version": defn.version,
           "body_json": hashing.canonical_json(canonical_body(defn)).decode("utf-8"), "registered_at_us": 0}
    with Platform(pg_url) as first, Platform(pg_url) as second:
        outcome: dict[str, Any] = {}

        def submit_second() -> None:
            try:
                outcome["run"] = second.runs.submit(flows.request(defn, tmp_path, "key-b")).run
            except Exception as error:  # reported by the main thread
                outcome["error"] = error

        with first.db.begin() as conn:
            conn.execute(definitions.insert().values(**row))  # A's first insert, not yet committed
            waiter = threading.Thread(target=submit_second)
            waiter.start()
            with first.db.read() as probe:  # B is blocked on A's row: wait for that, never sleep
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not probe.execute(sa.text(
                    "select count(*) from pg_stat_activity where datname = current_database() "
                    "and wait_event_type = 'Lock'"
                )).scalar_one():
                    probe.rollback()
        waiter.join(30)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["run"].status == RunStatus.QUEUED
