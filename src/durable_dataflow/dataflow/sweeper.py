"""The recovery sweeper's Dataflow rules (DESIGN §6), safe when many workers sweep at once.

For each expired lease of a dataflow run:
- no ``dispatch.authorized`` for that attempt: the attempt is proven absent -> ``attempt.recovered``;
  the run is queued again under the next attempt, or failed once ``max_attempts`` is spent;
- ``dispatch.authorized`` for that attempt and no terminal entry: ``outcome_unknown``, never retried.
Exactly one sweeper decides each expired attempt: :func:`core.leases.close_expired` is a guarded
update and the decision commits in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

from durable_dataflow.core import leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow import evidence, runs
from durable_dataflow.dataflow.runs import MODULE, RecoveryStatus, RunStatus

SWEEP_BATCH_MAX = 100


@dataclass(frozen=True)
class SweepDecision:
    run_id: str
    attempt: int
    decision: str  # "recovered" | "failed" | "outcome_unknown" | "skipped"


def decide(entries: list[ledger.Entry], attempt: int, max_attempts: int) -> str:
    """Pure decision for one expired attempt, from its ledger.

    Any dispatch authorization in the run's history forbids a retry, not only this attempt's: an
    expired reconcile or resume attempt of an unresolved run returns it to ``outcome_unknown``.
    """
    if any(e.kind == evidence.DISPATCH_AUTHORIZED for e in entries):
        return "outcome_unknown"
    return "recovered" if attempt < max_attempts else "failed"


def sweep(db: Database, *, evidence_key: Secret | None = None, batch: int = SWEEP_BATCH_MAX) -> list[SweepDecision]:
    """Decide every expired dataflow attempt found now (bounded by ``batch``)."""
    with db.read() as conn:
        expired = leases.list_expired(conn, db, MODULE, limit=batch)
    return [_sweep_one(db, lease, evidence_key) for lease in expired]


def _sweep_one(db: Database, lease: leases.ExpiredLease, key: Secret | None) -> SweepDecision:
    run_id, attempt = lease.subject_id, lease.attempt
    with db.begin() as conn:
        if not leases.close_expired(conn, db, MODULE, run_id, attempt):
            return SweepDecision(run_id, attempt, "skipped")  # another sweeper or a heartbeat won
        run = runs.get(conn, run_id)
        entries = ledger.read(conn, MODULE, run_id)
        decision = decide(entries, attempt, run.max_attempts)
        now = db.now_us_expr()
        if decision == "outcome_unknown":
            ledger.append(
                conn,
                db,
                MODULE,
                run_id,
                attempt,
                evidence.ATTEMPT_OUTCOME_UNKNOWN,
                {"reason": "the attempt's lease expired after dispatch authorization"},
                evidence_key=key,
            )
            unknown = run.model_copy(update={"recovery_status": RecoveryStatus.OUTCOME_UNKNOWN})
            runs.update(
                conn,
                run_id,
                now,
                status=RunStatus.OUTCOME_UNKNOWN,
                recovery_status=RecoveryStatus.OUTCOME_UNKNOWN,
                warning=runs.unresolved_warning(unknown),
                error_code="inconclusive",
                error_message="the worker's lease expired after dispatch authorization",
            )
        else:
            ledger.append(
                conn,
                db,
                MODULE,
                run_id,
                attempt,
                evidence.ATTEMPT_RECOVERED,
                {"reason": "lease expired before dispatch authorization: proven absent"},
                evidence_key=key,
            )
            if decision == "recovered":
                runs.update(conn, run_id, now, status=RunStatus.QUEUED, recovery_status=RecoveryStatus.RECOVERED)
            else:
                message = f"all {run.max_attempts} attempts expired before dispatch authorization"
                ledger.append(
                    conn,
                    db,
                    MODULE,
                    run_id,
                    attempt,
                    evidence.RUN_FAILED,
                    {"code": "attempts_exhausted", "message": message, "no_external_output": True},
                    evidence_key=key,
                )
                runs.update(
                    conn,
                    run_id,
                    now,
                    status=RunStatus.FAILED,
                    recovery_status=RecoveryStatus.NO_EXTERNAL_OUTPUT,
                    error_code="attempts_exhausted",
                    error_message=message,
                )
    return SweepDecision(run_id, attempt, decision)
