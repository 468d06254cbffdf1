"""The fenced transaction: every write made for an attempt goes through :func:`fenced`.

It locks the subject's lease row first (``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite the
``BEGIN IMMEDIATE`` write lock already serializes writers) and refuses with
:class:`StaleAttempt` unless the attempt is the current one, unreleased, and unexpired on the
database clock. Because the row stays locked until commit, no new attempt can be granted between
the check and the commit: a stale worker's transaction is ordered entirely before the next
attempt's grant, or it is refused.

:func:`fenced_chain` is the same transaction for a step that extends and verifies the subject's
ledger (every terminal transition, the pre-dispatch commit): its one fence statement also reads the
chain and the latest checkpoint's head (``core.ledger.HeldChain``), instead of three more statements.
Read in the statement that locks the lease row, they are what the lock holder sees: every other
writer of a subject's chain (a sweep, a cancel, a reconcile, the next attempt) changes the lease
row in the same transaction, so if one committed meanwhile, the fence sees the changed row and
refuses; the only writer that leaves the row as it is, is the fence holder itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import StaleAttempt
from durable_dataflow.core.schema import leases

# The subject, as the fence statements' bind parameters (they are built once per database).
_MODULE = sa.bindparam("fence_module", type_=sa.String())
_SUBJECT_ID = sa.bindparam("fence_subject_id", type_=sa.String())


def _fence_select(db: Database) -> sa.Select[Any]:
    return sa.select(
        leases.c.attempt.label("lease_attempt"),
        leases.c.released_at_us.label("lease_released_at_us"),
        leases.c.expires_at_us.label("lease_expires_at_us"),
        db.now_us_expr().label("now_us"),
    ).where(leases.c.module == _MODULE, leases.c.subject_id == _SUBJECT_ID)


def _fence_statement(db: Database) -> sa.Select[Any]:
    return _fence_select(db).with_for_update()


def _fence_and_chain_statement(db: Database) -> sa.Select[Any]:
    query = _fence_select(db).add_columns(*checkpoints.head_columns(_MODULE, _SUBJECT_ID))
    return ledger.chain_outerjoin(query, _MODULE, _SUBJECT_ID).with_for_update(of=leases)


def _subject(module: str, subject_id: str) -> dict[str, str]:
    return {"fence_module": module, "fence_subject_id": subject_id}


def _check(row: sa.Row[Any] | None, module: str, subject_id: str, attempt: int) -> None:
    """Raise StaleAttempt unless the locked lease row names ``attempt``, unreleased and unexpired."""
    if row is None:
        raise StaleAttempt(f"attempt {attempt} of {module}/{subject_id} holds no lease")
    if int(row.lease_attempt) != attempt:
        raise StaleAttempt(
            f"attempt {attempt} of {module}/{subject_id} is stale: the current attempt is {row.lease_attempt}"
        )
    if row.lease_released_at_us is not None:
        raise StaleAttempt(f"attempt {attempt} of {module}/{subject_id} has already released its lease")
    if int(row.lease_expires_at_us) <= int(row.now_us):
        overdue_ms = (int(row.now_us) - int(row.lease_expires_at_us)) / 1000
        raise StaleAttempt(
            f"attempt {attempt} of {module}/{subject_id} lost its lease {overdue_ms:.0f} ms ago (database clock)"
        )


def check_fence(conn: Connection, db: Database, module: str, subject_id: str, attempt: int) -> None:
    """Lock the lease row and raise StaleAttempt unless ``attempt`` is current and live."""
    row = conn.execute(db.statement(_fence_statement), _subject(module, subject_id)).one_or_none()
    _check(row, module, subject_id, attempt)


def check_fence_and_read(
    conn: Connection, db: Database, module: str, subject_id: str, attempt: int
) -> ledger.HeldChain:
    """:func:`check_fence` that also returns the subject's chain and latest checkpoint head, read by
    the same statement (one row per entry; the lease row alone is locked)."""
    rows = conn.execute(db.statement(_fence_and_chain_statement), _subject(module, subject_id)).all()
    _check(rows[0] if rows else None, module, subject_id, attempt)
    first = rows[0]
    verified = None
    if first.checkpoint_head_seq is not None:
        verified = (int(first.checkpoint_head_seq), str(first.checkpoint_head_hash))
    return ledger.HeldChain(module, subject_id, tuple(ledger.entries_of_rows(rows)), int(first.now_us), verified)


@contextmanager
def fenced(db: Database, module: str, subject_id: str, attempt: int) -> Iterator[Connection]:
    """A write transaction that commits only while ``attempt`` is current and its lease live."""
    with db.begin() as conn:
        check_fence(conn, db, module, subject_id, attempt)
        yield conn


@contextmanager
def fenced_chain(
    db: Database, module: str, subject_id: str, attempt: int
) -> Iterator[tuple[Connection, ledger.HeldChain]]:
    """:func:`fenced`, with the chain and checkpoint head its fence statement read (module docstring)."""
    with db.begin() as conn:
        yield conn, check_fence_and_read(conn, db, module, subject_id, attempt)
