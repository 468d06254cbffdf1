"""PostgreSQL provider specifics: the DSN stays secret, COMMIT ambiguity is Inconclusive, server errors are Rejected."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
import sqlalchemy as sa

from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.datasources import postgres_table
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    Inconclusive,
    Present,
    Published,
    PublishTarget,
    Rejected,
    Undecided,
)
from durable_dataflow.datasources.postgres_table import RECORD_TABLES_MISSING, PostgresTableProvider
from durable_dataflow.platform import Platform
from support import flows
from support.pg import PostgresServer

SECRET = "TEST_PG_SINK_DSN"
PASSWORD = "hunter2-very-secret"


def rows(n: int = 2) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "amount": pa.array([Decimal("12.50")] * n, pa.decimal128(12, 2)),
        }
    )


@pytest.fixture
def sink_dsn(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test database's libpq DSN, also published as the secret TEST_PG_SINK_DSN."""
    monkeypatch.setenv(SECRET, pg_url)
    return pg_url.replace("postgresql+psycopg://", "postgresql://")


def target(location: str = "results") -> PublishTarget:
    return PublishTarget("ds", location, "append", {"dsn": {"secret": SECRET}})


def prepared() -> PostgresTableProvider:
    """A provider whose sink database holds the record tables, as the platform prepares it before dispatch."""
    provider = PostgresTableProvider()
    provider.prepare(target())
    return provider


def record_tables(dsn: str) -> tuple[bool, bool]:
    """Whether sink_publications and sink_fences exist in the database, read from the catalog."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT to_regclass('sink_publications') IS NOT NULL, to_regclass('sink_fences') IS NOT NULL"
        ).fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1])


def test_created_table_maps_arrow_types_and_tags_rows_with_the_key(sink_dsn: str) -> None:
    """The first publish creates the table (decimal -> numeric(12,2)) and the publication row in one go."""
    outcome = prepared().publish("k", 1, rows(), sha256_bytes(b"k"), target())
    assert isinstance(outcome, Published)
    with psycopg.connect(sink_dsn) as conn:
        col = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = 'results'::regclass AND attname = 'amount'"
        ).fetchone()
        assert col == ("numeric(12,2)",)
        data = conn.execute("SELECT _publication_key, id, amount FROM results ORDER BY id").fetchall()
        assert data == [("k", 0, Decimal("12.50")), ("k", 1, Decimal("12.50"))]
        pub = conn.execute("SELECT digest, token, row_count FROM sink_publications").fetchall()
        assert pub == [(sha256_bytes(b"k"), 1, 2)]


def test_server_error_before_commit_is_rejected_and_writes_nothing(sink_dsn: str) -> None:
    """A value that does not fit numeric(12,2) aborts the transaction: Rejected, no rows, no record, key absent."""
    provider = prepared()
    provider.publish("ok", 1, rows(), sha256_bytes(b"ok"), target())
    too_big = pa.table({"id": pa.array([9], pa.int64()), "amount": pa.array([Decimal("1e15")], pa.decimal128(20, 2))})
    outcome = provider.publish("big", 1, too_big, sha256_bytes(b"big"), target())
    assert isinstance(outcome, Rejected)
    # The server's DETAIL and CONTEXT quote the row being copied: only a fixed description and the SQLSTATE.
    assert outcome.reason == "the sink refused the publication: a number is out of range for its type (SQLSTATE 22003)"
    assert provider.inspect("big", target()) == Absent(None)
    with psycopg.connect(sink_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM results WHERE _publication_key = 'big'").fetchone() == (0,)


class _CommitThenDrop:
    """A connection proxy whose COMMIT succeeds at the server and then reports a lost connection."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def commit(self) -> None:
        self._conn.commit()
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_lost_connection_at_commit_is_inconclusive_and_inspection_settles_it(
    sink_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMMIT happened but its answer was lost: publish raises Inconclusive (no retry); inspect then finds Present."""
    provider = prepared()  # the record tables exist, so the publish's only COMMIT is the publication's
    real_connect = psycopg.connect
    monkeypatch.setattr(postgres_table.psycopg, "connect", lambda *a, **k: _CommitThenDrop(real_connect(*a, **k)))
    with pytest.raises(Inconclusive, match="COMMIT"):
        provider.publish("k", 1, rows(), sha256_bytes(b"k"), target())
    monkeypatch.setattr(postgres_table.psycopg, "connect", real_connect)
    found = provider.inspect("k", target(), fence=2)
    assert isinstance(found, Present)
    assert (found.digest, found.token) == (sha256_bytes(b"k"), 1)


def test_unreachable_database_is_rejected_without_leaking_the_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connecting fails (nothing could be written): Rejected, and neither the DSN nor the password appear."""
    dsn = f"postgresql://writer:{PASSWORD}@127.0.0.1:1/nowhere?connect_timeout=2"
    monkeypatch.setenv(SECRET, dsn)
    provider = PostgresTableProvider()
    outcome = provider.publish("k", 1, rows(), sha256_bytes(b"k"), target())
    assert isinstance(outcome, Rejected)
    assert PASSWORD not in outcome.reason and dsn not in outcome.reason
    inspected = provider.inspect("k", target(), fence=3)
    assert isinstance(inspected, Undecided)
    assert PASSWORD not in inspected.reason
    with pytest.raises(ExecutionError) as caught:
        provider.prepare(target())
    assert caught.value.message.startswith("the sink's record tables cannot be created: cannot connect to the sink")
    assert PASSWORD not in caught.value.message and dsn not in caught.value.message


def test_plain_dsn_and_bad_table_names_are_refused() -> None:
    """The DSN must be a secret reference and the location an identifier: InputError before any connection."""
    provider = PostgresTableProvider()
    plain = PublishTarget("ds", "results", "append", {"dsn": "postgresql://u:p@h/db"})
    with pytest.raises(InputError, match="secret reference"):
        provider.publish("k", 1, rows(), sha256_bytes(b"k"), plain)
    with pytest.raises(InputError, match="identifiers"):
        provider.publish("k", 1, rows(), sha256_bytes(b"k"), target("results; drop table x"))


def test_overwrite_mode_replaces_the_rows_in_the_same_transaction(sink_dsn: str) -> None:
    """mode=overwrite deletes the earlier rows and writes the new publication atomically with its record."""
    provider = prepared()
    provider.publish("a", 1, rows(3), sha256_bytes(b"a"), target())
    over = PublishTarget("ds", "results", "overwrite", {"dsn": {"secret": SECRET}})
    assert isinstance(provider.publish("b", 1, rows(1), sha256_bytes(b"b"), over), Published)
    with psycopg.connect(sink_dsn) as conn:
        assert conn.execute("SELECT _publication_key, count(*) FROM results GROUP BY 1").fetchall() == [("b", 1)]


# Malformed DSNs whose password libpq's parse or connection errors quote, or that _scrub could not find.
MALFORMED_DSNS = [
    f"postgresql://writer:pa ss{PASSWORD}@127.0.0.1:1/db",
    f"host=127.0.0.1 password={PASSWORD} port=notaport",
    f"host=127.0.0.1 password={PASSWORD} dbname",
    f"user=writer password='{PASSWORD}",
    f"postgresql://writer:{PASSWORD}@[::1/db",
    f"postgresql://writer:first@{PASSWORD}@127.0.0.1:1/db?connect_timeout=2",
    f"postgresql://writer:{PASSWORD}@127.0.0.1:1/db?{PASSWORD}=1",
    f"postgresql://writer:{PASSWORD}@127.0.0.1:1/db?sslmode={PASSWORD}",
    f"host='{PASSWORD}' password={PASSWORD} port=1",
]


@pytest.mark.parametrize("dsn", MALFORMED_DSNS)
def test_a_malformed_dsn_never_puts_its_password_in_any_message(monkeypatch: pytest.MonkeyPatch, dsn: str) -> None:
    """Publish, inspect and read with a careless SINK_DSN: each is a fixed description of the failure (no
    driver text), so the password, which libpq echoes in quotes or as a host name, appears in none."""
    monkeypatch.setenv(SECRET, dsn)
    provider = PostgresTableProvider()
    published = provider.publish("k", 1, rows(), sha256_bytes(b"k"), target())
    inspected = provider.inspect("k", target(), fence=2)
    with pytest.raises(ExecutionError) as caught:
        provider.read(target())
    with pytest.raises(ExecutionError) as unprepared:
        provider.prepare(target())
    assert isinstance(published, Rejected) and isinstance(inspected, Undecided)
    for message in (published.reason, inspected.reason, caught.value.message, unprepared.value.message):
        assert PASSWORD not in message and "pa ss" not in message and "127.0.0.1" not in message
    assert published.reason.startswith("cannot connect to the sink database: ")
    assert inspected.reason.startswith("postgres inspection of key 'k' failed: cannot connect to the sink database: ")


def test_a_forward_run_with_a_malformed_sink_dsn_keeps_the_password_out_of_the_ledger(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves, through a recorded forward run on both platform engines, that a SINK_DSN with an unescaped
    space in its password fails the run before dispatch (preparing the record tables cannot connect, so nothing
    was authorized or written) and the password appears neither in the run's error_message nor in any row of the
    platform database (ledger entries included)."""
    monkeypatch.setenv(SECRET, MALFORMED_DSNS[0])
    defn = flows.definition({**flows.parquet_target("postgres", "results"), "options": {"dsn": {"secret": SECRET}}})
    with Platform(db_url) as platform:
        run = platform.runs.run_inline(flows.request(defn, tmp_path, "k1")).run
        with platform.db.read() as conn:
            stored = [repr(conn.execute(sa.text(f"SELECT * FROM {t}")).fetchall()) for t in flows.row_counts(platform)]
        kinds = flows.kinds(platform, run.run_id)
    assert PASSWORD not in str(run.error_message) and PASSWORD not in "\n".join(stored)
    assert (run.status, run.recovery_status, run.error_code) == ("failed", "no_external_output", "execution_failed")
    assert run.error_message == ("the sink's record tables cannot be looked up: cannot connect to the sink database: "
                                 "it is not a valid PostgreSQL connection string (conninfo)")
    assert "dispatch.authorized" not in kinds


def test_prepare_creates_the_record_tables_once_and_nothing_else(sink_dsn: str) -> None:
    """`prepare` creates sink_publications and sink_fences (not the target table: the first publication creates it
    from the result's schema); prepared again, or by 8 callers at once, it changes nothing and never fails."""
    assert record_tables(sink_dsn) == (False, False)
    PostgresTableProvider().prepare(target())
    assert record_tables(sink_dsn) == (True, True)
    with psycopg.connect(sink_dsn) as conn:
        assert conn.execute("SELECT to_regclass('results')").fetchone() == (None,)
    provider = PostgresTableProvider()
    assert provider.inspect("k", target(), fence=2) == Absent(2)
    barrier = threading.Barrier(8)

    def prepare(_: int) -> None:
        barrier.wait()
        provider.prepare(target())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(prepare, range(8)))
    assert provider.inspect("k", target()) == Absent(2)  # the fence survived every later prepare


def test_concurrent_first_preparers_on_a_fresh_database_all_succeed(sink_dsn: str) -> None:
    """8 preparers of a database without the record tables at once: creation is serialized, none fails."""
    barrier = threading.Barrier(8)

    def prepare(_: int) -> None:
        barrier.wait()
        PostgresTableProvider().prepare(target())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(prepare, range(8)))
    assert record_tables(sink_dsn) == (True, True)


def _assert_cannot_see(provider: PostgresTableProvider, key: str) -> None:
    """Inspect is Undecided (the record tables are missing) with and without a fence; publish is Inconclusive."""
    for fence in (None, 5):
        found = provider.inspect(key, target(), fence=fence)
        assert found == Undecided(f"postgres inspection of key {key!r}: {RECORD_TABLES_MISSING}")
        assert LOCATION_MISSING in found.reason
    with pytest.raises(Inconclusive) as caught:
        provider.publish(key, 6, rows(), sha256_bytes(key.encode()), target())
    assert caught.value.message == f"postgres publish of key {key!r}: {RECORD_TABLES_MISSING}"


@pytest.mark.parametrize("dropped", [("sink_publications", "sink_fences"), ("sink_fences",), ("sink_publications",)])
def test_record_tables_missing_after_a_publication_are_undecided_and_never_recreated(
    sink_dsn: str, dropped: tuple[str, ...]
) -> None:
    """K is published, then the record tables are gone (both, or one of them: a restore from before they existed,
    a careless cleanup): nothing can prove K absent, so inspect is Undecided with and without a fence, publish is
    Inconclusive, neither re-creates a table, and K's rows stay the only rows of the target table."""
    provider = prepared()
    assert isinstance(provider.publish("k", 1, rows(), sha256_bytes(b"k"), target()), Published)
    with psycopg.connect(sink_dsn) as conn:
        for name in dropped:
            conn.execute(f"DROP TABLE {name}")
    _assert_cannot_see(provider, "k")
    _assert_cannot_see(provider, "never-published")
    assert record_tables(sink_dsn) == ("sink_publications" not in dropped, "sink_fences" not in dropped)
    with psycopg.connect(sink_dsn) as conn:
        assert conn.execute("SELECT _publication_key, count(*) FROM results GROUP BY 1").fetchall() == [("k", 2)]


def test_an_inspection_of_another_database_is_undecided_and_the_right_one_still_proves(
    sink_dsn: str, postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DSN is pointed at another database (a restored copy from before the first run, a wrong host): the key
    published in the right one cannot be seen there, so inspect is Undecided and publish Inconclusive, and the
    other database is left without record tables or a target table; pointed back, inspect finds K present."""
    provider = prepared()
    published = provider.publish("k", 1, rows(), sha256_bytes(b"k"), target())
    assert isinstance(published, Published)
    other_name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
    other = postgres_server.create_database(other_name)
    try:
        monkeypatch.setenv(SECRET, other)
        _assert_cannot_see(provider, "k")
        other_dsn = other.replace("postgresql+psycopg://", "postgresql://")
        assert record_tables(other_dsn) == (False, False)
        with psycopg.connect(other_dsn) as conn:
            assert conn.execute("SELECT to_regclass('results')").fetchone() == (None,)
    finally:
        postgres_server.drop_database(other_name)
    monkeypatch.setenv(SECRET, sink_dsn)
    assert provider.inspect("k", target(), fence=5) == Present(published.refs, sha256_bytes(b"k"), 1)


def test_a_server_error_while_preparing_is_an_execution_error_with_a_fixed_reason(
    sink_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that may not create tables (read-only here) cannot prepare: an ExecutionError with a fixed
    description and the SQLSTATE (the run then fails before dispatch), and nothing is created."""
    monkeypatch.setenv(SECRET, f"{sink_dsn}?options=-c%20default_transaction_read_only%3Don")
    with pytest.raises(ExecutionError) as caught:
        PostgresTableProvider().prepare(target())
    assert caught.value.message == (
        "the sink's record tables cannot be created: the statement tried to write, which the read-only session "
        "forbids (SQLSTATE 25006)"
    )
    assert record_tables(sink_dsn) == (False, False)
