"""Cancellation (docs/schedules.md#cancellation): end a run that cannot have published, or refuse.

- A **queued** run is cancelled under its current attempt, with its row locked (a concurrent claim
  either took it first, and the run is running, or skips it). An attempt lease still open under a
  row that says queued (a row edited, or written by a bug) is closed first, as for a running one:
  the projection alone never decides that no attempt is live.
- A **running** attempt with no dispatch authorization in the run's history is closed under the
  fence: its lease is closed first, in the same statement a terminal transaction uses, so every
  later write of that attempt is refused as a stale one (StaleAttempt), exactly as after an expired
  lease's sweep. Only then is the ledger read: an authorization that committed before the lease was
  closed is seen, and cancellation refused; none can commit after.
- After a dispatch authorization the publication may exist: cancellation is refused with the
  reconcile instruction, and a finished run is left as it is.

Both cancellations append ``run.cancelled`` (who asked, from what state), checkpoint the run
``cancelled / no_external_output`` and are shown in its history (transitions.Outcome.CANCELLED).

An **interrupted** attempt (SIGINT or SIGTERM to ``dataflow run`` or a worker, before its dispatch
authorization) ends the same way, by :func:`interrupt`: the running attempt's own process closes it as
an operator's cancel would, with reason ``interrupted``, the signal, and who (the user the process runs
as, its host and trigger).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from durable_dataflow.core import leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import Conflict, StaleAttempt
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.execution.interruption import Cause
from durable_dataflow.dataflow.protocol import evidence, requests, runs, transitions
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import MODULE, Run, RunStatus

ERROR_CODE = transitions.CANCELLED_CODE
INTERRUPTED = transitions.INTERRUPTED  # run.cancelled's reason when the attempt's own process was told to stop
# How often a run that changed state under a cancel (claimed, finished) is looked at again.
STATE_CHANGES_MAX = 3


@dataclass(frozen=True)
class Cancellation:
    run: Run
    cancelled: bool  # False: it already was
    detail: str


class Ledgered(Protocol):
    """What a cancel needs of the run service (RunService), which imports this module to cancel its own
    interrupted attempts: the database and the evidence key."""

    db: Database

    @property
    def evidence_key(self) -> Secret | None: ...


class _Moved(Exception):
    """The run changed state between the read and the locked write: look again."""


def cancel(
    service: Ledgered,
    run_id: str,
    *,
    access: AccessContext,
    provenance: Provenance,
    tenant: str | None = None,
) -> Cancellation:
    """Cancel a queued run, or a running one before dispatch authorization; Conflict otherwise, naming
    what to do instead. Cancelling a cancelled run changes nothing."""
    asked_by = requests.asked_by(access, provenance)
    db, key = service.db, service.evidence_key
    for _ in range(STATE_CHANGES_MAX):
        run = _current(db, run_id, tenant)
        if run.status == RunStatus.CANCELLED:
            _check_cancelled(db, run)
            return Cancellation(run, False, "already cancelled")
        refusal = refusal_of(run)
        if refusal:
            raise Conflict(refusal)
        try:
            if run.status == RunStatus.QUEUED:
                return _cancel_queued(db, key, run, asked_by)
            return _cancel_running(db, key, run, asked_by, None)
        except _Moved:
            continue
    raise Conflict(f"run {run_id} kept changing state while it was being cancelled: try again")


def interrupt(db: Database, run: Run, attempt: int, cause: Cause, *, evidence_key: Secret | None) -> Run | None:
    """Cancel ``attempt`` of ``run``, whose process was interrupted (``cause``) before it authorized a
    dispatch: the operator's transition, asked by the user this process runs as. None when the attempt
    no longer owns the run (a sweep, an operator's cancel or a newer attempt closed it): nothing is written."""
    access = AccessContext.local(run.tenant)
    asked_by = requests.asked_by(access, Provenance(actor=access.principal, trigger=cause.trigger))
    for _ in range(STATE_CHANGES_MAX):
        current = _current(db, run.run_id)
        if current.status != RunStatus.RUNNING or current.attempt != attempt:
            return None
        try:
            return _cancel_running(db, evidence_key, current, asked_by, cause.signal).run
        except _Moved:
            continue
        except Conflict:  # authorized: the attempt goes on to publish, as after any late signal
            return None
    return None


def refusal_of(run: Run) -> str:
    """Why ``run`` cannot be cancelled as it is now, with the advice its state calls for, or "" (a queued or
    running run may still turn out to be authorized: the locked write looks again)."""
    if run.status in (RunStatus.OUTCOME_UNKNOWN, RunStatus.EVIDENCE_FAILED):
        return _authorized(run)
    if run.status not in (RunStatus.QUEUED, RunStatus.RUNNING):
        # Settled: a succeeded or failed run needs nothing, and reconcile would find nothing to do.
        return f"run {run.run_id} is already {run.status} ({run.recovery_status}): there is nothing to cancel"
    if run.publication_idempotency_key is not None:
        return _authorized(run)
    return ""


def _authorized(run: Run) -> str:
    """The refusal of a run whose dispatch was authorized, with what to do in its state (issue 33)."""
    refused = f"run {run.run_id} is {run.status} ({run.recovery_status}) and its dispatch was authorized"
    if run.status == RunStatus.EVIDENCE_FAILED:
        return (
            f"{refused}, and its evidence failed verification: it cannot be cancelled. "
            f"See which entry broke with `dataflow verify {run.run_id}`, then inspect the sink before acting"
        )
    if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
        return (
            f"{refused}: its publication may be under way, so it cannot be cancelled. Wait for it to end "
            f"(`dataflow show {run.run_id}`); if it ends outcome_unknown, settle it with "
            f"`dataflow reconcile {run.run_id}`"
        )
    return (
        f"{refused}, so a publication may exist: it cannot be cancelled. Settle it by inspecting the sink: "
        f"`dataflow reconcile {run.run_id}`"
    )


def _current(db: Database, run_id: str, tenant: str | None = None) -> Run:
    with db.read() as conn:
        return runs.get(conn, run_id, tenant)


def _check_cancelled(db: Database, run: Run) -> None:
    """A row that says cancelled is believed only when its ledger's head is ``run.cancelled``."""
    with db.read() as conn:
        entries = ledger.read(conn, MODULE, run.run_id)
    if not entries or entries[-1].kind != evidence.RUN_CANCELLED:
        head = entries[-1].kind if entries else "nothing"
        raise Conflict(
            f"run {run.run_id} is shown cancelled but its ledger ends with {head}, not run.cancelled: its "
            f"projection does not match its evidence. Nothing was written; check it: `dataflow verify {run.run_id}`"
        )


def _cancel_queued(db: Database, key: Secret | None, run: Run, asked_by: dict[str, Any]) -> Cancellation:
    with db.begin() as conn:
        # A queued run's attempt holds no open lease; if one is open anyway, this closes it before the
        # ledger is read, so that attempt's later writes are StaleAttempt (the lease row first, as in
        # every fenced write, so no lock order is reversed).
        with contextlib.suppress(StaleAttempt):
            leases.release(conn, db, MODULE, run.run_id, run.attempt)
        locked = _runs_row(conn, run)
        if locked.status != RunStatus.QUEUED or locked.attempt != run.attempt:
            raise _Moved
        if _dispatch_authorized(conn, run.run_id):  # a queued run never was: the sweeper makes it outcome_unknown
            raise Conflict(_authorized(locked))
        done = transitions.cancel_run(conn, db, locked, asked_by, None, evidence_key=key)
    return Cancellation(done, True, "cancelled while queued: no attempt had started")


def _cancel_running(
    db: Database, key: Secret | None, run: Run, asked_by: dict[str, Any], signal: str | None
) -> Cancellation:
    with db.begin() as conn:
        try:
            leases.release(conn, db, MODULE, run.run_id, run.attempt)  # the lease row first, as a fenced write
        except StaleAttempt:
            raise _Moved from None  # the attempt ended (or was swept) meanwhile
        locked = _runs_row(conn, run)
        if locked.status != RunStatus.RUNNING or locked.attempt != run.attempt:
            raise _Moved
        if _dispatch_authorized(conn, run.run_id):
            raise Conflict(_authorized(locked))  # rolls the lease back: the attempt goes on
        done = transitions.cancel_run(conn, db, locked, asked_by, signal, evidence_key=key)
    return Cancellation(done, True, f"attempt {run.attempt} was closed under the fence before dispatch authorization")


def _runs_row(conn: Connection, run: Run) -> Run:
    return runs.get(conn, run.run_id, for_update=True)


def _dispatch_authorized(conn: Connection, run_id: str) -> bool:
    return any(entry.kind == evidence.DISPATCH_AUTHORIZED for entry in ledger.read(conn, MODULE, run_id))
