"""The fenced transaction: every write made for an attempt goes through :func:`fenced`.

It locks the subject's lease row first (``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite the
``BEGIN IMMEDIATE`` write lock already serializes writers) and refuses with
:class:`StaleAttempt` unless the attempt is the current one, unreleased, and unexpired on the
database clock. Because the row stays locked until commit, no new attempt can be granted between
the check and the commit: a stale worker's transaction is ordered entirely before the next
attempt's grant, or it is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import StaleAttempt
from durable_dataflow.core.schema import leases


def check_fence(conn: Connection, db: Database, module: str, subject_id: str, attempt: int) -> None:
    """Lock the lease row and raise StaleAttempt unless ``attempt`` is current and live."""
    row = conn.execute(
        sa.select(
            leases.c.attempt,
            leases.c.released_at_us,
            leases.c.expires_at_us,
            db.now_us_expr().label("now_us"),
        )
        .where(leases.c.module == module, leases.c.subject_id == subject_id)
        .with_for_update()
    ).one_or_none()
    if row is None:
        raise StaleAttempt(f"attempt {attempt} of {module}/{subject_id} holds no lease")
    if int(row.attempt) != attempt:
        raise StaleAttempt(
            f"attempt {attempt} of {module}/{subject_id} is stale: the current attempt is {row.attempt}"
        )
    if row.released_at_us is not None:
        raise StaleAttempt(f"attempt {attempt} of {module}/{subject_id} has already released its lease")
    if int(row.expires_at_us) <= int(row.now_us):
        overdue_ms = (int(row.now_us) - int(row.expires_at_us)) / 1000
        raise StaleAttempt(
            f"attempt {attempt} of {module}/{subject_id} lost its lease {overdue_ms:.0f} ms ago (database clock)"
        )


@contextmanager
def fenced(db: Database, module: str, subject_id: str, attempt: int) -> Iterator[Connection]:
    """A write transaction that commits only while ``attempt`` is current and its lease live."""
    with db.begin() as conn:
        check_fence(conn, db, module, subject_id, attempt)
        yield conn
