"""Reconciliation (DESIGN §6): settle an unresolved run by inspecting the sink, never by guessing.

Take a new fenced attempt *m*, inspect the sink by the stable key *with fence m*, and compare the
recorded output digest:
- present, digest matches -> ``reconciled_present``: refs, success and checkpoint commit together;
- present, another digest -> stays unresolved, with a warning that says so;
- conclusively absent (and fenced at >= m) -> ``reconciled_absent``; a resume may then re-dispatch
  the *stored* result under a newer attempt with the *same* key;
- undecided -> unchanged.
There is no path that marks a run absent without a conclusive, fenced inspection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import fencing, leases, ledger
from durable_dataflow.core.errors import Conflict, DataflowError
from durable_dataflow.dataflow import crashpoints, evidence, forward, runs
from durable_dataflow.dataflow.requests import AccessContext, Provenance
from durable_dataflow.dataflow.runs import MODULE, Mode, RecoveryStatus, Run, RunStatus
from durable_dataflow.dataflow.service import RunService
from durable_dataflow.datasources.contract import Absent, InspectOutcome, Present, Undecided


@dataclass(frozen=True)
class Reconciliation:
    run: Run
    finding: str  # "present" | "mismatch" | "absent" | "undecided"
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
    asked_by = _asked_by(access, provenance)
    if run.mode != Mode.FORWARD_RECOVERY or run.publication_idempotency_key is None:
        raise Conflict(f"run {run_id} never authorized a publication: there is nothing at a sink to reconcile")
    if run.recovery_status == RecoveryStatus.RECONCILED_ABSENT:
        if not resume:
            return Reconciliation(run, "absent", "already reconciled: absent; pass --resume to publish it")
        return _resume(service, run, asked_by)
    if run.status != RunStatus.OUTCOME_UNKNOWN:
        raise Conflict(
            f"run {run_id} is {run.status} ({run.recovery_status}), not outcome_unknown: nothing to reconcile"
        )
    provider = forward.load_capable_provider(run)
    attempt = _take_lease(service, run, evidence.RECONCILE_STARTED, asked_by)
    try:
        target = forward.publish_target(run, service.run_workspace(run)[1])
        finding = provider.inspect(forward.publication_key(run), target, fence=attempt)
    except Exception as error:  # an inspection that fails decides nothing
        # Its text is not ours to repeat: library and OS messages quote absolute paths and values.
        finding = Undecided(
            f"preparing the run's target or inspecting the sink failed ({type(error).__name__}): nothing was proven"
        )
    result = _apply(service, run, attempt, finding)
    if resume and result.finding == "absent":
        return _resume(service, service.get(run_id), asked_by)
    return result


def _asked_by(access: AccessContext, provenance: Provenance) -> dict[str, Any]:
    """Who asked for an operator's attempt, in the fields ``run.recorded`` uses for a submit: never a credential."""
    return {
        "provenance": provenance.as_json(),
        "principal": access.principal,
        "access_context_digest": access.digest(),
    }


def _take_lease(
    service: RunService, run: Run, kind: str, asked_by: Mapping[str, Any], *, redispatch: bool = False
) -> int:
    """A new fenced attempt for an operator action; with ``redispatch`` it is authorized at once to
    re-dispatch the stored result under the original authorization's digests and key."""
    db = service.db
    with db.begin() as conn:
        lease = leases.acquire(
            conn, db, MODULE, run.run_id, service.config.holder, service.config.lease_ttl_s,
            expected_attempt=run.attempt,
        )  # fmt: skip
        items: list[tuple[int, str, Mapping[str, Any]]] = [(lease.attempt, kind, {"holder": lease.holder, **asked_by})]
        projection: dict[str, Any] = {"attempt": lease.attempt}
        if redispatch:
            items.append((lease.attempt, evidence.DISPATCH_AUTHORIZED, _authorization_of(conn, run)))
            projection.update(
                status=RunStatus.RUNNING, recovery_status=RecoveryStatus.DISPATCH_AUTHORIZED, warning=None
            )
        service._append_many(conn, run.run_id, items)
        runs.update(conn, run.run_id, db.now_us_expr(), **projection)
    return lease.attempt


def _apply(service: RunService, run: Run, attempt: int, finding: InspectOutcome) -> Reconciliation:
    recorded = str(run.output_digest)
    if isinstance(finding, Present) and finding.digest == recorded:
        forward.commit_success(service, run, attempt, evidence.RECONCILE_PRESENT, finding, "present")
        return Reconciliation(service.get(run.run_id), "present", f"found with the recorded digest {recorded}")
    if isinstance(finding, Present):
        forward.mismatch(service, run, attempt, evidence.RECONCILE_MISMATCH, finding)
        return Reconciliation(service.get(run.run_id), "mismatch", f"found with another digest {finding.digest}")
    if isinstance(finding, Absent) and finding.fenced_at is not None and finding.fenced_at >= attempt:
        _record_absent(service, run, attempt, finding.fenced_at)
        return Reconciliation(service.get(run.run_id), "absent", f"proven absent and fenced at {finding.fenced_at}")
    reason = finding.reason if isinstance(finding, Undecided) else "the sink reported absence without a durable fence"
    _record_undecided(service, run, attempt, reason)
    return Reconciliation(service.get(run.run_id), "undecided", reason)


def _record_absent(service: RunService, run: Run, attempt: int, fenced_at: int) -> None:
    db = service.db
    with fencing.fenced(db, MODULE, run.run_id, attempt) as conn:
        service._append(conn, run.run_id, attempt, evidence.RECONCILE_ABSENT, {"fenced_at": fenced_at})
        warning = (
            f"No external output: the sink proved key {run.publication_idempotency_key} absent and fenced it at "
            f"attempt {fenced_at}, so no earlier attempt can publish. Resume to publish the stored result: "
            f"`dataflow reconcile {run.run_id} --resume`."
        )
        runs.update(
            conn, run.run_id, db.now_us_expr(), status=RunStatus.FAILED,
            recovery_status=RecoveryStatus.RECONCILED_ABSENT, warning=warning,
        )  # fmt: skip
        leases.release(conn, db, MODULE, run.run_id, attempt)


def _record_undecided(service: RunService, run: Run, attempt: int, reason: str) -> None:
    db = service.db
    with fencing.fenced(db, MODULE, run.run_id, attempt) as conn:
        service._append(conn, run.run_id, attempt, evidence.RECONCILE_UNDECIDED, {"reason": reason[:1000]})
        leases.release(conn, db, MODULE, run.run_id, attempt)


def _resume(service: RunService, run: Run, asked_by: Mapping[str, Any]) -> Reconciliation:
    """Re-dispatch the stored result with the same key under a new fenced attempt."""
    provider = forward.load_capable_provider(run)
    attempt = _take_lease(service, run, evidence.RESUME_STARTED, asked_by, redispatch=True)
    crashpoints.reach(crashpoints.AFTER_PREDISPATCH_COMMIT)
    with contextlib.suppress(DataflowError):  # the lease then expires; the sweeper records outcome_unknown
        forward.dispatch(service, run, attempt, provider)
    final = service.get(run.run_id)
    return Reconciliation(final, "absent", f"resumed under attempt {attempt}: {final.status}", resumed=True)


def _authorization_of(conn: Connection, run: Run) -> dict[str, object]:
    """The original authorization's facts: the same digests and key, never recomputed."""
    entries = ledger.read(conn, MODULE, run.run_id)
    original = next(e for e in entries if e.kind == evidence.DISPATCH_AUTHORIZED)
    return dict(original.payload)
