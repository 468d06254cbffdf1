"""Statements built once per database (``Database.statement``), on both engines: one object per builder
and shape, rebuilt when the test clock moves, and the values of one execution never reach another."""

from __future__ import annotations

import gc

import pytest
import sqlalchemy as sa

from durable_dataflow.core import fencing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError, StaleAttempt
from durable_dataflow.core.invariants import InvariantViolation
from durable_dataflow.dataflow.protocol import runs

MODULE = "test"


def _clock(db: Database) -> sa.Select[tuple[int]]:
    return sa.select(db.now_us_expr().label("now_us"))


def _clock_and_shape(db: Database, shape: str) -> sa.Select[tuple[int, str]]:
    return sa.select(db.now_us_expr().label("now_us"), sa.literal(shape).label("shape"))


def test_a_statement_is_built_once_per_builder_and_shape(db: Database) -> None:
    built = db.statement(_clock)
    assert db.statement(_clock) is built
    assert db.statement(_clock_and_shape, "a") is db.statement(_clock_and_shape, "a")
    assert db.statement(_clock_and_shape, "a") is not db.statement(_clock_and_shape, "b")


def test_a_moved_clock_builds_the_statement_again(db: Database) -> None:
    """The test clock's offset is part of the statement (``now_us_expr``): a kept statement must not
    keep the old time."""
    with db.begin() as conn:
        before = int(conn.execute(db.statement(_clock)).scalar_one())
    db.advance_clock(3600)
    with db.begin() as conn:
        after = int(conn.execute(db.statement(_clock)).scalar_one())
    assert after - before >= 3600 * 1_000_000


def test_kept_statements_carry_no_value_from_one_subject_to_the_next(db: Database) -> None:
    """The same kept fence and lease statements, executed for two subjects in turn, each see their own."""
    for subject in ("one", "two"):
        with db.begin() as conn:
            leases.acquire(conn, db, MODULE, subject, f"holder-{subject}", 30)
        with fencing.fenced(db, MODULE, subject, 1) as conn:
            ledger.append(conn, db, MODULE, subject, 1, f"by.{subject}", {"subject": subject})
    for subject in ("one", "two"):
        with fencing.fenced_chain(db, MODULE, subject, 1) as (_, held):
            assert [(e.subject_id, e.kind) for e in held.entries] == [(subject, f"by.{subject}")]
    with db.begin() as conn:
        leases.release(conn, db, MODULE, "one", 1)
    with pytest.raises(StaleAttempt), db.begin() as conn:
        leases.release(conn, db, MODULE, "one", 1)  # released already: the kept statement's guard holds
    with fencing.fenced(db, MODULE, "two", 1):  # and "two" is untouched
        pass


def test_a_run_update_names_only_columns_of_a_run(db: Database) -> None:
    for column in ("no_such_column", "updated_at_us"):
        with pytest.raises(InputError, match=column), db.begin() as conn:
            runs.update(conn, db, "some-run", **{column: 1})


def test_a_disposed_database_refuses_to_be_used(db_url: str) -> None:
    """After dispose() an engine would open a fresh pool that nothing closes (on PostgreSQL its connections
    leaked until garbage collection, failing CI with 'deleted while still open'): both doors refuse."""
    database = Database(db_url)
    with database.read() as conn:
        conn.execute(sa.select(1))
    database.dispose()
    with pytest.raises(InvariantViolation, match="used after it was disposed"), database.read():
        pass
    with pytest.raises(InvariantViolation, match="used after it was disposed"), database.begin():
        pass


def test_a_cursor_describes_each_result_once_and_every_result_anew(pg_db: Database) -> None:
    """Proves the PostgreSQL engine's cursor builds ``description`` once per result (the same list when read
    again), as DB-API seven-item sequences with psycopg's names and type codes, and describes the next
    statement's result, not the one before: a stale cache would name the first statement's columns, or
    no columns, for the second."""
    with pg_db.begin() as conn:
        cursor = conn.connection.driver_connection.cursor()
        cursor.execute("select 1 as a, 2 as b")
        first = cursor.description
        assert [c[0] for c in first or ()] == ["a", "b"]
        assert cursor.description is first, "read again, the same description"
        assert [(c.name, c.type_code, c.internal_size) for c in first or ()] == [("a", 23, 4), ("b", 23, 4)]
        cursor.execute("select 3 as c")
        assert [c[0] for c in cursor.description or ()] == ["c"]
        cursor.execute("select")
        assert cursor.description == [], "rows of no column are described, as psycopg does"
        cursor.execute("create temporary table t (x int)")
        assert cursor.description is None, "a statement without rows has none"
        cursor.execute("insert into t values (1) returning x")
        assert [c[0] for c in cursor.description or ()] == ["x"]
        result = cursor.pgresult
        cursor.close()
        kept = [o for o in gc.get_referrers(result) if isinstance(o, tuple)]
        assert kept == [], "a closed cursor's kept description lets its result (its rows) go"
