"""PostgreSQL table provider (psycopg 3): rows and the publication record in one sink transaction.

In the sink database, beside the target table:
- `sink_publications(idempotency_key PK, digest, token, row_count, table_name, published_at,
  xact_id)` — one row per published key, inserted in the same transaction as the data rows, so
  the key lookup is a conclusive proof (reference/sinks-and-libs.md §6);
- `sink_fences(idempotency_key PK, token)` — the fence an inspection recorded for an absent key.
- `sink_partitions(table_name, partition_key, token)` — for `mode: replace_partition`, the highest
  partition token applied to each partition of a table (`partition_key`: the digest of its values).
`prepare` creates these record tables before dispatch is authorized; `publish` and `inspect` never
create them. Missing later, the DSN reaches another database than the one published to, or one
restored from before they existed, so nothing can be proven: `publish` raises `Inconclusive` and
`inspect` answers `Undecided` (RECORD_TABLES_MISSING, which contains LOCATION_MISSING), never `Absent`.
Every publish and every inspection first takes `pg_advisory_xact_lock` on the key, so publishers
and inspectors of one key serialize; in READ COMMITTED each later statement sees what the
previous lock holder committed. A lost connection or an error at COMMIT is `Inconclusive`; a
server error before COMMIT rolled the whole transaction back and is a conclusive `Rejected`.
The DSN is a `{"secret": NAME}` reference in `target.options["dsn"]`, resolved per call. No driver
text reaches a message (libpq's connection errors quote segments of the DSN, server messages quote
values): each is a fixed description plus the SQLSTATE, or the kind of connection failure (`pgerrors`).
`target.location` is the table name (`table` or `schema.table`).
A partitioned publish (`mode: replace_partition`) does in that one transaction, after the key's lock
and checks: `pg_advisory_xact_lock` on the table and partition (concurrent publishers of a partition
serialize), the partition's token read from `sink_partitions` — a lower token than the one applied is
`Rejected` (`contract.SUPERSEDED`), nothing written — and raised, `DELETE` of the partition's rows (the
values passed as typed parameters), COPY of the rows and the record row. Readers see the old partition
or the new one. The identity `locate` reports covers sink_publications and sink_fences only.
Proof horizon: as long as `sink_publications` rows are kept (prune them only with their data).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.datasources import pgerrors
from durable_dataflow.datasources.contract import (
    LOCATION_MISSING,
    Absent,
    AlreadyPublished,
    Capability,
    Fenced,
    Inconclusive,
    InspectOutcome,
    InvalidTarget,
    Location,
    Present,
    PublicationRefs,
    Published,
    PublishOutcome,
    PublishTarget,
    Rejected,
    Undecided,
    check_key,
    check_token,
    partition_of,
    partition_values,
    superseded,
)

CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_MS = 60_000
READ_ROWS_MAX = 1_000_000
# Key of the advisory lock that serializes creating the bookkeeping tables.
BOOKKEEPING_LOCK_ID = 0x44_46_4C_57  # "DFLW"
KEY_COLUMN = "_publication_key"
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")

_CREATE_BOOKKEEPING = (
    """CREATE TABLE IF NOT EXISTS sink_publications (
         idempotency_key text PRIMARY KEY, digest text NOT NULL, token bigint NOT NULL,
         row_count bigint NOT NULL, table_name text NOT NULL,
         published_at timestamptz NOT NULL DEFAULT now(),
         xact_id xid8 NOT NULL DEFAULT pg_current_xact_id())""",
    "CREATE TABLE IF NOT EXISTS sink_fences (idempotency_key text PRIMARY KEY, token bigint NOT NULL)",
    """CREATE TABLE IF NOT EXISTS sink_partitions (table_name text NOT NULL, partition_key text NOT NULL,
         token bigint NOT NULL, PRIMARY KEY (table_name, partition_key))""",
)
# All of them, sink_partitions included (a database prepared before partitions lacks it: prepare adds it).
_BOOKKEEPING_COMPLETE = (
    "SELECT to_regclass('sink_publications') IS NOT NULL AND to_regclass('sink_fences') IS NOT NULL"
    " AND to_regclass('sink_partitions') IS NOT NULL"
)
_SELECT_PARTITION = "SELECT token FROM sink_partitions WHERE table_name = %s AND partition_key = %s"
_RAISE_PARTITION = """INSERT INTO sink_partitions (table_name, partition_key, token) VALUES (%s, %s, %s)
  ON CONFLICT (table_name, partition_key) DO UPDATE SET token = GREATEST(sink_partitions.token, EXCLUDED.token)"""
_BOOKKEEPING_PRESENT = (
    "SELECT to_regclass('sink_publications') IS NOT NULL AND to_regclass('sink_fences') IS NOT NULL"
)
# Why publish and inspect prove nothing without the record tables (`prepare` created them before any
# dispatch was authorized); it contains LOCATION_MISSING, by which the platform recognizes the case.
RECORD_TABLES_MISSING = (
    "the sink's record tables are missing: sink_publications and sink_fences are not both in the "
    "database the DSN reaches, which may be another database than the one published to or one "
    f"restored from before they were created; {LOCATION_MISSING}"
)
# What names the record tables `prepare` created: the cluster's system identifier, the database's oid
# and the two tables' oids (a restore by pg_dump, or the tables dropped and created again, changes them).
_RECORD_TABLES_IDENTITY = """SELECT (SELECT system_identifier::text FROM pg_control_system()),
  (SELECT oid::text FROM pg_database WHERE datname = current_database()),
  to_regclass('sink_publications')::oid::text, to_regclass('sink_fences')::oid::text"""
_LOCK_KEY = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
_SELECT_PUBLICATION = (
    "SELECT digest, token, table_name, xact_id::text FROM sink_publications WHERE idempotency_key = %s"
)
_SELECT_FENCE = "SELECT token FROM sink_fences WHERE idempotency_key = %s"
_RAISE_FENCE = """INSERT INTO sink_fences (idempotency_key, token) VALUES (%s, %s)
  ON CONFLICT (idempotency_key) DO UPDATE SET token = GREATEST(sink_fences.token, EXCLUDED.token)
  RETURNING token"""
_INSERT_PUBLICATION = """INSERT INTO sink_publications (idempotency_key, digest, token, row_count, table_name)
  VALUES (%s, %s, %s, %s, %s) RETURNING xact_id::text"""


def _pg_type(dtype: pa.DataType) -> str | None:
    """The PostgreSQL column type for an Arrow type, or None when unsupported."""
    simple: Mapping[pa.DataType, str] = {
        pa.bool_(): "boolean", pa.int8(): "smallint", pa.int16(): "smallint", pa.int32(): "integer",
        pa.int64(): "bigint", pa.uint8(): "smallint", pa.uint16(): "integer", pa.uint32(): "bigint",
        pa.uint64(): "numeric(20,0)", pa.float32(): "real", pa.float64(): "double precision",
        pa.string(): "text", pa.large_string(): "text", pa.binary(): "bytea",
        pa.large_binary(): "bytea", pa.date32(): "date", pa.date64(): "date",
    }  # fmt: skip
    if dtype in simple:
        return simple[dtype]
    if pa.types.is_decimal(dtype):
        return f"numeric({dtype.precision},{dtype.scale})"
    if pa.types.is_timestamp(dtype):
        return "timestamptz" if dtype.tz is not None else "timestamp"
    if pa.types.is_time(dtype):
        return "time"
    return None


class _CannotConnect(Exception):
    """Connecting to the sink failed. The message is a fixed description, never the driver's text."""

    def __init__(self, exc: psycopg.Error, dsn: str) -> None:
        super().__init__(f"cannot connect to the sink database: {pgerrors.describe_connect(exc, dsn)}")


def _open(dsn: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT_S, autocommit=False)
    except psycopg.Error as exc:
        raise _CannotConnect(exc, dsn) from None


@dataclass(frozen=True)
class _TableName:
    schema: str | None
    name: str

    @staticmethod
    def parse(location: str) -> _TableName:
        parts = location.split(".")
        if len(parts) > 2 or not all(IDENTIFIER.match(p) for p in parts):
            raise InvalidTarget("the postgres target location must be 'table' or 'schema.table' identifiers")
        return _TableName(parts[0], parts[1]) if len(parts) == 2 else _TableName(None, parts[0])

    def ident(self) -> sql.Composable:
        if self.schema is None:
            return sql.Identifier(self.name)
        return sql.Identifier(self.schema, self.name)

    def text(self) -> str:
        return self.name if self.schema is None else f"{self.schema}.{self.name}"


def _resolve_dsn(target: PublishTarget) -> str:
    ref = target.options.get("dsn")
    if not (isinstance(ref, Mapping) and isinstance(ref.get("secret"), str)):
        raise InputError("postgres target option 'dsn' must be a secret reference {'secret': NAME}")
    dsn = target.secrets.resolve(ref["secret"]).reveal()
    # SQLAlchemy-style URLs (postgresql+psycopg://) are accepted for convenience.
    return re.sub(r"^postgresql\+\w+://", "postgresql://", dsn)


class PostgresTableProvider:
    """Publishes rows into a PostgreSQL table with a keyed publication record in the same transaction."""

    name = "postgres"
    capabilities: frozenset[Capability] = frozenset({"publish", "inspect", "replace_partition"})

    @contextmanager
    def _connect(self, dsn: str) -> Iterator[psycopg.Connection[Any]]:
        conn = _open(dsn)
        try:
            yield conn
        finally:
            conn.close()

    def _create_bookkeeping(self, conn: psycopg.Connection[Any]) -> None:
        """Create the bookkeeping tables when missing, serialized so concurrent preparers do not collide."""
        conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        complete = conn.execute(_BOOKKEEPING_COMPLETE).fetchone()
        if complete is not None and complete[0] is True:
            conn.commit()
            return
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (BOOKKEEPING_LOCK_ID,))
        for statement in _CREATE_BOOKKEEPING:
            conn.execute(statement)
        conn.commit()

    def _has_bookkeeping(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(_BOOKKEEPING_PRESENT).fetchone()
        return row is not None and row[0] is True

    def _refs(self, dbname: str, key: str, table_name: str, xact_id: str) -> PublicationRefs:
        return PublicationRefs(
            publication_ref=f"postgres://{dbname}/sink_publications#{key}",
            datasource_ref=f"postgres://{dbname}/{table_name}",
            materialization_ref=f"postgres://{dbname}/{table_name}@xact{xact_id}",
        )

    def preflight(self, target: PublishTarget) -> None:
        """What is knowable without connecting: the table name parses and the DSN secret resolves
        (its value is read and dropped)."""
        _TableName.parse(target.location)
        _resolve_dsn(target)

    def prepare(self, target: PublishTarget) -> None:
        """Create the record tables in the sink database before dispatch is authorized
        (`contract.prepare`), so that their absence later is "cannot see it", never "nothing published".
        The target table is created by the first publication (from the result's schema, atomically with
        its record). `InputError` as in `preflight`; a failed connect or a server error is an
        `ExecutionError` with a fixed description (the run then fails before dispatch)."""
        _TableName.parse(target.location)
        dsn = _resolve_dsn(target)
        failed = "the sink's record tables cannot be created"
        try:
            with self._connect(dsn) as conn:
                self._create_bookkeeping(conn)
        except _CannotConnect as exc:
            raise ExecutionError(f"{failed}: {exc}") from None
        except psycopg.Error as exc:
            raise ExecutionError(f"{failed}: {pgerrors.describe(exc)}") from None

    def locate(self, target: PublishTarget) -> Location:
        """The database the DSN reaches and the table (`contract.locate`), and the record tables'
        identity there: the system identifier, the database's oid and their oids; None when they are
        missing. Nothing is created. A failed connect or a server error is an `ExecutionError`."""
        table_name = _TableName.parse(target.location)
        dsn = _resolve_dsn(target)
        failed = "the sink's record tables cannot be looked up"
        try:
            with self._connect(dsn) as conn:
                info = conn.info
                place = f"postgres:{info.host}:{info.port}/{info.dbname}/{table_name.text()}"
                row = conn.execute(_RECORD_TABLES_IDENTITY).fetchone()
                conn.rollback()
        except _CannotConnect as exc:
            raise ExecutionError(f"{failed}: {exc}") from None
        except psycopg.Error as exc:
            raise ExecutionError(f"{failed}: {pgerrors.describe(exc)}") from None
        if row is None or row[2] is None or row[3] is None:
            return Location(place, None)
        return Location(place, f"postgres-records:{row[0]}:{row[1]}:{row[2]}:{row[3]}")

    def publish(
        self, key: str, token: int, table: pa.Table, digest: str, target: PublishTarget
    ) -> PublishOutcome:
        """Lock the key, check publication and fence, write rows + record, COMMIT (DESIGN §9).

        `InputError` (key, token, table name, DSN secret) is raised before connecting to the sink."""
        check_key(key)
        check_token(token)
        table_name = _TableName.parse(target.location)
        if target.mode == "replace_partition":
            partition_values(partition_of(target)[0], table.schema)  # refused here, before connecting
        dsn = _resolve_dsn(target)
        try:
            conn = _open(dsn)
        except _CannotConnect as exc:
            # No session was ever established, so no transaction could have written anything.
            return Rejected(str(exc))
        try:
            return self._publish_on(conn, key, token, table, digest, target, table_name)
        finally:
            conn.close()

    def _publish_on(
        self,
        conn: psycopg.Connection[Any],
        key: str,
        token: int,
        table: pa.Table,
        digest: str,
        target: PublishTarget,
        table_name: _TableName,
    ) -> PublishOutcome:
        try:
            conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
            prepared = self._has_bookkeeping(conn)
            if prepared:
                conn.execute(_LOCK_KEY, (key,))
                outcome = self._decide_and_write(conn, key, token, table, digest, target, table_name)
        except psycopg.OperationalError as exc:
            # The connection failed mid-transaction: conservative, let an inspection decide.
            raise Inconclusive(f"postgres publish of key {key!r}: {pgerrors.describe(exc)}") from None
        except psycopg.Error as exc:
            # A server error before COMMIT aborted the transaction: nothing was written.
            conn.rollback()
            return Rejected(f"the sink refused the publication: {pgerrors.describe(exc)}")
        if not prepared:
            # `prepare` created them before dispatch was authorized: missing now, this may be another or a
            # restored database, and the key's publication may be in the one published to. Nothing written.
            conn.rollback()
            raise Inconclusive(f"postgres publish of key {key!r}: {RECORD_TABLES_MISSING}")
        if not isinstance(outcome, Published):
            conn.rollback()
            return outcome
        try:
            conn.commit()
        except Exception as exc:
            # The COMMIT may or may not have happened: never retry blindly, inspect instead.
            raise Inconclusive(f"postgres COMMIT of key {key!r} unknown: {pgerrors.describe(exc)}") from None
        return outcome

    def _decide_and_write(
        self,
        conn: psycopg.Connection[Any],
        key: str,
        token: int,
        table: pa.Table,
        digest: str,
        target: PublishTarget,
        table_name: _TableName,
    ) -> PublishOutcome:
        dbname = conn.info.dbname
        row = conn.execute(_SELECT_PUBLICATION, (key,)).fetchone()
        if row is not None:
            return AlreadyPublished(self._refs(dbname, key, row[2], row[3]), row[0])
        fence_row = conn.execute(_SELECT_FENCE, (key,)).fetchone()
        if fence_row is not None and token < int(fence_row[0]):
            return Fenced(int(fence_row[0]))
        problem = self._prepare_table(conn, table_name, table.schema)
        if problem is not None:
            return Rejected(problem)
        if target.mode == "overwrite":
            conn.execute(sql.SQL("DELETE FROM {}").format(table_name.ident()))
        if target.mode == "replace_partition":
            refused = self._replace_partition(conn, table_name, table.schema, target)
            if refused is not None:
                return refused
        self._copy_rows(conn, table_name, table, key)
        inserted = conn.execute(
            _INSERT_PUBLICATION, (key, digest, token, table.num_rows, table_name.text())
        ).fetchone()
        if inserted is None:
            raise psycopg.DataError("the publication record was not inserted")
        return Published(self._refs(dbname, key, table_name.text(), inserted[0]), digest)

    def _replace_partition(
        self, conn: psycopg.Connection[Any], table_name: _TableName, schema: pa.Schema, target: PublishTarget
    ) -> Rejected | None:
        """Under the partition's lock: refuse a token below the one applied (nothing written), else
        raise it and delete the partition's rows, in the publish's transaction."""
        partition, token = partition_of(target)
        values = partition_values(partition, schema)
        partition_key = hashing.digest(dict(partition))
        conn.execute(_LOCK_KEY, (f"partition:{table_name.text()}:{partition_key}",))
        row = conn.execute(_SELECT_PARTITION, (table_name.text(), partition_key)).fetchone()
        if row is not None and token < int(row[0]):
            return superseded(int(row[0]))
        conn.execute(_RAISE_PARTITION, (table_name.text(), partition_key, token))
        match = sql.SQL(" AND ").join(sql.SQL("{} = %s").format(sql.Identifier(column)) for column in values)
        conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(table_name.ident(), match), list(values.values()))
        return None

    def _columns(self, conn: psycopg.Connection[Any], table_name: _TableName) -> list[str] | None:
        regclass = conn.execute("SELECT to_regclass(%s)::oid", (table_name.text(),)).fetchone()
        if regclass is None or regclass[0] is None:
            return None
        rows = conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped"
            " ORDER BY attnum",
            (regclass[0],),
        ).fetchall()
        return [r[0] for r in rows]

    def _prepare_table(
        self, conn: psycopg.Connection[Any], table_name: _TableName, schema: pa.Schema
    ) -> str | None:
        """Create the target table when missing; return why the schema does not fit, or None."""
        columns = self._columns(conn, table_name)
        if columns is None:
            conn.execute(_LOCK_KEY, ("table:" + table_name.text(),))
            columns = self._columns(conn, table_name)
        if columns is None:
            defs = [sql.SQL("{} text NOT NULL").format(sql.Identifier(KEY_COLUMN))]
            for field in schema:
                pg_type = _pg_type(field.type)
                if pg_type is None:
                    return f"column {field.name!r} has Arrow type {field.type} with no PostgreSQL mapping"
                defs.append(sql.SQL("{} {}").format(sql.Identifier(field.name), sql.SQL(pg_type)))
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(table_name.ident(), sql.SQL(", ").join(defs)))
            return None
        missing = [name for name in schema.names if name not in columns]
        if missing:
            return f"table {table_name.text()} has no columns {missing}"
        return None

    def _copy_rows(
        self, conn: psycopg.Connection[Any], table_name: _TableName, table: pa.Table, key: str
    ) -> None:
        columns = self._columns(conn, table_name) or []
        with_key = KEY_COLUMN in columns
        names = ([KEY_COLUMN] if with_key else []) + list(table.schema.names)
        statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
            table_name.ident(), sql.SQL(", ").join(sql.Identifier(n) for n in names)
        )
        with conn.cursor().copy(statement) as copy:
            for row in table.to_pylist():
                values = [row[n] for n in table.schema.names]
                copy.write_row(([key] if with_key else []) + values)

    def inspect(self, key: str, target: PublishTarget, fence: int | None = None) -> InspectOutcome:
        """Look the key up under its lock; with a fence, raise it in the same transaction.

        Missing record tables are `Undecided` (RECORD_TABLES_MISSING) and are not created."""
        check_key(key)
        if fence is not None:
            check_token(fence, "fence")
        dsn = _resolve_dsn(target)
        failed = f"postgres inspection of key {key!r} failed"
        try:
            with self._connect(dsn) as conn:
                conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
                if not self._has_bookkeeping(conn):
                    # Created by `prepare` before dispatch was authorized: missing now means unseen, never absent.
                    conn.rollback()
                    return Undecided(f"postgres inspection of key {key!r}: {RECORD_TABLES_MISSING}")
                conn.execute(_LOCK_KEY, (key,))
                outcome = self._inspect_on(conn, key, fence)
                conn.commit()  # Absent(fenced_at=m) is reported only once the fence is durable
                return outcome
        except _CannotConnect as exc:
            return Undecided(f"{failed}: {exc}")
        except Exception as exc:
            return Undecided(f"{failed}: {pgerrors.describe(exc)}")

    def _inspect_on(self, conn: psycopg.Connection[Any], key: str, fence: int | None) -> InspectOutcome:
        row = conn.execute(_SELECT_PUBLICATION, (key,)).fetchone()
        if row is not None:
            return Present(self._refs(conn.info.dbname, key, row[2], row[3]), row[0], int(row[1]))
        if fence is None:
            fence_row = conn.execute(_SELECT_FENCE, (key,)).fetchone()
            return Absent(None if fence_row is None else int(fence_row[0]))
        raised = conn.execute(_RAISE_FENCE, (key, fence)).fetchone()
        if raised is None:
            raise psycopg.DataError("the fence was not recorded")
        return Absent(int(raised[0]))

    def read(self, target: PublishTarget) -> pa.Table:
        """The target table's rows (at most READ_ROWS_MAX), without the key column.

        Not part of the contract (no capability; the platform never reads a sink): the tests read
        the sink with it."""
        table_name = _TableName.parse(target.location)
        dsn = _resolve_dsn(target)
        failed = f"reading postgres table {table_name.text()} failed"
        try:
            with self._connect(dsn) as conn:
                cur = conn.execute(sql.SQL("SELECT * FROM {} LIMIT %s").format(table_name.ident()), (READ_ROWS_MAX,))
                names = [d.name for d in cur.description or []]
                rows = cur.fetchall()
        except _CannotConnect as exc:
            raise ExecutionError(f"{failed}: {exc}") from None
        except psycopg.Error as exc:
            raise ExecutionError(f"{failed}: {pgerrors.describe(exc)}") from None
        data = {n: [r[i] for r in rows] for i, n in enumerate(names) if n != KEY_COLUMN}
        return pa.table(data)
