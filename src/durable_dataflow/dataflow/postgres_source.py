"""A PostgreSQL source: one read-only query streamed through a server-side cursor into Arrow batches.

The DSN is resolved from its secret only inside ``_stream_postgres`` and never leaves it; error text
is masked of it. The result is digested as it streams (the source's fingerprint) and bounded by the
source byte limit; the time limit is the server's ``statement_timeout`` plus a cancel request from
the execution's watch thread.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from durable_dataflow.core import secrets
from durable_dataflow.core.errors import DataflowError, ExecutionError, LimitExceeded
from durable_dataflow.dataflow import arrowdigest
from durable_dataflow.dataflow.definitions import PostgresSource

POSTGRES_CONNECT_TIMEOUT_S = 10
POSTGRES_FETCH_BATCH_ROWS = 10_000  # at most, per FETCH
POSTGRES_FIRST_FETCH_ROWS = 100  # the first FETCH learns the row width; later ones follow it
POSTGRES_FETCH_BATCH_BYTES = 8 * 1024 * 1024  # a FETCH is sized to about this many Arrow bytes
POSTGRES_QUERY_CANCELED = "57014"  # SQLSTATE of statement_timeout and of a cancel request
ERROR_LINE_CHARS_MAX = 300

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
    fingerprint: str | None = None
    bytes_read: int = 0
    # The engine wraps an error raised inside the iterator in its own; the original is kept here.
    failure: DataflowError | None = None
    _close: Callable[[], None] | None = None
    _cancel: Callable[[], None] | None = None

    def batches(self) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """The result's schema and its batches; call ``close()`` when done, read or not."""
        return _stream_postgres(self)

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


def _masked_driver_text(exc: Exception, dsn: str) -> str:
    """The first line of a driver message with the DSN, its password and every quoted echo masked."""
    import psycopg

    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    fragments = [dsn]
    try:
        parts = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        parts = {}
    fragments.extend(str(parts[key]) for key in ("password", "user", "host", "dbname") if parts.get(key))
    for fragment in sorted(fragments, key=len, reverse=True):
        text = text.replace(fragment, "***")
    # libpq and psycopg echo parts of the connection string (host, user, database, a malformed
    # fragment) in double or single quotes: a careless DSN may carry a password in any of them.
    return re.sub(r"'[^']*'", "'***'", re.sub(r'"[^"]*"', '"***"', text))[:ERROR_LINE_CHARS_MAX]


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
            raise ExecutionError(
                f"source {name!r}: column {column.name!r} cannot become Arrow {t or ''}: {_short(exc)} "
                "(cast it in the query, e.g. x::numeric(18,2))"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, names=[c.name for c in columns])


def _stream_postgres(stream: PostgresStream) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Open a READ ONLY transaction and a server-side cursor; the DSN lives only in this frame.

    The first batch is fetched here so the schema is known before the engine starts reading; the
    iterator fetches the rest, digests every batch and closes the connection when done or dropped.
    """
    import psycopg  # imported here: only definitions with a postgres source need the driver

    name, spec = stream.source, stream.spec
    dsn = secrets.resolve(spec.dsn.secret).reveal()
    try:
        conn = psycopg.connect(dsn, connect_timeout=POSTGRES_CONNECT_TIMEOUT_S)
    except psycopg.Error as exc:
        raise ExecutionError(
            f"source {name!r}: cannot connect to PostgreSQL with the DSN in secret {spec.dsn.secret!r}: "
            f"{_masked_driver_text(exc, dsn)}"
        ) from None
    # A server-side cursor (DECLARE … CURSOR FOR <query>) runs exactly one statement.
    cur = conn.cursor(name="dataflow_source")

    def close() -> None:
        with contextlib.suppress(psycopg.Error):  # the connection is closed next anyway
            cur.close()
        conn.close()

    stream._close = close

    def cancel() -> None:
        with contextlib.suppress(psycopg.Error):  # the query may have ended meanwhile
            conn.cancel_safe(timeout=POSTGRES_CONNECT_TIMEOUT_S)

    stream._cancel = cancel
    try:
        conn.read_only = True
        conn.execute("SELECT set_config('statement_timeout', %s, true)", [str(int(stream.time_limit_s * 1000))])
        cur.execute(spec.query)
        columns = list(cur.description or [])
        first = _pg_batch(name, columns, cur.fetchmany(POSTGRES_FIRST_FETCH_ROWS), None)
    except psycopg.Error as exc:
        stream.close()
        raise _pg_query_error(stream, exc, dsn) from None
    except BaseException:
        stream.close()
        raise
    return first.schema, _pg_batches(stream, cur, columns, first, dsn)


def _pg_query_error(stream: PostgresStream, exc: Exception, dsn: str) -> ExecutionError:
    if getattr(exc, "sqlstate", None) == POSTGRES_QUERY_CANCELED:  # statement_timeout, or our cancel
        return LimitExceeded(f"source {stream.source!r} exceeded the time limit of {stream.time_limit_s:g} s")
    primary = getattr(getattr(exc, "diag", None), "message_primary", None) or _masked_driver_text(exc, dsn)
    return ExecutionError(f"source {stream.source!r}: the postgres query failed: {primary}")


def _next_fetch_rows(batch: pa.RecordBatch, bytes_left: int) -> int:
    """Rows for the next FETCH: about POSTGRES_FETCH_BATCH_BYTES (and never much past the bytes the
    source limit still allows) at the width the last batch had, so wide rows never fill memory."""
    width = max(1, int(batch.nbytes) // max(1, int(batch.num_rows)))
    budget = min(POSTGRES_FETCH_BATCH_BYTES, max(bytes_left, width))
    return max(1, min(POSTGRES_FETCH_BATCH_ROWS, budget // width + 1))


def _pg_batches(
    stream: PostgresStream, cur: Any, columns: list[Any], first: pa.RecordBatch, dsn: str
) -> Iterator[pa.RecordBatch]:
    import psycopg

    digester = arrowdigest.OutputDigester(first.schema)
    batch: pa.RecordBatch | None = first
    try:
        while batch is not None:  # ends when the cursor is exhausted
            stream.bytes_read += batch.nbytes
            if stream.bytes_read > stream.bytes_max:
                raise LimitExceeded(
                    f"source {stream.source!r} streamed more than the source limit of {stream.bytes_max} bytes"
                )
            digester.update(batch)
            if batch.num_rows:
                yield batch
            wanted = _next_fetch_rows(batch, stream.bytes_max - stream.bytes_read)
            rows = cur.fetchmany(wanted) if batch.num_rows else []
            batch = _pg_batch(stream.source, columns, rows, first.schema) if rows else None
        stream.fingerprint = digester.digest()
    except psycopg.Error as exc:
        stream.failure = _pg_query_error(stream, exc, dsn)
        raise stream.failure from None
    except DataflowError as exc:
        stream.failure = exc
        raise
    finally:
        stream.close()



def _short(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:ERROR_LINE_CHARS_MAX]
