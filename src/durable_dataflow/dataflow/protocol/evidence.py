"""Dataflow's ledger entry kinds and the facts each terminal state must show (DESIGN §6, Verify).

Core verifies the chain; the functions here check that the chain carries what a state claims:
success needs the recorded digest, a conclusive response or inspection with that digest, and
stored result bytes that hash to it. A check returns the empty string or the problem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection

from durable_dataflow.core import ledger
from durable_dataflow.core.errors import EvidenceError
from durable_dataflow.dataflow.execution import results

if TYPE_CHECKING:
    import pyarrow as pa

RUN_RECORDED = "run.recorded"
ATTEMPT_STARTED = "attempt.started"
RESULT_COMMITTED = "result.committed"
DISPATCH_AUTHORIZED = "dispatch.authorized"
PUBLICATION_CONFIRMED = "publication.confirmed"
PUBLICATION_REJECTED = "publication.rejected"
PUBLICATION_MISMATCH = "publication.mismatch"
PUBLICATION_UNKNOWN = "publication.unknown"
RUN_SUCCEEDED = "run.succeeded"
RUN_FAILED = "run.failed"
ATTEMPT_RECOVERED = "attempt.recovered"
ATTEMPT_OUTCOME_UNKNOWN = "attempt.outcome_unknown"
EVIDENCE_FAILED = "evidence.failed"
RECONCILE_STARTED = "reconcile.started"
RECONCILE_PRESENT = "reconcile.present"
RECONCILE_ABSENT = "reconcile.absent"
RECONCILE_MISMATCH = "reconcile.mismatch"
RECONCILE_UNDECIDED = "reconcile.undecided"
RESUME_STARTED = "resume.started"
RECONCILE_INVALID_TARGET = "reconcile.invalid_target"
RUN_CANCELLED = "run.cancelled"

CONCLUSIVE_PRESENCE = frozenset({PUBLICATION_CONFIRMED, RECONCILE_PRESENT})
# The references a success commits together, each non-empty (DESIGN §6): publication, datasource,
# materialization.
REFERENCES = ("publication_ref", "datasource_ref", "materialization_ref")


# The stored result formats this version can verify.
_VERIFIABLE_FORMATS = (results.FORMAT_IPC_DIGEST_V2, results.FORMAT_IPC_DIGEST_V3)


def _digest_of_format(stored_format: str) -> Callable[[pa.Table], str] | None:
    """The digest format each stored result format was written with; results are verified under it.
    Imported here: only a run with stored bytes needs pyarrow (`runs` and `show` never do)."""
    from durable_dataflow.dataflow.execution import arrowdigest

    digests: dict[str, Callable[[pa.Table], str]] = {
        results.FORMAT_IPC_DIGEST_V2: arrowdigest.output_digest_v2,
        results.FORMAT_IPC_DIGEST_V3: arrowdigest.output_digest,
    }
    return digests.get(stored_format)


def stored_result_digest(conn: Connection, run_id: str, *, written: tuple[str, bytes] | None = None) -> str | None:
    """The digest recomputed from the stored result bytes (not the digest stored beside them), in the
    digest format named by the stored format; EvidenceError when this version cannot verify that format.

    ``written``: the ``(format, bytes)`` the caller's transaction stored itself (``results.store``):
    recomputed from those, not read back (a row inserted by an open transaction cannot change)."""
    found = written if written is not None else results.stored(conn, run_id)
    if found is None:
        return None
    stored_format, data = found
    digest_of = _digest_of_format(stored_format)
    if digest_of is None:
        known = ", ".join(sorted(_VERIFIABLE_FORMATS))
        raise EvidenceError(
            f"the stored result of run {run_id} has format {stored_format!r}, which this version cannot "
            f"verify (it knows {known})"
        )
    return digest_of(results.decode_ipc(data))


def _last(entries: Sequence[ledger.Entry], kind: str) -> ledger.Entry | None:
    for entry in reversed(entries):
        if entry.kind == kind:
            return entry
    return None


def _recorded_problem(entries: Sequence[ledger.Entry], attempt: int) -> str:
    if not entries or entries[0].kind != RUN_RECORDED:
        return "the chain does not start with run.recorded"
    if not any(
        e.kind in (ATTEMPT_STARTED, RESUME_STARTED, RECONCILE_STARTED) and e.attempt == attempt for e in entries
    ):
        return f"attempt {attempt} has no start entry"
    return ""


def atomic_success_problem(entries: Sequence[ledger.Entry], attempt: int, result_digest: str | None) -> str:
    """Atomic success: recorded, started, and a result.committed whose digest the stored bytes match."""
    problem = _recorded_problem(entries, attempt)
    if problem:
        return problem
    committed = _last(entries, RESULT_COMMITTED)
    if committed is None or committed.attempt != attempt:
        return f"no result.committed entry for attempt {attempt}"
    if result_digest is None or committed.payload.get("output_digest") != result_digest:
        return "the stored result bytes do not hash to the recorded output digest"
    return ""


def forward_success_problem(entries: Sequence[ledger.Entry], attempt: int, result_digest: str | None) -> str:
    """Forward success: authorized digest, a later conclusive presence with that digest and all three
    references, matching bytes."""
    problem = _recorded_problem(entries, attempt)
    if problem:
        return problem
    authorized = _last(entries, DISPATCH_AUTHORIZED)
    if authorized is None:
        return "no dispatch.authorized entry: nothing was authorized for publication"
    recorded_digest = authorized.payload.get("output_digest")
    conclusive = [e for e in entries if e.kind in CONCLUSIVE_PRESENCE and e.seq > authorized.seq]
    if not conclusive:
        return "no conclusive publication response or inspection after the dispatch authorization"
    evidence = conclusive[-1]
    if evidence.payload.get("digest") != recorded_digest:
        return "the sink's digest does not match the recorded output digest"
    missing = [ref for ref in REFERENCES if not evidence.payload.get(ref)]
    if missing:
        return f"the conclusive evidence carries no {', '.join(missing)}: success needs all three references"
    if result_digest != recorded_digest:
        return "the stored result bytes do not hash to the recorded output digest"
    return ""
