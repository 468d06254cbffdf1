"""The recovery sweeper's Dataflow rules (DESIGN §6), safe when many workers sweep at once.

For each expired lease of a dataflow run, and each live one whose holder process is gone
(PostgreSQL: its session, and with it its advisory lock, ended; core/holders.py), decided alike:
- no ``dispatch.authorized`` for that attempt: the attempt is proven absent -> ``attempt.recovered``;
  the run is queued again under the next attempt, or failed once ``max_attempts`` is spent;
- ``dispatch.authorized`` for that attempt and no terminal entry: ``outcome_unknown``, never retried.
Exactly one sweeper decides each such attempt: :func:`core.leases.close_expired` (or
``close_dead_holder``) is a guarded update and the decision commits in the same transaction, through
:func:`transitions.swept`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import structlog
from sqlalchemy.engine import Connection

from durable_dataflow.core import leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import DataflowError, EvidenceError, StorageUnavailable
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.protocol import evidence, runs, transitions
from durable_dataflow.dataflow.protocol.runs import MODULE
from durable_dataflow.dataflow.protocol.transitions import Outcome

SWEEP_BATCH_MAX = 100
_log = structlog.get_logger("dataflow.sweeper")


class Decision(enum.StrEnum):
    RECOVERED = "recovered"  # proven absent, queued again
    FAILED = "failed"  # proven absent, no attempt left
    OUTCOME_UNKNOWN = "outcome_unknown"  # expired after dispatch authorization
    EVIDENCE_FAILED = "evidence_failed"  # the decision's evidence did not verify
    ERROR = "error"  # the decision could not be written (logged); the next sweep tries again
    SKIPPED = "skipped"  # another sweeper or a heartbeat won


_OUTCOME = {
    Decision.RECOVERED: Outcome.SWEPT_RECOVERED,
    Decision.FAILED: Outcome.SWEPT_EXHAUSTED,
    Decision.OUTCOME_UNKNOWN: Outcome.SWEPT_UNKNOWN,
}


@dataclass(frozen=True)
class SweepDecision:
    run_id: str
    attempt: int
    decision: Decision


def decide(entries: list[ledger.Entry], attempt: int, max_attempts: int) -> Decision:
    """Pure decision for one expired attempt, from its ledger.

    Any dispatch authorization in the run's history forbids a retry, not only this attempt's: an
    expired reconcile or resume attempt of an unresolved run returns it to ``outcome_unknown``.
    """
    if any(e.kind == evidence.DISPATCH_AUTHORIZED for e in entries):
        return Decision.OUTCOME_UNKNOWN
    return Decision.RECOVERED if attempt < max_attempts else Decision.FAILED


def sweep(db: Database, *, evidence_key: Secret | None = None, batch: int = SWEEP_BATCH_MAX) -> list[SweepDecision]:
    """Decide every expired dataflow attempt found now, then every live one whose holder is gone
    (bounded by ``batch`` each)."""
    with db.read() as conn:
        expired = leases.list_expired(conn, db, MODULE, limit=batch)
    decided = [_isolated(db, lease.subject_id, lease.attempt, evidence_key) for lease in expired]
    with db.read() as conn:
        gone = leases.list_dead_holders(conn, db, MODULE, limit=batch)
    return decided + [_isolated(db, lease.subject_id, lease.attempt, evidence_key, dead=True) for lease in gone]


def _isolated(db: Database, run_id: str, attempt: int, key: Secret | None, *, dead: bool = False) -> SweepDecision:
    """One lease's decision; an error deciding it (a damaged row, say) is logged and never stops the
    sweep of the others. A database that is down still raises: the caller backs off."""
    try:
        return _sweep_one(db, run_id, attempt, key, dead)
    except StorageUnavailable:
        raise
    except Exception as error:
        _log.error("sweep.undecidable", run_id=run_id, attempt=attempt, error_type=type(error).__name__,
                   error=error.message if isinstance(error, DataflowError) else None)  # fmt: skip
        return SweepDecision(run_id, attempt, Decision.ERROR)


def sweep_run(db: Database, run_id: str, *, evidence_key: Secret | None = None) -> SweepDecision | None:
    """Decide one run's attempt if its lease has expired or its holder is gone (None when it holds no
    unreleased lease)."""
    with db.read() as conn:
        lease = leases.current(conn, MODULE, run_id)
    if lease is None:
        return None
    decided = _isolated(db, run_id, lease.attempt, evidence_key)
    if decided.decision == Decision.SKIPPED:
        return _isolated(db, run_id, lease.attempt, evidence_key, dead=True)
    return decided


def _close(conn: Connection, db: Database, run_id: str, attempt: int, dead: bool) -> bool:
    if dead:
        return leases.close_dead_holder(conn, db, MODULE, run_id, attempt)
    return leases.close_expired(conn, db, MODULE, run_id, attempt)


def _sweep_one(db: Database, run_id: str, attempt: int, key: Secret | None, dead: bool) -> SweepDecision:
    try:
        with db.begin() as conn:
            if not _close(conn, db, run_id, attempt, dead):
                return SweepDecision(run_id, attempt, Decision.SKIPPED)
            run = runs.get(conn, run_id)
            decision = decide(ledger.read(conn, MODULE, run_id), attempt, run.max_attempts)
            transitions.swept(conn, db, run, attempt, _OUTCOME[decision], holder_gone=dead, evidence_key=key)
    except EvidenceError as error:
        # The chain did not verify: the decision is recorded as an evidence failure instead (the
        # lease is closed by the same transaction, so again exactly one sweeper decides).
        with db.begin() as conn:
            if not _close(conn, db, run_id, attempt, dead):
                return SweepDecision(run_id, attempt, Decision.SKIPPED)
            run = runs.get(conn, run_id)
            transitions.evidence_failed_in(conn, db, run, attempt, error.message, evidence_key=key)
        return SweepDecision(run_id, attempt, Decision.EVIDENCE_FAILED)
    return SweepDecision(run_id, attempt, decision)
