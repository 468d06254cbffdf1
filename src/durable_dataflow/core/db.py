"""The storage engine: one SQLAlchemy engine pair per database URL, on SQLite or PostgreSQL.

Times that matter for correctness (lease expiry, ledger timestamps) come from the database clock,
never from a worker's clock: :meth:`Database.now_us_expr` is a SQL expression evaluated by the
server inside the transaction that uses it. Tests may shift that clock with
:meth:`Database.advance_clock`, which adds an offset to the expression, so lease expiry can be
produced without sleeping.

Hot statements are built once per database (:meth:`Database.statement`) and take their values as
bind parameters: building a SQLAlchemy statement and computing its cache key cost more Python time
per run than sending it (issue 15, docs/performance.md).

SQLite runs in WAL mode with a busy timeout; every write transaction starts with
``BEGIN IMMEDIATE`` so two writers serialize at the start instead of failing at commit. Reads use
a second engine with deferred transactions, so readers never wait for the write lock.
"""

from __future__ import annotations

import functools
import os
import select
import urllib.parse
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.dml import UpdateBase

from durable_dataflow.core import credentials
from durable_dataflow.core.errors import InputError, StorageUnavailable
from durable_dataflow.core.invariants import invariant

DEFAULT_URL = "sqlite:///./.dataflow/dataflow.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_NOT_A_DATABASE = "file is not a database"  # sqlite3's message for a file of another kind
POSTGRES_POOL_SIZE = 8
POSTGRES_POOL_OVERFLOW = 16
POSTGRES_CONNECT_TIMEOUT_S = 10

Dialect = Literal["sqlite", "postgresql"]
Built = TypeVar("Built")
# Statements built by Database.statement and kept; past this many (shapes x clock offsets, which
# only tests change) the cache starts again.
STATEMENTS_CACHED_MAX = 256


def url_from_env(url: str | None = None) -> str:
    """The database URL: the explicit one, else ``DATAFLOW_DB``, else the embedded default."""
    return url or os.environ.get("DATAFLOW_DB") or DEFAULT_URL


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` and ``postgres://`` as the psycopg 3 driver; reject other schemes."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    if url.startswith(("sqlite:///", "postgresql+psycopg://")):
        return url
    raise InputError(
        f"database URL scheme is not supported: {redact_url(url)!r}; "
        "use sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
    )


_HIDDEN = "***"
UNPARSEABLE_URL = "<unparseable database URL>"


def redact_url(url: str) -> str:
    """The URL with its password and any credential-like query parameter replaced by ``***``, safe
    to print or log. Anything that is not a URL (a ``key=value`` conninfo string) is never echoed.

    This is the platform's one scrubber of connection strings; PostgreSQL sources and sinks never
    print theirs at all (``datasources.pgerrors`` describes a failure in fixed words)."""
    try:
        parsed = sa.engine.make_url(url)
    except (exc.ArgumentError, ValueError):
        return UNPARSEABLE_URL
    query = {
        # A query parameter whose value may be a credential (``?password=…``, ``sslpassword``, a token).
        name: _HIDDEN if credentials.is_credential_name(name) else value
        for name, value in parsed.query.items()
    }
    rendered = parsed.set(query=query).render_as_string(hide_password=True)
    return rendered.replace(urllib.parse.quote(_HIDDEN, safe=""), _HIDDEN)


@dataclass(frozen=True)
class StorageInfo:
    """What an operator needs to know about where the platform stores its state."""

    dialect: Dialect
    url_redacted: str


class Database:
    """One platform database: a write engine, a read engine and the database clock."""

    def __init__(self, url: str | None = None, *, clock_offset_s: float = 0.0) -> None:
        self.url = normalize_url(url_from_env(url))
        self.clock_offset_s = clock_offset_s
        try:
            sa_url = sa.engine.make_url(self.url)
        except (ValueError, exc.ArgumentError):  # e.g. an unclosed [ in the host: never echo the URL
            raise InputError(f"the database URL cannot be parsed: {redact_url(self.url)}") from None
        self.dialect: Dialect = "sqlite" if sa_url.get_backend_name() == "sqlite" else "postgresql"
        if self.dialect == "sqlite" and _sqlite_file(self.url) is None:
            # The write and read engines would each see their own empty database, gone at exit.
            raise InputError("an in-memory SQLite database cannot hold the platform: give a file, sqlite:///PATH")
        if self.dialect == "sqlite":
            self.engine = _sqlite_engine(self.url, immediate=True)
            self.read_engine = _sqlite_engine(self.url, immediate=False)
        else:
            self.engine = _postgres_engine(self.url)
            self.read_engine = self.engine
        self._statements: dict[tuple[Any, ...], Any] = {}
        self._disposed = False
        # Whether each ledger append also writes the entry's key to ``ledger_outbox`` (the Platform turns
        # it on when lineage is configured, docs/lineage.md); off, appends cost exactly what they did.
        self.ledger_outbox = False

    def files(self) -> tuple[Path, ...]:
        """The files that hold this database on this host (SQLite: the file and its journals)."""
        if self.dialect != "sqlite":
            return ()
        database = _sqlite_file(self.url)
        if database is None:
            return ()
        main = database.resolve()
        return (main, *(main.with_name(main.name + suffix) for suffix in ("-wal", "-shm", "-journal")))

    @property
    def info(self) -> StorageInfo:
        return StorageInfo(dialect=self.dialect, url_redacted=redact_url(self.url))

    def advance_clock(self, seconds: float) -> None:
        """Shift the database clock seen by this object (tests only: expire leases without sleeping)."""
        self.clock_offset_s += seconds

    def now_us_expr(self) -> sa.ColumnElement[int]:
        """The database clock in integer microseconds since the epoch, as a SQL expression."""
        offset_us = int(self.clock_offset_s * 1_000_000)
        if self.dialect == "sqlite":
            sql = f"(CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER) + {offset_us})"
        else:
            sql = f"(CAST(extract(epoch from clock_timestamp()) * 1000000 AS BIGINT) + {offset_us})"
        return sa.literal_column(sql, type_=sa.BigInteger())

    def statement(self, build: Callable[..., Built], *shape: Hashable) -> Built:
        """``build(self, *shape)``, built once for this database and its clock, then kept.

        For the statements every run executes: ``build`` makes one whose values are bind parameters
        (``sa.bindparam``, or the execution's parameters for an INSERT or UPDATE), so neither the
        statement nor its SQLAlchemy cache key is computed again. ``shape`` (hashable) selects among
        a builder's variants, e.g. the columns an UPDATE sets; it must never hold a value."""
        key = (build, self.clock_offset_s, *shape)
        built = self._statements.get(key)
        if built is None:
            if len(self._statements) >= STATEMENTS_CACHED_MAX:
                self._statements.clear()
            built = self._statements[key] = build(self, *shape)
        return built

    def now_us(self, conn: Connection) -> int:
        """Read the database clock inside an open transaction."""
        value = conn.execute(sa.select(self.now_us_expr())).scalar_one()
        return int(value)

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction; driver errors become :class:`StorageUnavailable` at this boundary."""
        self._check_open()
        with translate_errors(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction: it never takes the write lock and writes nothing.

        On PostgreSQL each statement runs on its own (autocommit), so a one-statement read (a
        replay's lookup) is one round trip instead of three (BEGIN, the read, ROLLBACK); at READ
        COMMITTED every statement of a transaction takes its own snapshot anyway, so a read sees what
        it saw before. What the ROLLBACK guaranteed, that nothing is written, :func:`_refuse_writes`
        now enforces before any statement is sent. SQLite keeps a deferred transaction: a snapshot
        for the whole read, without any round trip."""
        self._check_open()
        with translate_errors(), self.read_engine.connect() as conn:
            if self.dialect == "postgresql":
                conn.execution_options(isolation_level="AUTOCOMMIT", **{_READ_ONLY: True})
            yield conn
            conn.rollback()

    def _check_open(self) -> None:
        # After dispose() an engine would quietly open a fresh pool that nothing ever closes: its
        # connections leak until garbage collection. Using a disposed Database is a bug; say so here.
        invariant(not self._disposed, "the platform database was used after it was disposed")

    def dispose(self) -> None:
        """Close every pooled connection; the Database may not be used afterwards."""
        self._disposed = True
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()


def insert_if_absent(dialect: str, table: sa.Table, key: Sequence[str]) -> sa.Insert:
    """``INSERT INTO table … ON CONFLICT (key) DO NOTHING`` on ``dialect`` (a Database's, or a
    connection's ``dialect.name``), its values given with ``.values`` or the execution. Add
    ``RETURNING``: a row comes back only when this statement inserted it, on both engines."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as postgresql_insert

        return postgresql_insert(table).on_conflict_do_nothing(index_elements=list(key))
    invariant(dialect == "sqlite", f"the platform database is SQLite or PostgreSQL, not {dialect}")
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table).on_conflict_do_nothing(index_elements=list(key))


@contextmanager
def translate_errors() -> Iterator[None]:
    """Translate a lost or unreachable database into :class:`StorageUnavailable`, once, here."""
    try:
        yield
    except exc.OperationalError as error:
        raise StorageUnavailable(f"the platform database is unavailable: {_first_line(error)}") from error
    except exc.InterfaceError as error:
        raise StorageUnavailable(f"the database connection failed: {_first_line(error)}") from error
    except exc.DBAPIError as error:
        if SQLITE_NOT_A_DATABASE in _first_line(error):  # the URL names a file that is something else
            raise StorageUnavailable("the platform database's file is not a SQLite database") from error
        # The server ended the session (e.g. idle_in_transaction_session_timeout after a pause
        # surfaces as InternalError): the connection is gone, so this is an outage, not a bug.
        if not error.connection_invalidated:
            raise
        raise StorageUnavailable(f"the database ended the connection: {_first_line(error)}") from error


def _first_line(error: exc.DBAPIError) -> str:
    text = str(error.orig) if error.orig is not None else str(error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names, or None for an in-memory database."""
    parsed = sa.engine.make_url(url)
    database = parsed.database
    if database and database.startswith("file:") and str(parsed.query.get("uri", "")).lower() in ("true", "1"):
        # sqlite:///file:/path/db?uri=true: SQLite's URI filename, whose path is the file.
        database = urllib.parse.urlparse(database).path or None
    if not database or database == ":memory:":
        return None
    return Path(database)


def _sqlite_engine(url: str, *, immediate: bool) -> Engine:
    database = _sqlite_file(url)
    if database is not None:
        try:
            database.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file on the path, /proc, a name too long: the URL cannot work
            raise InputError(
                f"the SQLite database's folder {database.parent} cannot be created: {error.strerror or error}"
            ) from None
    engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite so BEGIN is ours to issue.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _postgres_engine(url: str) -> Engine:
    # No pool_pre_ping: a ping is a round trip on every checkout (3 of an inline run's ~20). A pooled
    # connection the server has ended (a restart, idle_session_timeout, pg_terminate_backend) is
    # noticed without one by _replace_ended_connection; one that dies later fails its statement, which
    # SQLAlchemy recognizes as a disconnect (the pool is invalidated) and translate_errors reports as
    # StorageUnavailable: the same as a connection lost mid-transaction with a ping.
    engine = sa.create_engine(
        url,
        pool_size=POSTGRES_POOL_SIZE,
        max_overflow=POSTGRES_POOL_OVERFLOW,
        connect_args={"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S, "cursor_factory": _described_once_cursor()},
    )
    event.listen(engine.pool, "checkout", _replace_ended_connection)
    event.listen(engine, "before_cursor_execute", _refuse_writes)
    return engine


@functools.cache
def _described_once_cursor() -> type[Any]:
    """psycopg's cursor, whose ``description`` is built once per result, of plain named tuples.

    psycopg builds a new list of ``Column`` objects each time ``description`` is read (each ``Column``
    looks its type up, and reads by index through an ``attrgetter``), and SQLAlchemy reads it two to four
    times for every statement and then each column's name and type code by index: a queued run read about
    120 ``Column`` objects, most of them of the runs table's wide ``RETURNING``. The description is now
    built once per result, as the DB-API's seven-item named tuples (``name`` and ``type_code`` as psycopg
    gives them, ``internal_size`` from the result, the sizes that need the type's catalog None), and built
    again only when the cursor holds another result (a new statement, ``nextset``). Only SQLAlchemy reads
    these cursors' descriptions (sources and sinks connect with psycopg's own cursors). psycopg is imported
    here, when an engine is made, so that commands that never open PostgreSQL do not pay for the import."""
    import psycopg
    from psycopg import pq

    with_rows = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.SINGLE_TUPLE, pq.ExecStatus.TUPLES_CHUNK)

    class DescribedOnceCursor(psycopg.Cursor[Any]):
        __slots__ = ("_described",)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._described: tuple[object, list[_Described] | None] | None = None

        # The kept description holds its result (all its rows): let it go when psycopg does.
        def execute(self, *args: Any, **kwargs: Any) -> Any:
            self._described = None
            return super().execute(*args, **kwargs)

        def executemany(self, *args: Any, **kwargs: Any) -> None:
            self._described = None
            super().executemany(*args, **kwargs)

        def close(self) -> None:
            self._described = None
            super().close()

        @property
        def description(self) -> Any:  # DB-API sequences, not psycopg.Column (see above)
            result, described = self.pgresult, self._described
            if described is None or described[0] is not result:
                described = self._described = (result, self._describe())
            return described[1]

        def _describe(self) -> list[_Described] | None:
            result = self.pgresult
            if result is None or not (result.nfields or result.status in with_rows):  # as psycopg decides
                return None
            encoding = self.connection.info.encoding
            return [_Described(_field_name(result.fname(i), i, encoding), result.ftype(i), None,
                               size if (size := result.fsize(i)) >= 0 else None, None, None, None)
                    for i in range(result.nfields)]  # fmt: skip

    return DescribedOnceCursor


class _Described(NamedTuple):
    """One column of a PostgreSQL result, as the DB-API describes it (``_described_once_cursor``)."""

    name: str
    type_code: int
    display_size: int | None
    internal_size: int | None
    precision: int | None
    scale: int | None
    null_ok: bool | None


def _field_name(raw: bytes | None, index: int, encoding: str) -> str:
    return raw.decode(encoding) if raw else f"column_{index + 1}"  # a COPY's columns have no name (psycopg's rule)


_READ_ONLY = "dataflow_read_only"  # execution option of the connections Database.read() hands out
_READ_VERBS = ("SELECT", "WITH", "SHOW")


def _refuse_writes(conn: Connection, _cursor: Any, statement: str, _params: Any, context: Any, _many: bool) -> None:
    """A statement that may write, on a read connection (autocommit on PostgreSQL), is a bug: refuse
    it before it is sent, as the ROLLBACK that ended a read transaction would have undone it."""
    if not conn.get_execution_options().get(_READ_ONLY):
        return
    writes = context is not None and (context.isinsert or context.isupdate or context.isdelete or context.isddl)
    ctes = getattr(getattr(context, "compiled", None), "ctes", None) or ()
    writes = writes or any(isinstance(cte.element, UpdateBase) for cte in ctes)  # WITH … AS (INSERT …) SELECT
    verb = statement.lstrip()[:6].upper()
    invariant(not writes and verb.startswith(_READ_VERBS), f"a read-only connection may not run {verb!r}")


def _replace_ended_connection(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Refuse a pooled connection whose server side has ended, so the pool replaces it (one system call).

    An idle connection between transactions has nothing to read: the server sends nothing unprompted
    except when it ends the session (an error message, then end of file) or, rarely, a parameter
    change after a configuration reload. So a readable socket means the session ended, or costs one
    needless reconnect; raising DisconnectionError makes the pool connect afresh for this checkout.
    """
    try:
        ended = bool(dbapi_connection.closed or dbapi_connection.broken) or bool(
            select.select([dbapi_connection.fileno()], [], [], 0)[0]
        )
    except Exception:  # no socket any more (the driver's or the OS's error): connect afresh
        ended = True
    if ended:
        raise exc.DisconnectionError("the server ended this pooled connection")
