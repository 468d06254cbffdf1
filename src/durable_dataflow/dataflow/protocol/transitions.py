"""The protocol's transitions as data (DESIGN §6; docs/model.md maps each one to the spin model).

Every state change of a dataflow run is one row of :data:`TABLE`: the ledger entries it appends,
the run status and recovery status it projects, whether it writes a verified checkpoint, whether it
releases the lease, and which warning the run then carries. :func:`apply` is the one function that
writes a transition, inside the caller's fenced (or sweep-guarded) transaction, always in the same
order: append → checkpoint → projection (guarded by the expected attempt) → lease release.

The same table read backwards is :func:`derive`: the state a verified ledger implies, which
``dataflow verify`` compares with the run projection, so a flipped projection field is caught.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, fencing, hashing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, EvidenceError, StaleAttempt
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.protocol import evidence, partition_tokens, runs
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, RecoveryStatus, Run, RunStatus
from durable_dataflow.datasources.contract import AlreadyPublished, Inconclusive, Present, Published

MESSAGE_CHARS_MAX = 2000
Item = tuple[int, str, Mapping[str, Any]]  # (attempt, kind, payload), as core.ledger.append_many takes them


class Outcome(enum.StrEnum):
    """Each transition of a run; the terminal ones end an attempt."""

    RECORDED = "recorded"  # run.recorded: queued
    STARTED = "started"  # attempt.started: a worker holds the lease
    DISPATCH_AUTHORIZED = "dispatch_authorized"  # the pre-dispatch commit
    RECONCILE_STARTED = "reconcile_started"  # an operator's inspection holds the lease
    RESUME_AUTHORIZED = "resume_authorized"  # an operator's re-dispatch of the stored result
    ATOMIC_SUCCEEDED = "atomic_succeeded"
    PUBLISHED = "published"  # the sink confirmed the publication with the recorded digest
    RECONCILED_PRESENT = "reconciled_present"
    FAILED_BEFORE_DISPATCH = "failed_before_dispatch"
    REJECTED = "rejected"  # the sink proved nothing was created
    PUBLICATION_MISMATCH = "publication_mismatch"
    RECONCILE_MISMATCH = "reconcile_mismatch"
    PUBLICATION_UNKNOWN = "publication_unknown"
    EVIDENCE_FAILED = "evidence_failed"
    RECONCILED_ABSENT = "reconciled_absent"
    RECONCILE_UNDECIDED = "reconcile_undecided"
    RECONCILED_INVALID_TARGET = "reconciled_invalid_target"  # no publish could ever write to the target
    SWEPT_RECOVERED = "swept_recovered"  # an expired attempt proven absent; queued again
    SWEPT_EXHAUSTED = "swept_exhausted"  # the same, with no attempt left
    SWEPT_UNKNOWN = "swept_unknown"  # an expired attempt after dispatch authorization
    CANCELLED = "cancelled"  # an operator's cancel, queued or before dispatch authorization


class Warning(enum.Enum):
    """Which warning the run carries after a transition."""

    KEEP = "keep"  # unchanged
    CLEAR = "clear"
    UNRESOLVED = "unresolved"  # runs.unresolved_warning
    MISMATCH = "mismatch"
    ABSENT = "absent"


class Success(enum.Enum):
    """The facts a success must show before its checkpoint is written."""

    NONE = "none"
    ATOMIC = "atomic"
    FORWARD = "forward"


@dataclass(frozen=True)
class Transition:
    kinds: tuple[str, ...]  # the ledger entries it appends, in order, all under the attempt
    status: RunStatus | None  # None: unchanged
    recovery: RecoveryStatus | None
    terminal: bool  # ends the attempt
    checkpoint: bool  # writes a verified checkpoint (every terminal state but a requeue)
    releases_lease: bool  # the sweeper's transitions find the lease already closed
    warning: Warning = Warning.KEEP
    success: Success = Success.NONE


_T = Transition
TABLE: Mapping[Outcome, Transition] = MappingProxyType({
    Outcome.RECORDED: _T((evidence.RUN_RECORDED,), RunStatus.QUEUED, RecoveryStatus.RECORDED, False, False, False),
    Outcome.STARTED: _T((evidence.ATTEMPT_STARTED,), RunStatus.RUNNING, RecoveryStatus.LEASED, False, False, False),
    Outcome.DISPATCH_AUTHORIZED: _T(
        (evidence.DISPATCH_AUTHORIZED,), None, RecoveryStatus.DISPATCH_AUTHORIZED, False, False, False
    ),
    Outcome.RECONCILE_STARTED: _T((evidence.RECONCILE_STARTED,), None, None, False, False, False),
    Outcome.RESUME_AUTHORIZED: _T(
        (evidence.RESUME_STARTED, evidence.DISPATCH_AUTHORIZED), RunStatus.RUNNING,
        RecoveryStatus.DISPATCH_AUTHORIZED, False, False, False, Warning.CLEAR,
    ),
    Outcome.ATOMIC_SUCCEEDED: _T(
        (evidence.RESULT_COMMITTED, evidence.RUN_SUCCEEDED), RunStatus.SUCCEEDED, RecoveryStatus.VERIFIED,
        True, True, True, Warning.CLEAR, Success.ATOMIC,
    ),
    Outcome.PUBLISHED: _T(
        (evidence.PUBLICATION_CONFIRMED, evidence.RUN_SUCCEEDED), RunStatus.SUCCEEDED, RecoveryStatus.VERIFIED,
        True, True, True, Warning.CLEAR, Success.FORWARD,
    ),
    Outcome.RECONCILED_PRESENT: _T(
        (evidence.RECONCILE_PRESENT, evidence.RUN_SUCCEEDED), RunStatus.SUCCEEDED,
        RecoveryStatus.RECONCILED_PRESENT, True, True, True, Warning.CLEAR, Success.FORWARD,
    ),
    Outcome.FAILED_BEFORE_DISPATCH: _T(
        (evidence.RUN_FAILED,), RunStatus.FAILED, RecoveryStatus.NO_EXTERNAL_OUTPUT, True, True, True
    ),
    Outcome.REJECTED: _T(
        (evidence.PUBLICATION_REJECTED, evidence.RUN_FAILED), RunStatus.FAILED, RecoveryStatus.NO_EXTERNAL_OUTPUT,
        True, True, True,
    ),
    Outcome.PUBLICATION_MISMATCH: _T(
        (evidence.PUBLICATION_MISMATCH,), RunStatus.OUTCOME_UNKNOWN, RecoveryStatus.OUTCOME_UNKNOWN,
        True, True, True, Warning.MISMATCH,
    ),
    Outcome.RECONCILE_MISMATCH: _T(
        (evidence.RECONCILE_MISMATCH,), RunStatus.OUTCOME_UNKNOWN, RecoveryStatus.OUTCOME_UNKNOWN,
        True, True, True, Warning.MISMATCH,
    ),
    Outcome.PUBLICATION_UNKNOWN: _T(
        (evidence.PUBLICATION_UNKNOWN,), RunStatus.OUTCOME_UNKNOWN, RecoveryStatus.OUTCOME_UNKNOWN,
        True, True, True, Warning.UNRESOLVED,
    ),
    # Checkpointed only when the chain itself verifies (the failure may be of the facts, or of the chain).
    Outcome.EVIDENCE_FAILED: _T(
        (evidence.EVIDENCE_FAILED,), RunStatus.EVIDENCE_FAILED, RecoveryStatus.EVIDENCE_FAILED,
        True, True, True, Warning.UNRESOLVED,
    ),
    Outcome.RECONCILED_ABSENT: _T(
        (evidence.RECONCILE_ABSENT,), RunStatus.FAILED, RecoveryStatus.RECONCILED_ABSENT, True, True, True,
        Warning.ABSENT,
    ),
    Outcome.RECONCILE_UNDECIDED: _T((evidence.RECONCILE_UNDECIDED,), None, None, True, True, True),
    # The target is invalid by its recorded text alone (contract.InvalidTarget): nothing can exist there.
    Outcome.RECONCILED_INVALID_TARGET: _T(
        (evidence.RECONCILE_INVALID_TARGET, evidence.RUN_FAILED), RunStatus.FAILED,
        RecoveryStatus.NO_EXTERNAL_OUTPUT, True, True, True, Warning.CLEAR,
    ),
    Outcome.SWEPT_RECOVERED: _T(
        (evidence.ATTEMPT_RECOVERED,), RunStatus.QUEUED, RecoveryStatus.RECOVERED, True, False, False
    ),
    Outcome.SWEPT_EXHAUSTED: _T(
        (evidence.ATTEMPT_RECOVERED, evidence.RUN_FAILED), RunStatus.FAILED, RecoveryStatus.NO_EXTERNAL_OUTPUT,
        True, True, False,
    ),
    Outcome.SWEPT_UNKNOWN: _T(
        (evidence.ATTEMPT_OUTCOME_UNKNOWN,), RunStatus.OUTCOME_UNKNOWN, RecoveryStatus.OUTCOME_UNKNOWN,
        True, True, False, Warning.UNRESOLVED,
    ),
    # dataflow.protocol.cancel closes the lease itself, first: the attempt it ends is fenced off before the
    # ledger is read for an authorization, so none can commit after that read.
    Outcome.CANCELLED: _T(
        (evidence.RUN_CANCELLED,), RunStatus.CANCELLED, RecoveryStatus.NO_EXTERNAL_OUTPUT, True, True, False,
        Warning.CLEAR,
    ),
})  # fmt: skip
# Longest first, so that derive() reads (attempt.recovered, run.failed) as one exhausted sweep.
_BY_LENGTH = sorted(TABLE.items(), key=lambda item: -len(item[1].kinds))


def warning_text(kind: Warning, run: Run, payloads: Sequence[Mapping[str, Any]]) -> str | None:
    """The warning a run carries after a transition (``run`` already holds the new projection)."""
    if kind == Warning.UNRESOLVED:
        return runs.unresolved_warning(run)
    if kind == Warning.MISMATCH:
        return (
            "UNRESOLVED: the sink holds a publication under idempotency key "
            f"{run.publication_idempotency_key} whose digest {payloads[0].get('digest')} differs from the recorded "
            f"output digest {run.output_digest}. External output exists but is not this run's result; "
            "investigate the sink before acting. Nothing was re-published."
        )
    if kind == Warning.ABSENT:
        return (
            f"No external output: the sink proved key {run.publication_idempotency_key} absent and fenced it at "
            f"attempt {payloads[0].get('fenced_at')}, so no earlier attempt can publish. Resume to publish the "
            f"stored result: `dataflow reconcile {run.run_id} --resume`."
        )
    return None


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
    stored_result: bytes | memoryview | None = None,
) -> Run:
    """Write one transition in the caller's transaction: append → checkpoint → projection → release.

    ``projection`` adds the transition's own columns (digests, refs, error code and message). A
    checkpoint that does not verify raises EvidenceError before the projection is written, so the
    caller's transaction carries nothing of this transition. The projection is written only while
    the row names ``row_attempt`` (default: ``attempt``; a transition that starts an attempt names
    the one it follows). ``held`` is the chain the caller's fence statement read
    (``fencing.fenced_chain``): appended to and verified without reading it again; ``stored_result``
    the result bytes the caller's transaction stored, verified as written.
    """
    transition = TABLE[outcome]
    appended = ledger.append_many(
        conn, db, MODULE, run.run_id, items(outcome, attempt, payloads),
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
    if transition.checkpoint:
        after = run.model_copy(update={**values, "attempt": attempt})
        written = (results.STORED_FORMAT, stored_result) if stored_result is not None else None
        _checkpoint(conn, db, after, attempt, outcome, transition, evidence_key, held, written)
    guard = attempt if row_attempt is None else row_attempt
    final = runs.update(conn, db, run.run_id, expected_attempt=guard, **values)
    if transition.releases_lease:
        leases.release(conn, db, MODULE, run.run_id, attempt)
    return final


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
) -> None:
    """A verified checkpoint of the state this transition projects (``after``): the chain verifies,
    the ledger implies exactly that state, and a success shows its facts (digest, evidence, bytes)."""

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
            return
    checkpoints.write_verified(
        conn, db, MODULE, after.run_id, attempt, str(after.status), checkpoint_facts(after),
        evidence_key=evidence_key, facts_check=facts, held=held,
    )  # fmt: skip


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


# ---- the table read backwards -------------------------------------------------------------------


@dataclass(frozen=True)
class Derived:
    """The projection a ledger implies; ``problem`` names the first entry that follows no transition."""

    values: Mapping[str, Any]
    problem: str = ""
    problem_seq: int | None = None


# The projection columns the ledger determines, compared by ``dataflow verify``.
DERIVED_FIELDS = (
    "status", "recovery_status", "attempt", "output_digest", "row_count", "source_fingerprint_digest",
    "publication_idempotency_key", "publication_idempotency_digest",
    "publication_ref", "datasource_ref", "materialization_ref",
)  # fmt: skip
_DIGEST_FIELDS = ("output_digest", "source_fingerprint_digest")
_DIGITS = re.compile(r"[0-9]+")
# The run's identity as run.recorded holds it: a row edited to another tenant, key or hash would make
# the platform publish, inspect or fence under another publication key.
IDENTITY_FIELDS = (
    "run_id", "tenant", "idempotency_key", "definition_hash", "request_hash", "mode", "max_attempts", "principal",
)  # fmt: skip
_REF_FIELDS = ("publication_ref", "datasource_ref", "materialization_ref")


def derive(entries: Sequence[ledger.Entry]) -> Derived:
    """Fold the entries through :data:`TABLE`: the state a chain implies, or where it stops making sense."""
    values: dict[str, Any] = dict.fromkeys(DERIVED_FIELDS)
    authorized = cancelled = False
    i = 0
    while i < len(entries):
        match = _match(entries, i)
        if match is None:
            entry = entries[i]
            return Derived(values, f"entry {entry.seq} ({entry.kind}) follows no transition of the protocol", entry.seq)
        outcome, transition = match
        group = entries[i : i + len(transition.kinds)]
        if outcome == Outcome.CANCELLED and authorized:  # a publication may exist: only reconcile settles it
            return Derived(values, f"entry {group[0].seq} cancels a run whose dispatch was authorized", group[0].seq)
        if cancelled:  # cancelled is final: nothing of any attempt may follow it
            return Derived(values, f"entry {group[0].seq} ({group[0].kind}) follows the cancellation", group[0].seq)
        problem = _fold(values, outcome, transition, group)
        if problem:
            return Derived(values, problem, group[0].seq)
        authorized = authorized or evidence.DISPATCH_AUTHORIZED in transition.kinds
        cancelled = outcome == Outcome.CANCELLED
        i += len(transition.kinds)
    return Derived(values)


def _match(entries: Sequence[ledger.Entry], i: int) -> tuple[Outcome, Transition] | None:
    for outcome, transition in _BY_LENGTH:
        group = entries[i : i + len(transition.kinds)]
        if tuple(e.kind for e in group) == transition.kinds and len({e.attempt for e in group}) == 1:
            return outcome, transition
    return None


def _text(payload: Mapping[str, Any], name: str) -> str | None:
    value = payload.get(name) if isinstance(payload, Mapping) else None
    return value if isinstance(value, str) else None


def _fold(values: dict[str, Any], outcome: Outcome, transition: Transition, group: Sequence[ledger.Entry]) -> str:
    first = group[0]
    if outcome == Outcome.RECORDED:
        if first.seq != 1 or values["status"] is not None:
            return f"entry {first.seq} records the run again"
    elif values["status"] is None:
        return f"entry {first.seq} ({first.kind}) comes before run.recorded"
    values["attempt"] = first.attempt
    if transition.status is not None:
        values["status"] = str(transition.status)
    if transition.recovery is not None:
        values["recovery_status"] = str(transition.recovery)
    for entry in group:
        if entry.kind in (evidence.RESULT_COMMITTED, evidence.DISPATCH_AUTHORIZED):
            for name in _DIGEST_FIELDS:
                values[name] = _text(entry.payload, name)
            row_count = _text(entry.payload, "row_count")
            digits = row_count is not None and _DIGITS.fullmatch(row_count) is not None
            values["row_count"] = int(row_count) if digits and row_count is not None else row_count
        if entry.kind == evidence.DISPATCH_AUTHORIZED:
            values["publication_idempotency_key"] = _text(entry.payload, "publication_idempotency_key")
            values["publication_idempotency_digest"] = _text(entry.payload, "publication_idempotency_digest")
        if entry.kind in (
            evidence.PUBLICATION_CONFIRMED, evidence.RECONCILE_PRESENT,
            evidence.PUBLICATION_MISMATCH, evidence.RECONCILE_MISMATCH,
        ):  # fmt: skip
            for name in _REF_FIELDS:
                values[name] = _text(entry.payload, name)
    return ""


def projection_problem(entries: Sequence[ledger.Entry], run: Run) -> str:
    """The empty string when the run projection equals what the entries imply, else the first difference:
    the state columns (derive), the identity run.recorded holds, the workspace it was recorded with, and
    the target every dispatch authorization was given."""
    derived = derive(entries)
    if derived.problem:
        return derived.problem
    recorded = entries[0].payload
    for name in IDENTITY_FIELDS:
        if name not in recorded:
            continue  # an older version did not record it
        projected = getattr(run, name, None)
        projected = str(projected) if name == "mode" and projected is not None else projected
        if recorded.get(name) != projected:
            return f"the run projection says {name}={projected!r} but run.recorded holds {recorded.get(name)!r}"
    if "workspace_digest" in recorded and recorded["workspace_digest"] != workspace_digest(run.workspace):
        return "the run projection's workspace is not the one run.recorded holds"
    for entry in entries:
        if entry.kind == evidence.DISPATCH_AUTHORIZED and entry.payload.get("target") != run.target:
            return f"the run projection's target is not the one authorized at entry {entry.seq}"
    for name in DERIVED_FIELDS:
        implied, projected = derived.values[name], getattr(run, name, None)
        if name in ("status", "recovery_status") and projected is not None:
            projected = str(projected)
        if implied != projected:
            return f"the run projection says {name}={projected!r} but its ledger implies {implied!r}"
    return ""


def workspace_digest(space: Mapping[str, Any] | None) -> str | None:
    """The digest of a run's recorded workspace (its roots and rules), as run.recorded holds it."""
    return hashing.digest(dict(space)) if space is not None else None


def verify_run(
    conn: Connection, run: Run, key: Secret | None, *, checks: evidence.ResultChecks | None = None
) -> ledger.Verification:
    """``dataflow verify``: the chain against the latest checkpoint, the facts of the run's state
    (success: digest, evidence and stored bytes), and the projection against what the ledger implies.
    Every failure is a Verification naming the seq, never an exception. ``checks``: the stored bytes
    are recomputed through it (cached per ledger head, a few at a time; VerificationBusy when none
    frees in time); without it, read and digested here."""

    def facts(entries: Sequence[ledger.Entry]) -> str:
        problem = projection_problem(entries, run)
        if problem or run.status != RunStatus.SUCCEEDED:
            return problem
        try:
            if checks is None:
                digest = evidence.stored_result_digest(conn, run.run_id)
            else:
                digest = checks.digest(conn, run.run_id, entries[-1])
        except EvidenceError as error:
            return error.message
        if run.mode == Mode.ATOMIC:
            return evidence.atomic_success_problem(entries, run.attempt, digest)
        return evidence.forward_success_problem(entries, run.attempt, digest)

    result = checkpoints.verify_subject(conn, MODULE, run.run_id, evidence_key=key, facts_check=facts)
    if result.ok or result.broken_seq is not None or result.reason == ledger.KEYED_UNCHECKED_REASON:
        return result  # unchecked MACs are about the whole chain, not an entry: no seq to name
    # A facts problem: name the entry it is about (or the head).
    seq = derive(ledger.read(conn, MODULE, run.run_id)).problem_seq or result.head_seq
    return ledger.Verification(False, result.head_seq, result.head_hash, result.entry_count, result.keyed, seq,
                               result.reason)  # fmt: skip


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
INTERRUPTED = "interrupted"  # run.cancelled's reason when the attempt's own process was told to stop


def record(
    conn: Connection, db: Database, row: Mapping[str, Any], lease: leases.Lease | None, *, evidence_key: Secret | None
) -> Run:
    """RECORDED: the run's row and ``run.recorded``; inline (``lease``, attempt 1's), STARTED too, with
    the row inserted already holding what STARTED projects, so it is written once."""
    values = dict(row)
    entries = items(Outcome.RECORDED, 0, [_recorded_payload(row)])
    if lease is not None:
        started = TABLE[Outcome.STARTED]
        values.update(attempt=lease.attempt, status=started.status, recovery_status=started.recovery)
        entries += items(Outcome.STARTED, lease.attempt, [{"holder": lease.holder}])
    run = runs.insert(conn, db, values)
    ledger.append_many(
        conn, db, MODULE, run.run_id, entries, evidence_key=evidence_key, new_subject_at_us=run.created_at_us
    )
    return run


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
    """STARTED: ``attempt.started`` under the lease just taken (a claim), and the row projected running."""
    ledger.append_many(
        conn, db, MODULE, run_id, items(Outcome.STARTED, lease.attempt, [{"holder": lease.holder}]),
        evidence_key=evidence_key,
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
    held: ledger.HeldChain,
) -> Run:  # fmt: skip
    """DISPATCH_AUTHORIZED, in the caller's fenced pre-dispatch commit (which stored ``result``): the
    result's facts, the publication key and its digest, the target, the prepared location (its place's
    digest and identity) and the partition token this commit took, when there are any."""
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
        held=held, stored_result=result.ipc_bytes,
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
    """ATOMIC_SUCCEEDED, in the caller's fenced terminal commit (which stored ``result``)."""
    return apply(
        conn, db, run, attempt, Outcome.ATOMIC_SUCCEEDED,
        [results.facts(result), {"output_digest": result.output_digest}],
        evidence_key=evidence_key, projection=_result_projection(result), held=held, stored_result=result.ipc_bytes,
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
    """RECONCILED_ABSENT: the sink proved the key absent and fenced it at ``fenced_at``."""
    return terminate(db, run, attempt, Outcome.RECONCILED_ABSENT, [{"fenced_at": fenced_at}], evidence_key=evidence_key)


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
        exhausted = f"all {run.max_attempts} attempts expired before dispatch authorization"
        payloads.append({"code": "attempts_exhausted", "message": exhausted, "no_external_output": True})
        projection = {"error_code": "attempts_exhausted", "error_message": exhausted}
    elif authorized:
        projection = {
            "error_code": "inconclusive", "error_message": "the worker's lease expired after dispatch authorization",
        }  # fmt: skip
    return apply(conn, db, run, attempt, outcome, payloads, evidence_key=evidence_key, projection=projection)
