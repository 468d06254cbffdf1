"""Dataflow's ledger entry kinds and the facts each terminal state must show (DESIGN §6, Verify).

Core verifies the chain; the functions here check that the chain carries what a state claims:
success needs the recorded digest, a conclusive response or inspection with that digest, and
stored result bytes that hash to it. A check returns the empty string or the problem.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import ledger
from durable_dataflow.core.errors import EvidenceError, StorageUnavailable
from durable_dataflow.core.invariants import invariant
from durable_dataflow.dataflow.execution import results

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


def _digest_of_stream(stored_format: str, source: Any) -> str:
    """The digest of the IPC stream in ``source``, in the digest format the stored format was written
    with: v3 batch by batch as they are read (memory: about one batch and one chunk), v2 from the whole
    table (its single hash stream takes whole columns in turn: arrowdigest). Imported here: only a run
    with stored bytes needs pyarrow (`runs` and `show` never do)."""
    from durable_dataflow.dataflow.execution import arrowdigest

    with results.ipc_reader(source) as reader:
        if stored_format == results.FORMAT_IPC_DIGEST_V3:
            return arrowdigest.output_digest_of_batches(reader.schema, reader)
        invariant(stored_format == results.FORMAT_IPC_DIGEST_V2, "only verifiable formats are digested")
        return arrowdigest.output_digest_v2(reader.read_all())


def _check_verifiable(run_id: str, stored_format: str) -> None:
    if stored_format not in _VERIFIABLE_FORMATS:
        known = ", ".join(sorted(_VERIFIABLE_FORMATS))
        raise EvidenceError(
            f"the stored result of run {run_id} has format {stored_format!r}, which this version cannot "
            f"verify (it knows {known})"
        )


def stored_result_digest(
    conn: Connection, run_id: str, *, written: tuple[str, bytes | memoryview] | None = None
) -> str | None:
    """The digest recomputed from the stored result bytes (not the digest stored beside them), in the
    digest format named by the stored format; EvidenceError when this version cannot verify that format.
    The bytes are read from the database in chunks (``results.open_stored``) and digested batch by batch.

    ``written``: the ``(format, bytes)`` the caller's transaction stores (``results.store`` before this,
    or the transition's one statement after it, ``results.stored_ctes``): recomputed from those, not read
    back (a row inserted by an open transaction cannot change, and the statement binds these bytes)."""
    if written is not None:
        _check_verifiable(run_id, written[0])
        return _digest_of_stream(written[0], written[1])
    with results.open_stored(conn, run_id) as found:
        if found is None:
            return None
        stored_format, reader = found
        _check_verifiable(run_id, stored_format)
        return _digest_of_stream(stored_format, reader)


# ---- verifying stored results for readers: cached, and a few at a time --------------------------

VERIFIED_OUTCOMES_MAX = 1024  # (run, ledger head) outcomes a ResultChecks keeps, least recently used dropped
VERIFICATIONS_AT_ONCE_MAX = 2  # stored results a ResultChecks reads and digests at the same time
VERIFICATION_WAIT_S = 5.0  # how long a verification waits for a slot before it is refused

Recompute = Callable[[Connection, str], "str | None"]  # stored_result_digest's shape, for tests to wrap


class VerificationBusy(StorageUnavailable):
    """Every verification slot stayed taken for ``VERIFICATION_WAIT_S``: try again shortly. It is a
    ``storage_unavailable`` (HTTP 503): the platform cannot read the evidence now, and nothing was
    decided about the run."""


@dataclass(frozen=True)
class _Outcome:
    """What recomputing one stored result gave: its digest, or the EvidenceError's message."""

    digest: str | None
    problem: str


class ResultChecks:
    """Recomputed stored-result digests for readers (the evidence of ``GET /v1/runs/{id}/evidence``).

    Cached per (run, ledger head seq, head hash) in a least-recently-used map of ``outcomes_max``
    entries: a run's stored bytes never change after the commit that stored them, and any transition
    appends to its chain, so a new head is a new key. A cached outcome is not re-read: bytes tampered
    with in the database after an outcome was cached are found by the next verification after the
    head moves, by another process (`dataflow verify`), or after the entry is dropped. At most
    ``at_once_max`` recomputations run at once; another waits up to ``wait_s`` for a slot, then is
    refused with VerificationBusy. One object per run service, shared by its threads."""

    def __init__(
        self,
        *,
        outcomes_max: int = VERIFIED_OUTCOMES_MAX,
        at_once_max: int = VERIFICATIONS_AT_ONCE_MAX,
        wait_s: float = VERIFICATION_WAIT_S,
        recompute: Recompute = stored_result_digest,
    ) -> None:
        invariant(outcomes_max > 0 and at_once_max > 0 and wait_s >= 0, "ResultChecks limits are positive")
        self.outcomes_max = outcomes_max
        self.at_once_max = at_once_max
        self.wait_s = wait_s
        self._recompute = recompute
        self._slots = threading.BoundedSemaphore(at_once_max)
        self._lock = threading.Lock()
        self._outcomes: OrderedDict[tuple[str, int, str], _Outcome] = OrderedDict()

    def digest(self, conn: Connection, run_id: str, head: ledger.Entry) -> str | None:
        """``stored_result_digest(conn, run_id)`` for the chain whose verified head is ``head``: from
        the cache when this (run, head) was recomputed before; EvidenceError as it raises."""
        key = (run_id, head.seq, head.entry_hash)
        outcome = self._cached(key)
        if outcome is None:
            if not self._slots.acquire(timeout=self.wait_s):
                raise VerificationBusy(
                    f"{self.at_once_max} stored results are being verified already and no slot freed within "
                    f"{self.wait_s:g} s: ask again shortly"
                )
            try:
                outcome = self._cached(key) or self._outcome_of(conn, run_id)  # another may have just done it
            finally:
                self._slots.release()
            self._keep(key, outcome)
        if outcome.problem:
            raise EvidenceError(outcome.problem)
        return outcome.digest

    def _outcome_of(self, conn: Connection, run_id: str) -> _Outcome:
        try:
            return _Outcome(self._recompute(conn, run_id), "")
        except EvidenceError as error:
            return _Outcome(None, error.message)

    def _cached(self, key: tuple[str, int, str]) -> _Outcome | None:
        with self._lock:
            outcome = self._outcomes.get(key)
            if outcome is not None:
                self._outcomes.move_to_end(key)
            return outcome

    def _keep(self, key: tuple[str, int, str], outcome: _Outcome) -> None:
        with self._lock:
            self._outcomes[key] = outcome
            self._outcomes.move_to_end(key)
            while len(self._outcomes) > self.outcomes_max:
                self._outcomes.popitem(last=False)


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
