"""Reconciliation (DESIGN §6): settle an unresolved run by inspecting the sink, never by guessing.

Take a new fenced attempt *m*, inspect the sink by the stable key *with fence m*, and compare the
recorded output digest:
- present, digest matches -> ``reconciled_present``: refs, success and checkpoint commit together;
- present, another digest -> stays unresolved, with a warning that says so;
- conclusively absent (and fenced at >= m) -> ``reconciled_absent``; a resume may then re-dispatch
  the *stored* result under a newer attempt with the *same* key;
- undecided -> unchanged; so is a run whose datasource's recorded location is missing now or holds
  another table or folder (``forward.check_location``): that one is not even inspected.
There is no path that marks a run absent without a conclusive, fenced inspection.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import crashpoints, ledger
from durable_dataflow.core.errors import Conflict, DataflowError, EvidenceError, StaleAttempt
from durable_dataflow.dataflow.protocol import attempt as attempts
from durable_dataflow.dataflow.protocol import derivation, evidence, forward, requests, sweeper, transitions
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.protocol.service import RunService
from durable_dataflow.dataflow.protocol.transitions import Outcome
from durable_dataflow.datasources import contract, registry
from durable_dataflow.datasources.contract import Absent, InspectOutcome, Present, Provider, Undecided

RECONCILABLE = frozenset({RunStatus.OUTCOME_UNKNOWN, RunStatus.EVIDENCE_FAILED})
UNDECIDED_REASON_CHARS_MAX = 1000


class Finding(enum.StrEnum):
    """What an inspection (or a resume) concluded."""

    PRESENT = "present"
    MISMATCH = "mismatch"
    ABSENT = "absent"
    UNDECIDED = "undecided"
    INVALID_TARGET = "invalid_target"  # no publish could ever have written to the target


@dataclass(frozen=True)
class Reconciliation:
    run: Run
    finding: Finding
    detail: str
    resumed: bool = False


def reconcile(
    service: RunService,
    run_id: str,
    *,
    access: AccessContext,
    provenance: Provenance,
    tenant: str | None = None,
    resume: bool = False,
) -> Reconciliation:
    """Inspect the sink for an ``outcome_unknown`` run (or resume a ``reconciled_absent`` one).

    ``access`` and ``provenance`` are who asked and how: each attempt this starts records them in its
    start entry, as ``run.recorded`` does for a submit, so an operator's dispatch names its operator."""
    run = service.get(run_id, tenant)
    asked_by = requests.asked_by(access, provenance)
    if run.mode != Mode.FORWARD_RECOVERY or run.publication_idempotency_key is None:
        raise Conflict(f"run {run_id} never authorized a publication: there is nothing at a sink to reconcile")
    if run.status == RunStatus.RUNNING and run.recovery_status == RecoveryStatus.DISPATCH_AUTHORIZED:
        # An authorized attempt whose lease expired with nobody sweeping (the embedded default):
        # decide it first, which makes it outcome_unknown. A live attempt is left alone (nothing is
        # written), and the run, still running, has nothing to reconcile yet.
        sweeper.sweep_run(service.db, run.run_id, evidence_key=service.evidence_key)
        run = service.get(run_id, tenant)
    problem = _evidence_problem(service, run)
    if problem:
        # Nothing is inspected, fenced or published on evidence that does not verify: a row edited to
        # another tenant or target would otherwise be settled, or published, under another key.
        return _unverified(service, run, asked_by, problem)
    if run.recovery_status == RecoveryStatus.RECONCILED_ABSENT:
        if not resume:
            return Reconciliation(run, Finding.ABSENT, "already reconciled: absent; pass --resume to publish it")
        return _resume(service, run, asked_by)
    if run.status not in RECONCILABLE:
        raise Conflict(
            f"run {run_id} is {run.status} ({run.recovery_status}), not outcome_unknown or evidence_failed: "
            "nothing to reconcile"
        )
    provider = forward.load_capable_provider(run)
    attempt = _take_lease(service, run, Outcome.RECONCILE_STARTED, asked_by)
    refusal = _structural_refusal(service, run, provider)
    if refusal is not None:
        return _invalid_target(service, run.model_copy(update={"attempt": attempt}), attempt, refusal)
    try:
        target = forward.publish_target(run, service.run_workspace(run)[1])
        # A recorded location that is missing or replaced is never inspected: a new, empty one proves nothing.
        with service.db.read() as conn:
            authorized = forward.authorized_location(conn, run)
        _, recorded = forward.check_location(service.db, run, provider, target, authorized)
        if authorized is None and recorded is not None:
            # Authorized before locations were recorded: the one recorded here since may have been created anew.
            name = str((run.target or {}).get("datasource"))
            raise contract.LocationGone(registry.LOCATION_RECORDED_LATER.format(name=name, run=recorded.created_by_run))
        finding = provider.inspect(forward.publication_key(run), target, fence=attempt)
        with service.db.read() as conn:  # "cannot see it" told apart from "never registered"
            finding = registry.explain_undecided(conn, run.tenant, run.target, finding)
    except contract.LocationGone as error:
        finding = Undecided(error.message)
    except Exception as error:  # an inspection that fails decides nothing
        # Its text is not ours to repeat: library and OS messages quote absolute paths and values.
        finding = Undecided(
            f"preparing the run's target or inspecting the sink failed ({type(error).__name__}): nothing was proven"
        )
    crashpoints.reach(crashpoints.AFTER_INSPECT)
    result = _apply(service, run.model_copy(update={"attempt": attempt}), attempt, finding)
    if resume and result.finding == Finding.ABSENT:
        return _resume(service, service.get(run_id), asked_by)
    return result


def _evidence_problem(service: RunService, run: Run) -> str:
    """Why the run's chain, facts or projection do not verify (derivation.verify_run), or ""."""
    with service.db.read() as conn:
        verification = derivation.verify_run(conn, run, service.evidence_key)
    if verification.ok:
        return ""
    where = f" at seq {verification.broken_seq}" if verification.broken_seq is not None else ""
    return f"the run's evidence does not verify{where}: {verification.reason}"


def _unverified(service: RunService, run: Run, asked_by: Mapping[str, Any], problem: str) -> Reconciliation:
    """Refuse to act on unverified evidence; a run not yet evidence_failed becomes so, under a lease."""
    detail = f"{problem}; nothing was inspected or published"
    if run.status == RunStatus.EVIDENCE_FAILED:
        return Reconciliation(run, Finding.UNDECIDED, detail)
    attempt = _take_lease(service, run, Outcome.RECONCILE_STARTED, asked_by)
    service.record_evidence_failure(run.model_copy(update={"attempt": attempt}), attempt, problem)
    return Reconciliation(service.get(run.run_id), Finding.UNDECIDED, detail)


def _take_lease(service: RunService, run: Run, outcome: Outcome, asked_by: Mapping[str, Any]) -> int:
    """A new fenced attempt for an operator action: RECONCILE_STARTED to inspect, or
    RESUME_AUTHORIZED to re-dispatch the stored result under the original authorization's digests
    and key (never recomputed)."""
    db = service.db
    with db.begin() as conn:
        lease = attempts.take_lease(conn, db, service.holder_lock, service.config, run.run_id, run.attempt)
        if outcome == Outcome.RESUME_AUTHORIZED:
            authorization = _authorization_of(conn, run)
            transitions.authorize_resume(
                conn, db, run, lease, asked_by, authorization, evidence_key=service.evidence_key
            )
        else:
            transitions.start_reconcile(conn, db, run, lease, asked_by, evidence_key=service.evidence_key)
    return lease.attempt


def _apply(service: RunService, run: Run, attempt: int, finding: InspectOutcome) -> Reconciliation:
    """Record what the inspection found; evidence that does not verify ends it ``evidence_failed``."""
    try:
        return _record(service, run, attempt, finding)
    except EvidenceError as error:
        service.record_evidence_failure(run, attempt, error.message)
    except StaleAttempt:
        pass  # the inspection's lease was lost: the sweeper returns the run to outcome_unknown
    final = service.get(run.run_id)
    return Reconciliation(final, Finding.UNDECIDED, f"nothing was recorded: the run is {final.status}")


def _record(service: RunService, run: Run, attempt: int, finding: InspectOutcome) -> Reconciliation:
    recorded = str(run.output_digest)
    if isinstance(finding, Present) and finding.digest == recorded:
        transitions.succeed_publication(
            service.db, run, attempt, Outcome.RECONCILED_PRESENT, finding, "present", evidence_key=service.evidence_key
        )
        return Reconciliation(service.get(run.run_id), Finding.PRESENT, f"found with the recorded digest {recorded}")
    if isinstance(finding, Present):
        transitions.record_mismatch(
            service.db, run, attempt, Outcome.RECONCILE_MISMATCH, finding, evidence_key=service.evidence_key
        )
        detail = f"found with another digest {finding.digest}"
        return Reconciliation(service.get(run.run_id), Finding.MISMATCH, detail)
    if isinstance(finding, Absent) and finding.fenced_at is not None and finding.fenced_at >= attempt:
        transitions.reconciled_absent(service.db, run, attempt, finding.fenced_at, evidence_key=service.evidence_key)
        detail = f"proven absent and fenced at {finding.fenced_at}"
        return Reconciliation(service.get(run.run_id), Finding.ABSENT, detail)
    reason = finding.reason if isinstance(finding, Undecided) else "the sink reported absence without a durable fence"
    transitions.reconcile_undecided(
        service.db, run, attempt, reason[:UNDECIDED_REASON_CHARS_MAX], evidence_key=service.evidence_key
    )
    return Reconciliation(service.get(run.run_id), Finding.UNDECIDED, reason)


def _structural_refusal(service: RunService, run: Run, provider: Provider) -> str | None:
    try:
        return contract.structural_refusal(provider, forward.publish_target(run, service.run_workspace(run)[1]))
    except Exception:  # a target that cannot even be built proves nothing
        return None


def _invalid_target(service: RunService, run: Run, attempt: int, refusal: str) -> Reconciliation:
    """The target is invalid by its recorded text (contract.InvalidTarget): every publish of it was
    refused before touching the sink, so nothing can exist there; the run failed with no output."""
    message = f"the target can never have been published to: {refusal}"
    try:
        transitions.reconciled_invalid_target(
            service.db, run, attempt, refusal, message, evidence_key=service.evidence_key
        )
    except EvidenceError as error:
        service.record_evidence_failure(run, attempt, error.message)
    except StaleAttempt:
        pass
    return Reconciliation(service.get(run.run_id), Finding.INVALID_TARGET, message)


def _resume(service: RunService, run: Run, asked_by: Mapping[str, Any]) -> Reconciliation:
    """Re-dispatch the stored result with the same key under a new fenced attempt."""
    provider = forward.load_capable_provider(run)
    attempt = _take_lease(service, run, Outcome.RESUME_AUTHORIZED, asked_by)
    crashpoints.reach(crashpoints.AFTER_PREDISPATCH_COMMIT)
    with contextlib.suppress(DataflowError):  # the lease then expires; the sweeper records outcome_unknown
        target = forward.publish_target(run, service.run_workspace(run)[1])
        forward.dispatch(service.db, run, attempt, provider, target, evidence_key=service.evidence_key)
    final = service.get(run.run_id)
    return Reconciliation(final, Finding.ABSENT, f"resumed under attempt {attempt}: {final.status}", resumed=True)


def _authorization_of(conn: Connection, run: Run) -> dict[str, object]:
    """The original authorization's facts: the same digests and key, never recomputed."""
    entries = ledger.read(conn, MODULE, run.run_id)
    original = next(e for e in entries if e.kind == evidence.DISPATCH_AUTHORIZED)
    return dict(original.payload)
