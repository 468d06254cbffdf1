"""A PostgreSQL source: one read-only query streamed through a server-side cursor into Arrow batches.

Three lines of defence keep the query from writing or escaping:
- ``check_query`` (called by ``execution.compute.preflight``, before the run is recorded) parses the query with
  sqlglot's PostgreSQL dialect and admits exactly one read statement: SELECT, WITH … SELECT, VALUES or
  TABLE, with no data-modifying CTE, no SELECT INTO and no FOR UPDATE/SHARE;
- the session is read-only from its first statement: ``default_transaction_read_only``, the time limits
  and ``standard_conforming_strings`` are connection (startup) options, so no COMMIT inside the query
  can shed them, and ``statement_timeout`` is set again to the time left before every FETCH, so a query
  that turns it off only gains until its next batch; the execution's watch thread also cancels it;
- the query runs as ``DECLARE … CURSOR FOR <query>``, sent by psycopg through the extended protocol,
  where the server refuses a string of several statements and a cursor refuses a data-modifying one.

The DSN is resolved from its secret only inside ``_stream_postgres`` and passed only to the driver. No
driver text leaves this module: errors are a fixed description and the SQLSTATE (``pgerrors``). The
result is digested as it streams (the source's fingerprint) and bounded by the source byte limit.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, LimitExceeded
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.dataflow.definitions.definitions import PostgresSource, SourceSpec, parse_arrow_type
from durable_dataflow.dataflow.execution import arrowdigest
from durable_dataflow.datasources import pgerrors

POSTGRES_CONNECT_TIMEOUT_S = 10
POSTGRES_FETCH_BATCH_ROWS = 10_000  # at most, per FETCH
POSTGRES_FIRST_FETCH_ROWS = 100  # the first FETCH learns the row width; later ones follow it
POSTGRES_FETCH_BATCH_BYTES = 8 * 1024 * 1024  # a FETCH is sized to about this many Arrow bytes
POSTGRES_QUERY_CANCELED = pgerrors.QUERY_CANCELED  # SQLSTATE of statement_timeout and of a cancel request
POSTGRES_LOCK_TIMEOUT_MS = 10_000  # a lock wait ends sooner than this when less time is left
POSTGRES_DSN_OPTION_WORDS_MAX = 64  # words in the DSN's own `options`
POSTGRES_CURSOR_NAME = "dataflow_source"

# Settings the source gives every session; a DSN whose `options` sets one of them is refused.
SESSION_SETTINGS = (
    "default_transaction_read_only", "statement_timeout", "idle_in_transaction_session_timeout",
    "lock_timeout", "standard_conforming_strings",
)  # fmt: skip
# The session must show these before the query is declared (a pooler may drop startup options).
_SESSION_CHECK = (
    "SELECT current_setting('transaction_read_only'), current_setting('default_transaction_read_only'), "
    "current_setting('standard_conforming_strings')"
)
# True when the session's role is a superuser or may reach the server's files or programs.
_SERVER_FILES_ROLE = (
    "SELECT rolsuper OR pg_has_role(current_user, 'pg_read_server_files', 'MEMBER') "
    "OR pg_has_role(current_user, 'pg_write_server_files', 'MEMBER') "
    "OR pg_has_role(current_user, 'pg_execute_server_program', 'MEMBER') "
    "FROM pg_roles WHERE rolname = current_user"
)
_SET_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, false)"
_OPTION_SPACE = " \t\n\r\v\f"  # what PostgreSQL's pg_split_opts splits `options` on (isspace)

# PostgreSQL type OIDs with a fixed Arrow type; numeric is typed from its declared precision.
_PG_ARROW_TYPES: dict[int, pa.DataType] = {
    16: pa.bool_(), 20: pa.int64(), 21: pa.int16(), 23: pa.int32(), 25: pa.string(),
    700: pa.float32(), 701: pa.float64(), 1042: pa.string(), 1043: pa.string(),
    1082: pa.date32(), 1114: pa.timestamp("us"), 1184: pa.timestamp("us", tz="UTC"),
}
_PG_NUMERIC_OID = 1700


@dataclass
class PostgresStream:
    """A query streamed from PostgreSQL in batches; the fingerprint is known once it has been read."""

    spec: PostgresSource
    source: str
    bytes_max: int
    time_limit_s: float
    # The run's secret scope: the DSN resolves here, at connection time, never earlier.
    secrets: SecretScope
    fingerprint: str | None = None
    bytes_read: int = 0
    # The engine wraps an error raised inside the iterator in its own; the original is kept here.
    failure: DataflowError | None = None
    _close: Callable[[], None] | None = None
    _cancel: Callable[[], None] | None = None
    # The execution's time counts from the source's resolution (execute and the run service resolve
    # sources right after their deadline starts), so the time left here is never less than the
    # execution's: the server-side timeouts are a backstop behind the watch thread's cancel.
    created_at: float = field(default_factory=time.monotonic)

    def batches(self) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """The result's schema and its batches; call ``close()`` when done, read or not."""
        return _stream_postgres(self)

    def time_left_ms(self) -> int:
        """Milliseconds of the time limit left (at most the limit), for the session's timeouts."""
        return int((self.time_limit_s - (time.monotonic() - self.created_at)) * 1000)

    def exceeded(self) -> LimitExceeded:
        return LimitExceeded(f"source {self.source!r} exceeded the time limit of {self.time_limit_s:g} s")

    def cancel(self) -> None:
        """Ask the server to cancel the running query (the time limit ran out); safe from any thread."""
        cancel = self._cancel
        if cancel is not None:
            cancel()

    def close(self) -> None:
        """Close the cursor and the connection (idempotent; the iterator also closes them at its end)."""
        close, self._close = self._close, None
        if close is not None:
            close()


def check_query(name: str, spec: SourceSpec) -> None:
    """Refuse, before anything is recorded, a postgres source's query that is not exactly one read statement.

    sqlglot's PostgreSQL tokenizer reads quotes, dollar quotes and (nested) comments as the server does
    with ``standard_conforming_strings`` on, which the session enforces; whatever it cannot read is
    refused. Messages name the source and the rule, never the query.
    """
    if not isinstance(spec, PostgresSource):
        return
    from durable_dataflow.dataflow.execution import pgquery  # sqlglot costs ~0.3 s to import: only when needed

    rule = pgquery.rule_broken(spec.query)
    if rule is not None:
        raise InputError(f"source {name!r}: the postgres query {rule}")


def _split_options(text: str) -> list[str]:
    """libpq's `options` as PostgreSQL splits it (pg_split_opts): on spaces, a backslash escapes."""
    words: list[str] = []
    word: list[str] | None = None  # None between words
    escaped = False
    for ch in text:
        if not escaped and ch in _OPTION_SPACE:
            if word is not None:
                words.append("".join(word))
            word = None
            continue
        if word is None:
            word = []
        if not escaped and ch == "\\":
            escaped = True
        else:
            word.append(ch)
            escaped = False
    if word is not None:
        words.append("".join(word))
    return words


def _dsn_settings(text: str) -> list[tuple[str, str]] | None:
    """The (name, value) settings of a DSN's `options` (``-c name=value``, ``-cname=value`` or
    ``--name=value``), or None when it holds anything else or more than the word limit."""
    words = _split_options(text)
    if len(words) > POSTGRES_DSN_OPTION_WORDS_MAX:
        return None
    settings: list[tuple[str, str]] = []
    index = 0
    while index < len(words):  # ends: every branch consumes at least one word
        word = words[index]
        if word == "-c" and index + 1 < len(words):
            assignment, index = words[index + 1], index + 2
        elif word.startswith(("-c", "--")) and len(word) > 2:
            assignment, index = word[2:], index + 1
        else:
            return None
        name, equals, value = assignment.partition("=")
        if not equals or not name:
            return None
        settings.append((name.replace("-", "_").lower(), value))
    return settings


def _escape_option(text: str) -> str:
    return "".join("\\" + ch if ch in _OPTION_SPACE or ch == "\\" else ch for ch in text)


def _session_options(stream: PostgresStream, own_options: str) -> str:
    """The connection's `options`: the DSN's own settings, then the source's (which the DSN may not set)."""
    prefix = f"source {stream.source!r}: the DSN in secret {stream.spec.dsn.secret!r}"
    settings = _dsn_settings(own_options)
    if settings is None:
        raise ExecutionError(f"{prefix} has `options` other than settings (-c name=value)")
    taken = sorted({n for n, _ in settings if n in SESSION_SETTINGS})
    if taken:
        raise ExecutionError(f"{prefix} sets {', '.join(taken)} in its `options`, which the source sets itself")
    left_ms = stream.time_left_ms()
    if left_ms <= 0:
        raise stream.exceeded()
    ours = {
        "default_transaction_read_only": "on",
        "statement_timeout": str(left_ms),
        "idle_in_transaction_session_timeout": str(left_ms),
        "lock_timeout": str(min(left_ms, POSTGRES_LOCK_TIMEOUT_MS)),
        "standard_conforming_strings": "on",
    }
    invariant(set(ours) == set(SESSION_SETTINGS), "the source sets exactly its SESSION_SETTINGS")
    return " ".join(f"-c {_escape_option(f'{n}={v}')}" for n, v in [*settings, *ours.items()])


def _pg_arrow_type(column: Any) -> pa.DataType | None:
    if column.type_code == _PG_NUMERIC_OID:
        if column.precision and column.precision <= 38:
            return pa.decimal128(column.precision, column.scale or 0)
        return None  # unconstrained numeric: inferred from the first batch's values
    return _PG_ARROW_TYPES.get(column.type_code, pa.string())


def _pg_batch(name: str, columns: list[Any], rows: list[tuple[Any, ...]], schema: pa.Schema | None) -> pa.RecordBatch:
    """rows as a record batch; with a schema (from the first batch) every batch has that schema."""
    arrays = []
    for index, column in enumerate(columns):
        t = schema.field(index).type if schema is not None else _pg_arrow_type(column)
        values = [row[index] for row in rows]
        if t is not None and pa.types.is_string(t):  # json/jsonb arrive decoded: give them back as JSON text
            values = [None if v is None else json.dumps(v) if isinstance(v, dict | list) else str(v) for v in values]
        try:
            array = pa.array(values, type=t)
            if t is None and pa.types.is_decimal128(array.type):
                # An unconstrained numeric is typed by the first batch: keep its scale, widen the
                # precision to the most decimal128 holds, so larger values in later batches still fit.
                array = array.cast(pa.decimal128(38, array.type.scale))
            arrays.append(array)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            # Arrow's message quotes the value it could not convert: only its type leaves.
            raise ExecutionError(
                f"source {name!r}: a value of column {column.name!r} cannot become Arrow {t or 'decimal128'} "
                f"({type(exc).__name__}; cast it in the query, e.g. x::numeric(18,2))"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, names=[c.name for c in columns])


def _stream_postgres(stream: PostgresStream) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Open a read-only session and a server-side cursor; the DSN goes only to the driver.

    The first batch is fetched here so the schema is known before the engine starts reading; the
    iterator fetches the rest, digests every batch and closes the connection when done or dropped.
    """
    import psycopg  # imported here: only definitions with a postgres source need the driver

    name, spec = stream.source, stream.spec
    try:
        dsn = stream.secrets.resolve(spec.dsn.secret).reveal()
    except InputError as error:
        raise InputError(f"source {name!r}: {error.message}") from None
    conn = _connect(stream, dsn)
    # A server-side cursor (DECLARE … CURSOR FOR <query>) runs exactly one statement.
    cur = conn.cursor(name=POSTGRES_CURSOR_NAME)

    def close() -> None:
        # The connection first: that ends the transaction and the cursor with it, and the cursor's own
        # close then only marks it closed (sending CLOSE to a server that ended the session would fail
        # and leave the cursor open in the client, warning when it is collected).
        conn.close()
        with contextlib.suppress(psycopg.Error):
            cur.close()

    stream._close = close

    def cancel() -> None:
        with contextlib.suppress(psycopg.Error):  # the query may have ended meanwhile
            conn.cancel_safe(timeout=POSTGRES_CONNECT_TIMEOUT_S)

    stream._cancel = cancel
    try:
        conn.read_only = True  # BEGIN READ ONLY as well, though the session default already is
        _check_session(stream, conn)
        # psycopg sends DECLARE through the extended protocol (PQsendQueryParams), where the server
        # parses one statement only: "a; b" fails with 42601 instead of running b.
        cur.execute(spec.query)
        columns = list(cur.description or [])
        missing = [c for c in spec.columns or {} if c not in {column.name for column in columns}]
        if missing:
            raise ExecutionError(
                f"source {name!r}: the query's result has no column {missing[0]!r} that its schema declares"
            )
        _arm_statement_timeout(stream, conn)
        first = _pg_batch(name, columns, cur.fetchmany(POSTGRES_FIRST_FETCH_ROWS), None)
        typed_first = _declared_batch(stream, first)
    except psycopg.Error as exc:
        stream.close()
        raise _pg_query_error(stream, exc) from None
    except BaseException:
        stream.close()
        raise
    return typed_first.schema, _pg_batches(stream, cur, columns, first, typed_first)


def _declared_batch(stream: PostgresStream, batch: pa.RecordBatch) -> pa.RecordBatch:
    """batch with every declared column cast to its declared type by Arrow's safe cast: text must parse,
    a number must fit and keep its value (no overflow, no lost digits), a timestamp must not lose its time."""
    declared = stream.spec.columns
    if not declared:
        return batch
    arrays = []
    for field_, column in zip(batch.schema, batch.columns, strict=True):
        type_name = declared.get(field_.name)
        target = None if type_name is None else parse_arrow_type(type_name)
        if target is None or column.type == target:
            arrays.append(column)
            continue
        try:
            arrays.append(column.cast(target, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError):
            # Arrow's message quotes the value: only the source, the column and the type leave.
            from durable_dataflow.dataflow.execution import typed_sources  # the engines' rule and wording

            raise typed_sources.TypeCheck(stream.source, field_.name, type_name or "").error() from None
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def _connect(stream: PostgresStream, dsn: str) -> Any:
    """A connection whose session is read-only and time-limited from its first statement."""
    import psycopg

    failed = f"source {stream.source!r}: cannot connect to PostgreSQL with the DSN in secret {stream.spec.dsn.secret!r}"
    try:
        own_options = psycopg.conninfo.conninfo_to_dict(dsn).get("options")
    except psycopg.Error:
        raise ExecutionError(f"{failed}: {pgerrors.INVALID_CONNINFO}") from None
    # The `options` keyword replaces the DSN's own (and PGOPTIONS, and a service file's), so the
    # DSN's settings are carried over first and the source's follow: on the command line the last wins.
    options = _session_options(stream, str(own_options or ""))
    try:
        return psycopg.connect(dsn, connect_timeout=POSTGRES_CONNECT_TIMEOUT_S, options=options)
    except psycopg.Error as exc:
        raise ExecutionError(f"{failed}: {pgerrors.describe_connect(exc, dsn)}") from None


def _check_session(stream: PostgresStream, conn: Any) -> None:
    """The session took its startup options (a connection pooler may drop them): refuse it otherwise.

    A tenant's run is also refused a role that may touch the server's files or programs (a superuser,
    or a member of pg_read_server_files, pg_write_server_files or pg_execute_server_program): from a
    read-only SELECT those read any file (pg_read_file) and write some (lo_export)."""
    row = conn.execute(_SESSION_CHECK).fetchone()
    if row != ("on", "on", "on"):
        raise ExecutionError(
            f"source {stream.source!r}: the PostgreSQL session did not take the read-only options the source "
            "sets (does a connection pooler drop startup options?)"
        )
    if stream.secrets.tenant is not None and conn.execute(_SERVER_FILES_ROLE).fetchone() != (False,):
        raise InputError(
            f"source {stream.source!r}: the granted DSN's role may read the database server's files "
            "(superuser or pg_read_server_files/pg_write_server_files/pg_execute_server_program); "
            "a tenant's source needs a least-privilege role"
        )


def _arm_statement_timeout(stream: PostgresStream, conn: Any) -> None:
    """Set statement_timeout to the time left before a FETCH: the query may have turned it off."""
    left_ms = stream.time_left_ms()
    if left_ms <= 0:
        raise stream.exceeded()
    conn.execute(_SET_STATEMENT_TIMEOUT, [str(left_ms)])


def _pg_query_error(stream: PostgresStream, exc: Exception) -> ExecutionError:
    if pgerrors.sqlstate_of(exc) == POSTGRES_QUERY_CANCELED:  # statement_timeout, or our cancel
        return stream.exceeded()
    return ExecutionError(f"source {stream.source!r}: the postgres query failed: {pgerrors.describe(exc)}")


def _next_fetch_rows(batch: pa.RecordBatch, bytes_left: int) -> int:
    """Rows for the next FETCH: about POSTGRES_FETCH_BATCH_BYTES (and never much past the bytes the
    source limit still allows) at the width the last batch had, so wide rows never fill memory."""
    width = max(1, int(batch.nbytes) // max(1, int(batch.num_rows)))
    budget = min(POSTGRES_FETCH_BATCH_BYTES, max(bytes_left, width))
    return max(1, min(POSTGRES_FETCH_BATCH_ROWS, budget // width + 1))


def _pg_batches(
    stream: PostgresStream, cur: Any, columns: list[Any], first: pa.RecordBatch, typed_first: pa.RecordBatch
) -> Iterator[pa.RecordBatch]:
    """The typed batches (``first`` as read, ``typed_first`` cast to the declared types)."""
    import psycopg

    digester = arrowdigest.OutputDigester(typed_first.schema)
    batch: pa.RecordBatch | None = typed_first
    try:
        while batch is not None:  # ends when the cursor is exhausted
            stream.bytes_read += batch.nbytes
            if stream.bytes_read > stream.bytes_max:
                raise LimitExceeded(
                    f"source {stream.source!r} streamed more than the source limit of {stream.bytes_max} bytes"
                )
            digester.update(batch)
            if not batch.num_rows:
                break
            yield batch
            wanted = _next_fetch_rows(batch, stream.bytes_max - stream.bytes_read)
            _arm_statement_timeout(stream, cur.connection)
            rows = cur.fetchmany(wanted)
            batch = _declared_batch(stream, _pg_batch(stream.source, columns, rows, first.schema)) if rows else None
        stream.fingerprint = digester.digest()
    except psycopg.Error as exc:
        stream.failure = _pg_query_error(stream, exc)
        raise stream.failure from None
    except DataflowError as exc:
        stream.failure = exc
        raise
    finally:
        stream.close()
