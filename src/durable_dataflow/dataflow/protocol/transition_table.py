"""The protocol's transitions as data (DESIGN §6; docs/model.md maps each one to the spin model).

Every state change of a dataflow run is one row of :data:`TABLE`: the ledger entries it appends,
the run status and recovery status it projects, whether it writes a verified checkpoint, whether it
releases the lease, and which warning the run then carries. ``transitions`` writes a row (its named
functions, through ``apply``); ``derivation`` reads the table backwards.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from durable_dataflow.dataflow.protocol import evidence, runs
from durable_dataflow.dataflow.protocol.runs import RecoveryStatus, Run, RunStatus


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
