"""One attempt of a run as a value (DESIGN §6): its facts, the claim that starts it, its shared steps.

An :class:`Attempt` is built once, when the attempt starts (``RunService.attempt_of``), and handed
down: the compute step, the atomic terminal commit and the forward path
(:mod:`durable_dataflow.dataflow.protocol.forward`) take the value, never the run service, so a
step cannot reach back into the service for a fact it should have been given.

Commit budget (DESIGN §10): the atomic end of an attempt is one fenced transaction; a claim is one
more (:func:`claim_next`).
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from pathlib import Path

import structlog
from sqlalchemy.engine import Connection

from durable_dataflow.core import crashpoints, fencing, leases
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import (
    DataflowError,
    EvidenceError,
    ExecutionError,
    Interrupted,
    LeaseUnavailable,
    QuotaExceeded,
)
from durable_dataflow.core.holders import HolderLock
from durable_dataflow.core.secrets import Secret, SecretScope
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import compute as execution
from durable_dataflow.dataflow.execution import context, limits, progress, sources
from durable_dataflow.dataflow.execution.compute import ExecutionResult
from durable_dataflow.dataflow.execution.interruption import Interruption
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import cancel, quotas, runs, transitions
from durable_dataflow.dataflow.protocol.runs import MODULE, Run
from durable_dataflow.dataflow.protocol.service_config import ServiceConfig
from durable_dataflow.datasources.contract import PublishTarget

_log = structlog.get_logger("dataflow.service")  # the events keep the logger they were always written to


@dataclass(frozen=True)
class Claim:
    run: Run
    attempt: int
    # A quota that refuses the claimed run's execution (result_bytes reached since it was queued): the
    # attempt then fails with it, nothing executed.
    refused: QuotaExceeded | None = None


@dataclass(frozen=True)
class Attempt:
    """What one execution of a run needs, fixed when it starts."""

    run: Run  # the run as the attempt was claimed
    number: int  # the attempt number: the fencing token every write of the attempt names
    holder: str  # the lease holder (host:pid)
    lease_ttl_s: float  # the lease's time to live, which the heartbeat keeps extending
    definition: Definition
    workspace: Workspace  # the roots and sink rules the run was recorded with
    secrets: SecretScope  # the secrets the run may name (its tenant's grants, or the operator's)
    limits: limits.ExecutionLimits  # the platform's limits narrowed by the definition's
    platform_files: tuple[Path, ...]  # files no source may read (the database's, say)
    target: PublishTarget | None  # forward: where it publishes, without a partition token; atomic: None
    interruption: Interruption  # the process's: a signal stops every execution it carries
    evidence_key: Secret | None
    db: Database


def context_for(
    space: Workspace, bounds: limits.ExecutionLimits, platform_files: tuple[Path, ...], scope: SecretScope
) -> context.ExecutionContext:
    """The workspace's roots and secrets; never readable: the secrets folder and platform_files."""
    forbidden = (*platform_files, *context.secrets_folders())
    return context.ExecutionContext(
        base_dir=space.base_dir, allowed_roots=space.data_roots, limits=bounds, forbidden=forbidden, secrets=scope,
        store_grants=space.object_stores,
    )


def unexpected_error(run_id: str, error: Exception) -> ExecutionError:
    """What an unexpected in-process error becomes, so the caller always records a terminal entry: an
    ``ExecutionError`` naming its type (its text may quote data or driver details, so it goes to the
    log, not to the run)."""
    # The frames, not the message: an unexpected error's text may quote data or credentials.
    _log.error(
        "execution.unexpected_error", run_id=run_id, error_type=type(error).__name__,
        frames="".join(traceback.format_tb(error.__traceback__)),
    )  # fmt: skip
    return ExecutionError(
        f"the execution failed with an unexpected {type(error).__name__} (details are in the process log)"
    )


# ---- starting an attempt ----------------------------------------------------------------------


def take_lease(
    conn: Connection,
    db: Database,
    holder_lock: HolderLock,
    config: ServiceConfig,
    run_id: str,
    expected_attempt: int,
    *,
    chain_head: bool = False,
) -> leases.Lease:
    """Attempt ``expected_attempt + 1``'s lease (LeaseUnavailable while another is live); the holder
    lock is held first, so a sweeper can tell this process died (core/holders.py). ``chain_head``: the
    grant also reads the run's ledger head (``leases.acquire``)."""
    holder_lock.ensure()
    return leases.acquire(
        conn, db, MODULE, run_id, config.holder, config.lease_ttl_s, expected_attempt=expected_attempt,
        chain_head=chain_head,
    )  # fmt: skip


def claim_next(db: Database, holder_lock: HolderLock, config: ServiceConfig) -> Claim | None:
    """Claim the fairest queued run (``runs.fairest_queued``: the oldest queued run of the tenant with the
    fewest running runs; ``FOR UPDATE SKIP LOCKED`` on PostgreSQL): its next attempt's lease and
    ``attempt.started`` in one commit. The lease's grant reads the run's ledger head too, so
    ``attempt.started`` is appended without a read of its own: three statements after the claim's select.
    That head is current because the claim's select already holds the run row, which every writer of a
    run's chain writes in its own transaction (``transitions``: the row's projection): none can commit
    between the select and the grant (``leases.acquire``'s ``chain_head`` precondition)."""
    try:
        with db.begin() as conn:
            row = runs.fairest_queued(conn, skip_locked=db.dialect == "postgresql")
            if row is None:
                return None
            lease = take_lease(
                conn, db, holder_lock, config, row.run_id, expected_attempt=int(row.attempt), chain_head=True
            )
            run = transitions.start_attempt(conn, db, row.run_id, lease, evidence_key=config.evidence_key)
    except LeaseUnavailable:
        return None
    crashpoints.reach(crashpoints.AFTER_CLAIM)
    return Claim(run, run.attempt, quotas.claim_refusal(config.quotas, run.tenant, int(row.tenant_stored_bytes)))


# ---- the steps of an attempt ------------------------------------------------------------------


def compute(attempt: Attempt, progress_sink: progress.ProgressSink | None = None) -> ExecutionResult:
    """Resolve sources and run the steps: recomputable, nothing committed (every error a DataflowError)."""
    progress.report(progress_sink, progress.Progress(progress.Phase.EXECUTING))
    try:
        # The time limit counts from here: resolution (hashing, listing) and the engine together.
        ctx = context_for(attempt.workspace, attempt.limits, attempt.platform_files, attempt.secrets).started()
        ctx = dataclasses.replace(ctx, interruption=attempt.interruption)
        execution.check_interrupted(ctx)
        resolved = sources.resolve_sources(attempt.definition, ctx)
        # The engine watches for an interruption while it runs; the caller looks last, right before
        # its terminal (atomic) or pre-dispatch (forward) commit.
        return execution.execute(attempt.definition, attempt.run.parameters, ctx, resolved, progress_sink)
    except DataflowError:
        raise
    except Exception as error:  # no in-process error may leave a run running
        raise unexpected_error(attempt.run.run_id, error) from None


def fail(attempt: Attempt, error: DataflowError, missing_capability: bool = False) -> Run | None:
    """The attempt's terminal failure with nothing dispatched (None: fenced off); see :func:`fail_run`."""
    return fail_run(
        attempt.db, attempt.run, attempt.number, error,
        interruption=attempt.interruption, evidence_key=attempt.evidence_key,
        missing_capability=missing_capability,
    )  # fmt: skip


def fail_run(
    db: Database,
    run: Run,
    attempt: int,
    error: DataflowError,
    *,
    interruption: Interruption,
    evidence_key: Secret | None,
    missing_capability: bool = False,
) -> Run | None:
    """Terminal failure with nothing dispatched: no external output was created (None: fenced off).
    An interruption is no failure: the attempt is cancelled (dataflow.protocol.cancel.interrupt)."""
    cause = interruption.cause
    if isinstance(error, Interrupted) and cause is not None:
        return cancel.interrupt(db, run, attempt, cause, evidence_key=evidence_key)
    return transitions.fail_before_dispatch(
        db, run, attempt, error, evidence_key=evidence_key, missing_capability=missing_capability
    )


def record_evidence_failure(attempt: Attempt, reason: str) -> Run | None:
    """Verification refused a transition: the run is unresolved, with the reason (None: fenced off)."""
    return transitions.evidence_failed_unless_stale(
        attempt.db, attempt.run, attempt.number, reason, evidence_key=attempt.evidence_key
    )


# ---- the atomic mode --------------------------------------------------------------------------


def execute_atomic(attempt: Attempt, progress_sink: progress.ProgressSink | None = None) -> Run | None:
    """The attempt's end; returns the committed run when this attempt's terminal commit succeeded."""
    try:
        result = compute(attempt, progress_sink)
        progress.report(progress_sink, progress.Progress(
            progress.Phase.COMMITTING, None, result.row_count, len(result.ipc_bytes)
        ))  # fmt: skip
        attempt.interruption.check()  # the last look: a signal from here on finds the run committed
    except DataflowError as error:
        fail(attempt, error)
        return None
    crashpoints.reach(crashpoints.BEFORE_TERMINAL_COMMIT)
    final: Run | None = None
    try:
        final = commit_atomic_success(attempt, result)
    except EvidenceError as error:
        record_evidence_failure(attempt, error.message)
    crashpoints.reach(crashpoints.AFTER_TERMINAL_COMMIT)
    return final


def commit_atomic_success(attempt: Attempt, result: ExecutionResult) -> Run:
    """ONE fenced transaction: result, ledger, verification, checkpoint, projection, release
    (StaleAttempt when fenced off)."""
    run_id = attempt.run.run_id
    with fencing.fenced_chain(attempt.db, MODULE, run_id, attempt.number) as (conn, held):
        return transitions.succeed_atomic(  # stores the result and counts its bytes (transitions.apply)
            conn, attempt.db, attempt.run, attempt.number, result, evidence_key=attempt.evidence_key, held=held
        )
