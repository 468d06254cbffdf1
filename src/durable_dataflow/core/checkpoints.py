"""Recovery checkpoints: a verified head of a subject's ledger chain with the facts of its state.

A checkpoint is written only after the chain verifies and the caller's facts check passes, in the
caller's transaction. A failure raises :class:`EvidenceError` before anything is written, so the
caller's transaction (and whatever success projection it carries) does not commit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import hashing, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import EvidenceError
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.schema import checkpoints
from durable_dataflow.core.secrets import Secret

FactsCheck = Callable[[Sequence[ledger.Entry]], str]
"""Returns the empty string when the entries carry the facts a state needs, else the problem."""


@dataclass(frozen=True)
class Checkpoint:
    module: str
    subject_id: str
    attempt: int
    head_seq: int
    head_hash: str
    status: str
    facts: Mapping[str, Any]
    verified_at_us: int


def latest(conn: Connection, module: str, subject_id: str) -> Checkpoint | None:
    """The most recent checkpoint of a subject."""
    row = conn.execute(
        sa.select(checkpoints)
        .where(checkpoints.c.module == module, checkpoints.c.subject_id == subject_id)
        .order_by(checkpoints.c.head_seq.desc())
        .limit(1)
    ).one_or_none()
    if row is None:
        return None
    return Checkpoint(
        module,
        subject_id,
        int(row.attempt),
        int(row.head_seq),
        row.head_hash,
        row.status,
        json.loads(row.facts_json),
        int(row.verified_at_us),
    )


def head_columns(
    module: str | sa.ColumnElement[str], subject_id: str | sa.ColumnElement[str]
) -> tuple[sa.Label[int], sa.Label[str]]:
    """The latest checkpoint's ``checkpoint_head_seq`` and ``checkpoint_head_hash`` as scalar
    subqueries (NULL without a checkpoint), for a statement that reads them with other things (the
    subject as values or as bind parameters)."""
    newest = (
        sa.select(checkpoints.c.head_seq, checkpoints.c.head_hash)
        .where(checkpoints.c.module == module, checkpoints.c.subject_id == subject_id)
        .order_by(checkpoints.c.head_seq.desc())
        .limit(1)
    )
    seq = newest.with_only_columns(checkpoints.c.head_seq).scalar_subquery().label("checkpoint_head_seq")
    head_hash = newest.with_only_columns(checkpoints.c.head_hash).scalar_subquery().label("checkpoint_head_hash")
    return seq, head_hash


def verify_subject(
    conn: Connection,
    module: str,
    subject_id: str,
    *,
    evidence_key: Secret | None = None,
    facts_check: FactsCheck | None = None,
    held: ledger.HeldChain | None = None,
) -> ledger.Verification:
    """Verify the chain against the latest checkpoint's head, then the caller's facts.

    ``held``: the chain and checkpoint head the caller's transaction already read under the
    subject's lock, with what it appended since (``ledger.HeldChain``): verified without reading them
    again."""
    if held is not None:
        invariant((held.module, held.subject_id) == (module, subject_id), "the held chain is the subject's")
        expected, entries = held.verified_head, list(held.entries)
    else:
        previous = latest(conn, module, subject_id)
        expected = (previous.head_seq, previous.head_hash) if previous is not None else None
        entries = ledger.read(conn, module, subject_id)
    result = ledger.verify_entries(
        entries, module, subject_id, evidence_key=evidence_key, expected_head=expected
    )
    if result.ok and facts_check is not None:
        problem = facts_check(entries)
        if problem:
            return ledger.Verification(
                False, result.head_seq, result.head_hash, result.entry_count, result.keyed, None, problem
            )
    return result


def write_verified(
    conn: Connection,
    db: Database,
    module: str,
    subject_id: str,
    attempt: int,
    status: str,
    facts: Mapping[str, Any],
    *,
    evidence_key: Secret | None = None,
    facts_check: FactsCheck | None = None,
    held: ledger.HeldChain | None = None,
) -> Checkpoint:
    """Verify the subject's evidence (``held``: as :func:`verify_subject`) and write a checkpoint;
    raise EvidenceError on any failure."""
    parameters = verified(conn, module, subject_id, attempt, status, facts, evidence_key=evidence_key,
                          facts_check=facts_check, held=held)  # fmt: skip
    return write(conn, db, parameters, facts)


def write(conn: Connection, db: Database, parameters: Mapping[str, Any], facts: Mapping[str, Any]) -> Checkpoint:
    """Write the checkpoint :func:`verified` returned (``parameters``; ``facts`` as it was given them)."""
    now_us = conn.execute(db.statement(_insert_statement), dict(parameters)).scalar_one()
    value = {name: parameters[f"{_PREFIX}{name}"] for name in _VALUES if name != "facts_json"}
    return Checkpoint(**value, facts=facts, verified_at_us=now_us)


def verified(
    conn: Connection,
    module: str,
    subject_id: str,
    attempt: int,
    status: str,
    facts: Mapping[str, Any],
    *,
    evidence_key: Secret | None = None,
    facts_check: FactsCheck | None = None,
    held: ledger.HeldChain | None = None,
) -> dict[str, Any]:
    """:func:`write_verified`'s verification (EvidenceError on any failure), and the checkpoint it would
    write as the values of :func:`inserted_cte`'s bind parameters: for a PostgreSQL statement of another
    module that writes the checkpoint with its own rows, in one round trip."""
    result = verify_subject(
        conn, module, subject_id, evidence_key=evidence_key, facts_check=facts_check, held=held
    )
    if not result.ok:
        where = f" at seq {result.broken_seq}" if result.broken_seq is not None else ""
        raise EvidenceError(f"evidence of {module}/{subject_id} failed verification{where}: {result.reason}")
    row = {
        "module": module, "subject_id": subject_id, "head_seq": result.head_seq, "attempt": attempt,
        "head_hash": result.head_hash, "status": status, "facts_json": hashing.canonical_json(dict(facts)).decode(),
    }  # fmt: skip
    return {f"{_PREFIX}{name}": value for name, value in row.items()}


_PREFIX = "checkpoint_"  # of the bind parameters, which share a statement with other modules' in inserted_cte
_VALUES = ("module", "subject_id", "head_seq", "attempt", "head_hash", "status", "facts_json")


def _insert_statement(db: Database) -> sa.Insert:
    """A checkpoint at the database time (the other values are :func:`verified`'s bind parameters)."""
    values = {name: sa.bindparam(f"{_PREFIX}{name}", type_=checkpoints.c[name].type) for name in _VALUES}
    inserted = checkpoints.insert().values(verified_at_us=db.now_us_expr(), **values)
    return inserted.returning(checkpoints.c.verified_at_us)


def inserted_cte(db: Database) -> sa.CTE:
    """:func:`write_verified`'s INSERT as a data-modifying CTE (its values: :func:`verified`)."""
    return _insert_statement(db).cte("inserted_checkpoint")


def count_by_module(
    conn: Connection, *, module: str | None = None, subjects: sa.Select[tuple[str]] | None = None
) -> dict[str, int]:
    """The number of checkpoints per module; ``module`` with ``subjects`` (a select of subject ids)
    counts only those subjects of that module."""
    query = sa.select(checkpoints.c.module, sa.func.count()).group_by(checkpoints.c.module)
    if module is not None and subjects is not None:
        query = query.where(checkpoints.c.module == module, checkpoints.c.subject_id.in_(subjects))
    return {str(name): int(count) for name, count in conn.execute(query)}
