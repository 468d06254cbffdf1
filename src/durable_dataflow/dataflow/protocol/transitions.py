"""The protocol's transitions written (DESIGN §6): one named function per family in front of the table.

Every state change of a dataflow run is one row of ``transition_table.TABLE``. :func:`apply` is the
one function that writes a row, inside the caller's fenced (or sweep-guarded) transaction, always in
the same order: append → checkpoint → projection (guarded by the expected attempt) → lease release;
the named functions below (``record``, ``start_attempt``, ``authorize_dispatch``, …) alone build its
ledger payloads and projection columns. The table read backwards (the state a verified ledger
implies) is ``derivation``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, fencing, hashing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, EvidenceError, StaleAttempt
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.protocol import evidence, partition_tokens, runs
from durable_dataflow.dataflow.protocol.derivation import projection_problem, workspace_digest
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.dataflow.protocol.transition_table import TABLE as TABLE
from durable_dataflow.dataflow.protocol.transition_table import Outcome as Outcome
from durable_dataflow.dataflow.protocol.transition_table import Success as Success
from durable_dataflow.dataflow.protocol.transition_table import Transition as Transition
from durable_dataflow.dataflow.protocol.transition_table import Warning as Warning
from durable_dataflow.dataflow.protocol.transition_table import warning_text
from durable_dataflow.datasources.contract import AlreadyPublished, Inconclusive, Present, Published

MESSAGE_CHARS_MAX = 2000
Item = tuple[int, str, Mapping[str, Any]]  # (attempt, kind, payload), as core.ledger.append_many takes them


def apply(
    conn: Connection,
    db: Database,
    run: Run,
    attempt: int,
    outcome: Outcome,
    payloads: Sequence[Mapping[str, Any]],
    *,
    evidence_key: Secret | None,
    projection: Mapping[str, Any] | None = None,
    new_subject_at_us: int | None = None,
    row_attempt: int | None = None,
    held: ledger.HeldChain | None = None,
    storing: results.Computed | None = None,
    stored_ahead: int | None = None,
) -> Run:
    """Write one transition in the caller's transaction: append → checkpoint → projection → release.

    ``projection`` adds the transition's own columns (digests, refs, error code and message). A
    checkpoint that does not verify raises EvidenceError before the projection is written, so the
    caller's transaction carries nothing of this transition. The projection is written only while
    the row names ``row_attempt`` (default: ``attempt``; a transition that starts an attempt names
    the one it follows). ``held`` is the chain the caller's fence statement read
    (``fencing.fenced_chain``): appended to and verified without reading it again. ``storing``: the
    result this transition stores (``results.store``, first) and adds to its tenant's stored bytes
    (``results.count_stored``, last: the counter's row is held to the commit); the checkpoint verifies
    the bytes as written. ``stored_ahead``: the bytes of ``storing`` the caller's transaction already
    stored (``results.store``, before a lock it takes), which this transition only counts.

    On PostgreSQL a transition with ``held`` writes its entries, checkpoint, projection and release in
    one statement (data-modifying CTEs of the projection's UPDATE: :func:`_written_at_once`), three round
    trips less, in the same order of checks, with a result of one piece (``results.stored_at_once``) and
    its count too (``results.stored_ctes``), two more; elsewhere (and on SQLite, where a statement is no
    round trip) each is its own statement.
    """
    transition = TABLE[outcome]
    appending = items(outcome, attempt, payloads)
    at_once = held is not None and new_subject_at_us is None and db.dialect == "postgresql"
    stored_size = stored_ahead
    if storing is not None and stored_size is None and not (at_once and results.stored_at_once(storing)):
        stored_size = results.store(conn, run.run_id, attempt, storing)
    pending = None
    if at_once and held is not None:
        pending = ledger.held_entries(db, MODULE, run.run_id, appending, held, evidence_key=evidence_key)
        appended = pending.entries
    else:
        appended = ledger.append_many(
            conn, db, MODULE, run.run_id, appending,
            evidence_key=evidence_key, new_subject_at_us=new_subject_at_us, held=held,
        )  # fmt: skip
    held = held.extended(appended) if held is not None else None
    values: dict[str, Any] = dict(projection or {})
    if transition.status is not None:
        values["status"] = transition.status
    if transition.recovery is not None:
        values["recovery_status"] = transition.recovery
    if transition.warning != Warning.KEEP:
        values["warning"] = warning_text(transition.warning, run.model_copy(update=values), payloads)
    checkpoint = None
    if transition.checkpoint:
        after = run.model_copy(update={**values, "attempt": attempt})
        written = (results.STORED_FORMAT, storing.ipc_bytes) if storing is not None else None
        checkpoint = _checkpoint(
            conn, db, after, attempt, outcome, transition, evidence_key, held, written, write=pending is None
        )
    guard = attempt if row_attempt is None else row_attempt
    release = attempt if transition.releases_lease else None
    if pending is not None:
        stored = None
        if storing is not None and stored_size is None:
            stored = results.stored_parameters(run.run_id, attempt, storing, run.tenant)
        final = _written_at_once(conn, db, run.run_id, pending, checkpoint, values, guard, release, stored)
    else:
        final = runs.update(conn, db, run.run_id, expected_attempt=guard, **values)
        if release is not None:
            leases.release(conn, db, MODULE, run.run_id, release)
    if stored_size is not None:
        results.count_stored(conn, run.tenant, stored_size)  # last: holds the tenant's counter row to the commit
    return final


def _written_at_once(
    conn: Connection,
    db: Database,
    run_id: str,
    pending: ledger.PendingEntries,
    checkpoint: Mapping[str, Any] | None,
    values: Mapping[str, Any],
    guard: int,
    release: int | None,
    stored: Mapping[str, Any] | None,
) -> Run:
    """:func:`apply`'s writes in one PostgreSQL statement: the entries (``pending``), the verified
    ``checkpoint`` (``checkpoints.verified``'s values), the projection guarded by ``guard``, the
    lease's release by attempt ``release``, and the result stored with its count (``stored``:
    ``results.stored_parameters``). The same checks follow as each statement's own would make
    (StaleAttempt: the row names another attempt, or the lease is not this attempt's live one); one that
    fails raises, and the caller's transaction, with everything the statement wrote, rolls back."""
    shape = (
        tuple(sorted(values)), len(pending.entries), pending.outbox, checkpoint is not None, release is not None,
        stored is not None,
    )  # fmt: skip
    parameters = {
        **pending.parameters, **runs.update_parameters(run_id, values, guard), **(checkpoint or {}), **(stored or {})
    }  # fmt: skip
    if release is not None:
        parameters.update(leases.release_parameters(MODULE, run_id, release))
    row = conn.execute(db.statement(_transition_statement, *shape), parameters).one_or_none()
    final = runs.updated(row, run_id, guard)
    if release is not None:
        leases.released(int(row.released_leases) if row is not None else 0, MODULE, run_id, release)
    return final


def _transition_statement(
    db: Database, names: tuple[str, ...], entries: int, outbox: bool, checkpoint: bool, release: bool, stored: bool
) -> sa.Select[Any]:
    """The projection's guarded UPDATE … RETURNING, with the ``entries`` (and their outbox rows), the
    checkpoint, the lease's release and the stored result with its count as data-modifying CTEs; one
    row (the run's, and with ``release`` the count of leases released), or none when the guard matched
    no row."""
    updated = runs.updated_cte(db, names, guarded=True)
    columns: list[Any] = list(updated.c)
    if release:
        released = leases.released_cte(db)
        columns.append(sa.select(sa.func.count()).select_from(released).scalar_subquery().label("released_leases"))
    writes = [
        *ledger.entries_ctes(entries, outbox), *([checkpoints.inserted_cte(db)] if checkpoint else []),
        *(results.stored_ctes() if stored else ()),
    ]  # fmt: skip
    return sa.select(*columns).add_cte(*writes)


def terminate(
    db: Database,
    run: Run,
    attempt: int,
    outcome: Outcome,
    payloads: Sequence[Mapping[str, Any]],
    *,
    evidence_key: Secret | None,
    projection: Mapping[str, Any] | None = None,
) -> Run:
    """One fenced transaction that writes a terminal transition (StaleAttempt when fenced off)."""
    with fencing.fenced_chain(db, MODULE, run.run_id, attempt) as (conn, held):
        return apply(
            conn, db, run, attempt, outcome, payloads, evidence_key=evidence_key, projection=projection, held=held
        )


def record_evidence_failure(db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None) -> Run:
    """Verification refused a transition: the run is unresolved, with the reason, loudly."""
    reason = reason[:MESSAGE_CHARS_MAX]
    return terminate(
        db, run, attempt, Outcome.EVIDENCE_FAILED, [{"reason": reason}], evidence_key=evidence_key,
        projection={"error_code": EvidenceError.code, "error_message": reason},
    )  # fmt: skip


def _checkpoint(
    conn: Connection,
    db: Database,
    after: Run,
    attempt: int,
    outcome: Outcome,
    transition: Transition,
    evidence_key: Secret | None,
    held: ledger.HeldChain | None,
    written: tuple[str, bytes | memoryview] | None,
    *,
    write: bool,
) -> dict[str, Any] | None:
    """A verified checkpoint of the state this transition projects (``after``): the chain verifies,
    the ledger implies exactly that state, and a success shows its facts (digest, evidence, bytes).
    Written here (``write``), or verified and returned as ``checkpoints.verified``'s values for the
    caller's statement; None when there is none to write (an evidence failure's unverified chain)."""

    def facts(entries: Sequence[ledger.Entry]) -> str:
        problem = projection_problem(entries, after)
        if problem or transition.success == Success.NONE:
            return problem
        stored = evidence.stored_result_digest(conn, after.run_id, written=written)
        if transition.success == Success.ATOMIC:
            return evidence.atomic_success_problem(entries, attempt, stored)
        return evidence.forward_success_problem(entries, attempt, stored)

    if outcome == Outcome.EVIDENCE_FAILED:
        # The state exists because the evidence does not support a projection: when the chain, or the
        # ledger against the row, does not verify, there is no verified head to checkpoint (and raising
        # here would leave the run running, or stop a sweeper on it).
        verification = checkpoints.verify_subject(
            conn, MODULE, after.run_id, evidence_key=evidence_key,
            facts_check=lambda entries: projection_problem(entries, after), held=held,
        )  # fmt: skip
        if not verification.ok:
            return None
    state = checkpoint_facts(after)
    verified = checkpoints.verified(
        conn, MODULE, after.run_id, attempt, str(after.status), state, evidence_key=evidence_key,
        facts_check=facts, held=held,
    )  # fmt: skip
    if not write:
        return verified
    checkpoints.write(conn, db, verified, state)
    return None


def checkpoint_facts(run: Run) -> dict[str, Any]:
    """What a checkpoint holds of a run's state."""
    facts: dict[str, Any] = {"status": str(run.status), "recovery_status": str(run.recovery_status)}
    for name in ("output_digest", "publication_ref", "datasource_ref", "materialization_ref"):
        value = getattr(run, name)
        if value is not None:
            facts[name] = value
    if run.row_count is not None:
        facts["row_count"] = str(run.row_count)
    return facts


def items(outcome: Outcome, attempt: int, payloads: Sequence[Mapping[str, Any]]) -> list[Item]:
    """The ledger items of a transition, for a caller that appends them with other statements of its own."""
    kinds = TABLE[outcome].kinds
    if len(payloads) != len(kinds):
        raise ValueError(f"{outcome} appends {len(kinds)} entries, {len(payloads)} payloads were given")
    return [(attempt, kind, payload) for kind, payload in zip(kinds, payloads, strict=True)]


def conclude(
    db: Database,
    run: Run,
    attempt: int,
    outcome: Outcome,
    payloads: Sequence[Mapping[str, Any]],
    *,
    evidence_key: Secret | None,
    projection: Mapping[str, Any] | None = None,
) -> Run | None:
    """End an attempt with ``outcome``; when its evidence does not verify, end it ``evidence_failed``
    instead (never a state the ledger cannot support). None when the attempt was fenced off: another
    attempt owns the run, and this one records nothing."""
    try:
        try:
            return terminate(db, run, attempt, outcome, payloads, evidence_key=evidence_key, projection=projection)
        except EvidenceError as error:
            return record_evidence_failure(db, run, attempt, error.message, evidence_key=evidence_key)
    except StaleAttempt:
        return None


# ---- the named transitions ----------------------------------------------------------------------
# One typed function per family, in front of TABLE: the only code that builds a transition's ledger
# payloads and projection columns, so a caller names what happened and hands over its facts.

Found = Published | AlreadyPublished | Present  # a sink's answer that a publication exists, with its refs
SINK_LOCATION = "sink_location"  # the dispatch.authorized field that records the prepared location
CANCELLED_CODE = "cancelled"  # a cancelled run's error code
RECONCILED_ABSENT_CODE = "publication_absent"  # a reconcile proved the key absent: the settled error of the run
INTERRUPTED = "interrupted"  # run.cancelled's reason when the attempt's own process was told to stop


def record(
    conn: Connection,
    db: Database,
    row: Mapping[str, Any],
    lease: leases.Lease | None,
    now_us: int,
    *,
    evidence_key: Secret | None,
) -> Run:
    """RECORDED: the run's row and ``run.recorded``; inline (``lease``, attempt 1's), STARTED too, with
    the row inserted already holding what STARTED projects, so it is written once. ``now_us`` is a
    database time the transaction read (the quota read's; inline, the lease grant's, which comes after
    it): the run's and the entries' time.

    On PostgreSQL the row and its first entries are one statement (the run's INSERT with the ledger's as
    data-modifying CTEs: a round trip less a run); on SQLite, where a statement costs no round trip, two."""
    values = dict(row)
    entries = items(Outcome.RECORDED, 0, [_recorded_payload(row)])
    if lease is not None:
        started = TABLE[Outcome.STARTED]
        values.update(attempt=lease.attempt, status=started.status, recovery_status=started.recovery)
        entries += items(Outcome.STARTED, lease.attempt, [{"holder": lease.holder}])
    if db.dialect != "postgresql":
        run = runs.insert(conn, db, values, now_us)
        ledger.append_many(conn, db, MODULE, run.run_id, entries, evidence_key=evidence_key, new_subject_at_us=now_us)
        return run
    first = ledger.first_entries(db, MODULE, str(values["run_id"]), entries, now_us, evidence_key=evidence_key)
    statement = db.statement(_record_statement, tuple(sorted(values)), len(entries), first.outbox)
    parameters = {**runs.inserted_parameters(values, now_us), **first.parameters}
    return runs.from_row(conn.execute(statement, parameters).one())


def _record_statement(db: Database, names: tuple[str, ...], entries: int, outbox: bool) -> sa.Select[Any]:
    """The run's row and its ``entries`` first ledger entries (and their outbox rows), in one PostgreSQL
    statement."""
    return sa.select(runs.inserted_cte(db, names)).add_cte(*ledger.entries_ctes(entries, outbox))


def _recorded_payload(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "run_id": row["run_id"],
        "tenant": row["tenant"],
        "idempotency_key": row["idempotency_key"],
        "definition_hash": row["definition_hash"],
        "request_hash": row["request_hash"],
        "mode": str(row["mode"]),
        "provenance": json.loads(row["provenance_json"]),
        "access_context_digest": row["access_context_digest"],
        "max_attempts": row["max_attempts"],
        "principal": row["principal"],
        "workspace_digest": workspace_digest(json.loads(row["workspace_json"])),
    }


def start_attempt(
    conn: Connection, db: Database, run_id: str, lease: leases.Lease, *, evidence_key: Secret | None
) -> Run:
    """STARTED: ``attempt.started`` under the lease just taken (a claim), and the row projected running;
    from the ledger head the lease's grant read (``lease.chain_head``), else read here."""
    ledger.append_many(
        conn, db, MODULE, run_id, items(Outcome.STARTED, lease.attempt, [{"holder": lease.holder}]),
        evidence_key=evidence_key, head=lease.chain_head,
    )  # fmt: skip
    started = TABLE[Outcome.STARTED]
    return runs.update(conn, db, run_id, attempt=lease.attempt, status=started.status, recovery_status=started.recovery)


def start_reconcile(
    conn: Connection, db: Database, run: Run, lease: leases.Lease, asked_by: Mapping[str, Any], *,
    evidence_key: Secret | None,
) -> Run:  # fmt: skip
    """RECONCILE_STARTED: an operator's inspection (``asked_by``: who and how) holds the new lease."""
    return apply(
        conn, db, run, lease.attempt, Outcome.RECONCILE_STARTED, [{"holder": lease.holder, **asked_by}],
        evidence_key=evidence_key, projection={"attempt": lease.attempt}, row_attempt=run.attempt,
    )  # fmt: skip


def authorize_resume(
    conn: Connection, db: Database, run: Run, lease: leases.Lease, asked_by: Mapping[str, Any],
    authorization: Mapping[str, Any], *, evidence_key: Secret | None,
) -> Run:  # fmt: skip
    """RESUME_AUTHORIZED: an operator's re-dispatch of the stored result under the new lease, with the
    original ``dispatch.authorized`` payload (the same digests and key, never recomputed)."""
    return apply(
        conn, db, run, lease.attempt, Outcome.RESUME_AUTHORIZED,
        [{"holder": lease.holder, **asked_by}, dict(authorization)],
        evidence_key=evidence_key, projection={"attempt": lease.attempt}, row_attempt=run.attempt,
    )  # fmt: skip


def authorize_dispatch(
    conn: Connection, db: Database, run: Run, attempt: int, result: ExecutionResult, publication_key: str, *,
    sink_location: Mapping[str, Any] | None, partition_token: int | None, evidence_key: Secret | None,
    held: ledger.HeldChain, stored_ahead: int | None = None,
) -> Run:  # fmt: skip
    """DISPATCH_AUTHORIZED, in the caller's fenced pre-dispatch commit, which stores ``result`` (or
    stored it already: ``stored_ahead``, ``apply``): the result's facts, the publication key and its
    digest, the target, the prepared location (its place's digest and identity) and the partition token
    this commit took, when there are any."""
    target = run.target or {}
    idem_digest = hashing.digest(
        {"publication_idempotency_key": publication_key, "output_digest": result.output_digest, "target": target}
    )
    payload: dict[str, Any] = {
        **results.facts(result),
        "publication_idempotency_key": publication_key,
        "publication_idempotency_digest": idem_digest,
        "target": target,
    }
    if sink_location is not None:
        payload[SINK_LOCATION] = dict(sink_location)
    if partition_token is not None:
        payload[partition_tokens.PARTITION_TOKEN] = partition_token
    return apply(
        conn, db, run, attempt, Outcome.DISPATCH_AUTHORIZED, [payload], evidence_key=evidence_key,
        held=held, storing=result, stored_ahead=stored_ahead,
        projection={
            **_result_projection(result),
            "publication_idempotency_key": publication_key, "publication_idempotency_digest": idem_digest,
        },
    )  # fmt: skip


def _result_projection(result: ExecutionResult) -> dict[str, Any]:
    return {
        "row_count": result.row_count, "output_digest": result.output_digest,
        "source_fingerprint_digest": result.source_fingerprint_digest,
    }  # fmt: skip


def succeed_atomic(
    conn: Connection, db: Database, run: Run, attempt: int, result: ExecutionResult, *,
    evidence_key: Secret | None, held: ledger.HeldChain,
) -> Run:  # fmt: skip
    """ATOMIC_SUCCEEDED, in the caller's fenced terminal commit, which stores ``result`` (``apply``)."""
    return apply(
        conn, db, run, attempt, Outcome.ATOMIC_SUCCEEDED,
        [results.facts(result), {"output_digest": result.output_digest}],
        evidence_key=evidence_key, projection=_result_projection(result), held=held, storing=result,
    )  # fmt: skip


def fail_before_dispatch(
    db: Database, run: Run, attempt: int, error: DataflowError, *, evidence_key: Secret | None,
    missing_capability: bool = False,
) -> Run | None:  # fmt: skip
    """FAILED_BEFORE_DISPATCH: nothing was dispatched, so no external output exists (None: fenced off;
    evidence_failed when the chain does not verify)."""
    message = error.message[:MESSAGE_CHARS_MAX]
    facts = {"missing_capability": True} if missing_capability else {}
    return conclude(
        db, run, attempt, Outcome.FAILED_BEFORE_DISPATCH,
        [{"code": error.code, "message": message, "no_external_output": True, **facts}],
        evidence_key=evidence_key, projection={"error_code": error.code, "error_message": message},
    )  # fmt: skip


def _refs(found: Found) -> dict[str, str]:
    return {
        "publication_ref": found.refs.publication_ref,
        "datasource_ref": found.refs.datasource_ref,
        "materialization_ref": found.refs.materialization_ref,
    }


def succeed_publication(
    db: Database, run: Run, attempt: int, outcome: Outcome, found: Found, how: str, *, evidence_key: Secret | None
) -> Run:
    """PUBLISHED or RECONCILED_PRESENT: refs, ``run.succeeded`` and the verified checkpoint commit together,
    or not at all (``how``: published, already_published or present)."""
    invariant(outcome in (Outcome.PUBLISHED, Outcome.RECONCILED_PRESENT), f"{outcome} is no publication success")
    refs = _refs(found)
    return terminate(
        db, run, attempt, outcome,
        [{"outcome": how, "digest": found.digest, **refs}, {"output_digest": found.digest}],
        evidence_key=evidence_key, projection={**refs, "error_code": None, "error_message": None},
    )  # fmt: skip


def reject_publication(db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None) -> Run:
    """REJECTED: the sink proved nothing was created; the run failed, with that evidence."""
    return terminate(
        db, run, attempt, Outcome.REJECTED,
        [{"reason": reason}, {"code": "publication_rejected", "message": reason, "no_external_output": True}],
        evidence_key=evidence_key, projection={"error_code": "publication_rejected", "error_message": reason},
    )  # fmt: skip


def record_mismatch(
    db: Database, run: Run, attempt: int, outcome: Outcome, found: Found, *, evidence_key: Secret | None
) -> Run:
    """PUBLICATION_MISMATCH or RECONCILE_MISMATCH: the key exists with another digest; unresolved, never success."""
    invariant(outcome in (Outcome.PUBLICATION_MISMATCH, Outcome.RECONCILE_MISMATCH), f"{outcome} is no mismatch")
    refs = _refs(found)
    return terminate(
        db, run, attempt, outcome, [{"digest": found.digest, **refs}], evidence_key=evidence_key, projection=refs
    )


def publication_unknown(
    db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None
) -> Run | None:
    """PUBLICATION_UNKNOWN: the sink said nothing conclusive; never retried automatically (None: fenced off)."""
    return conclude(
        db, run, attempt, Outcome.PUBLICATION_UNKNOWN, [{"reason": reason}],
        evidence_key=evidence_key, projection={"error_code": Inconclusive.code, "error_message": reason},
    )  # fmt: skip


def reconciled_absent(db: Database, run: Run, attempt: int, fenced_at: int, *, evidence_key: Secret | None) -> Run:
    """RECONCILED_ABSENT: the sink proved the key absent and fenced it at ``fenced_at``. The stored error is
    superseded by the settled finding: the earlier "may have published" cause no longer describes the run."""
    settled = (
        f"reconcile proved the publication absent and fenced the key at {fenced_at}: no external output; "
        "`dataflow reconcile RUN --resume` publishes the stored result"
    )
    return terminate(
        db, run, attempt, Outcome.RECONCILED_ABSENT, [{"fenced_at": fenced_at}], evidence_key=evidence_key,
        projection={"error_code": RECONCILED_ABSENT_CODE, "error_message": settled},
    )  # fmt: skip


def reconcile_undecided(db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None) -> Run:
    """RECONCILE_UNDECIDED: the inspection proved nothing; the run stays as it was."""
    return terminate(db, run, attempt, Outcome.RECONCILE_UNDECIDED, [{"reason": reason}], evidence_key=evidence_key)


def reconciled_invalid_target(
    db: Database, run: Run, attempt: int, refusal: str, message: str, *, evidence_key: Secret | None
) -> Run:
    """RECONCILED_INVALID_TARGET: the target is invalid by its recorded text; the run failed with no output."""
    return terminate(
        db, run, attempt, Outcome.RECONCILED_INVALID_TARGET,
        [{"reason": refusal}, {"code": "invalid_target", "message": message, "no_external_output": True}],
        evidence_key=evidence_key, projection={"error_code": "invalid_target", "error_message": message},
    )  # fmt: skip


def evidence_failed_unless_stale(
    db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None
) -> Run | None:
    """EVIDENCE_FAILED in its own fenced transaction; None when the attempt was fenced off."""
    try:
        return record_evidence_failure(db, run, attempt, reason, evidence_key=evidence_key)
    except StaleAttempt:
        return None


def evidence_failed_in(
    conn: Connection, db: Database, run: Run, attempt: int, reason: str, *, evidence_key: Secret | None
) -> Run:
    """EVIDENCE_FAILED in the caller's (sweep-guarded) transaction."""
    return apply(
        conn, db, run, attempt, Outcome.EVIDENCE_FAILED, [{"reason": reason}], evidence_key=evidence_key,
        projection={"error_code": EvidenceError.code, "error_message": reason},
    )  # fmt: skip


def cancel_run(
    conn: Connection, db: Database, run: Run, asked_by: Mapping[str, Any], signal: str | None, *,
    evidence_key: Secret | None,
) -> Run:  # fmt: skip
    """CANCELLED under the run's current attempt, in the caller's transaction (which closed its lease):
    who asked and from what status; with ``signal``, the attempt's own process was interrupted by it."""
    who = asked_by["principal"]
    reason = {"reason": INTERRUPTED, "signal": signal} if signal is not None else {}
    if signal is not None:
        host = asked_by["provenance"]["host"]
        message = (
            f"interrupted ({signal}) in the process of {who} on {host} before dispatch authorization: "
            "no external output"
        )
    else:
        message = f"cancelled by {who} before dispatch authorization: no external output"
    payload = {**asked_by, **reason, "from_status": str(run.status), "no_external_output": True}
    return apply(
        conn, db, run, run.attempt, Outcome.CANCELLED, [payload], evidence_key=evidence_key,
        projection={"error_code": CANCELLED_CODE, "error_message": message[:MESSAGE_CHARS_MAX]},
    )  # fmt: skip


# What a sweep records of an expired attempt (or one whose holder process is gone): its reason, by what
# the attempt had done, and the error of a run with no attempt left.
_SWEPT_REASONS = {
    (False, False): "lease expired before dispatch authorization: proven absent",
    (False, True): "the attempt's lease expired after dispatch authorization",
    (True, False): "the holder's process is gone before dispatch authorization: proven absent",
    (True, True): "the attempt's holder process is gone after dispatch authorization",
}
_SWEPT_OUTCOMES = (Outcome.SWEPT_RECOVERED, Outcome.SWEPT_EXHAUSTED, Outcome.SWEPT_UNKNOWN)


def swept(
    conn: Connection, db: Database, run: Run, attempt: int, outcome: Outcome, *, holder_gone: bool,
    evidence_key: Secret | None,
) -> Run:  # fmt: skip
    """SWEPT_RECOVERED, SWEPT_EXHAUSTED or SWEPT_UNKNOWN, in the sweeper's transaction that closed the
    attempt's lease (``holder_gone``: a live lease whose holder process is gone, rather than an expired one)."""
    invariant(outcome in _SWEPT_OUTCOMES, f"{outcome} is no sweep decision")
    authorized = outcome == Outcome.SWEPT_UNKNOWN
    reason: dict[str, object] = {"reason": _SWEPT_REASONS[(holder_gone, authorized)]}
    if holder_gone:
        reason["holder_gone"] = True
    payloads: list[Mapping[str, Any]] = [reason]
    projection: dict[str, object] = {}
    if outcome == Outcome.SWEPT_EXHAUSTED:
        # The stored error names the real cause of the last attempt's end, as the ledger does (issue 33).
        exhausted = f"all {run.max_attempts} attempts ended before dispatch authorization; the last: {reason['reason']}"
        payloads.append({"code": "attempts_exhausted", "message": exhausted, "no_external_output": True})
        projection = {"error_code": "attempts_exhausted", "error_message": exhausted}
    elif authorized:
        projection = {"error_code": "inconclusive", "error_message": reason["reason"]}
    return apply(conn, db, run, attempt, outcome, payloads, evidence_key=evidence_key, projection=projection)
