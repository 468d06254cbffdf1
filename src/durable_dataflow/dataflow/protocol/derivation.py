"""The transition table read backwards (DESIGN §6): the state a verified ledger implies.

``dataflow verify`` (:func:`verify_run`) and every checkpoint compare that state with the run
projection (:func:`projection_problem`), so a flipped projection field is caught.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, hashing, ledger
from durable_dataflow.core.errors import EvidenceError
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.protocol.runs import MODULE, Mode, Run, RunStatus
from durable_dataflow.dataflow.protocol.transition_table import TABLE, Outcome, Transition

# Longest first, so that derive() reads (attempt.recovered, run.failed) as one exhausted sweep.
_BY_LENGTH = sorted(TABLE.items(), key=lambda item: -len(item[1].kinds))


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
