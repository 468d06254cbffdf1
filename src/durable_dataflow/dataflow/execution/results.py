"""Result bytes: the Arrow IPC stream that is stored (this module owns ``run_results`` and
``tenant_result_bytes``), and exports to CSV, Parquet and JSON.

Statements on ``run_results`` and ``tenant_result_bytes``:

- ``store``: store a run's result, once (the commit that ends its execution): a result of at most
  ``WRITE_CHUNK_BYTES`` (most runs') as one ``INSERT`` binding its bytes (the driver's copy is at most one
  piece); a larger one handed to the database ``WRITE_CHUNK_BYTES`` at a time: SQLite's insert of a
  ``zeroblob`` then blob writes, PostgreSQL's binary ``COPY`` with the ``bytea`` streamed, so no driver
  holds a copy of the result;
- ``stored_ctes``: ``store``'s one-piece INSERT and ``count_stored``'s upsert as CTEs of a transition's
  one PostgreSQL statement (protocol/transitions.py), two round trips less;
- ``count_stored``: add the stored size to its tenant's row of ``tenant_result_bytes`` (an upsert), in
  the transaction that stored it, as its last statement; ``tenant_stored_bytes`` reads it for the
  result_bytes quota (protocol/quotas.py); ``recount_stored`` rebuilds it from the results themselves
  (``dataflow db recount``, beside storing commits: on PostgreSQL it locks the table against writers first);
- ``stored``: the format and all the bytes (exports, resumes: they need the whole table anyway);
- ``open_stored``: the format and a reader that reads the bytes in pieces of ``READ_CHUNK_BYTES``
  (verification): SQLite's incremental blob I/O on the row's rowid, or PostgreSQL's
  ``substring(bytes from :start for :n)``, so a reader holds one piece at a time, never the result.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import functools
import json
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core.errors import InputError, NotFound
from durable_dataflow.dataflow.schema import run_results, tenant_result_bytes

if TYPE_CHECKING:  # pyarrow is imported by the functions that encode, decode and export bytes:
    import pyarrow as pa  # commands that only read runs (`runs`, `show`) never load it

ExportFormat = Literal["csv", "parquet", "json"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("csv", "parquet", "json")

# The stored result formats (``run_results.format``, at most 32 characters). The bytes are an Arrow
# IPC stream in both; the name says which output digest format verifies them (arrowdigest).
FORMAT_IPC_DIGEST_V2 = "arrow-ipc-stream"  # stored before digest v3: verified by output_digest_v2
FORMAT_IPC_DIGEST_V3 = "arrow-ipc-stream+digest-v3"  # stored from digest v3 on: verified by output_digest
STORED_FORMAT = FORMAT_IPC_DIGEST_V3  # what this version stores


class Computed(Protocol):
    """What an execution produced (dataflow.execution.ExecutionResult has this shape)."""

    @property
    def row_count(self) -> int: ...
    @property
    def output_digest(self) -> str: ...
    @property
    def ipc_bytes(self) -> memoryview: ...
    @property
    def source_fingerprint_digest(self) -> str: ...
    @property
    def sources(self) -> Sequence[tuple[str, str, str]]: ...


WRITE_CHUNK_BYTES = 4 << 20  # a stored result is handed to the database at most this many bytes at a time
# A result of at most WRITE_CHUNK_BYTES: one INSERT, its bytes bound as a parameter (one round trip; the
# COPY below costs two, and its setup about as much server time as the insert itself).
_INSERT_WHOLE = run_results.insert()
# SQLite: the row is inserted with a zero-filled blob of the result's size, then the bytes are written
# into it through incremental blob I/O, in the same transaction.
_INSERT_ZEROBLOB = run_results.insert().values(bytes=sa.func.zeroblob(sa.bindparam("size")))
# PostgreSQL: the row is sent as one binary COPY whose bytea is streamed in pieces (psycopg's copy.write).
_COPY_COLUMNS = ("run_id", "attempt", "output_digest", "format", "row_count", "bytes")
_COPY = f"COPY run_results ({', '.join(_COPY_COLUMNS)}) FROM STDIN (FORMAT binary)"
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)  # no OIDs, no header extension
_COPY_TRAILER = struct.pack("!h", -1)
_CTE_PREFIX = "result_"  # stored_ctes' bind parameters: apart from the names of the statement they join


def store(conn: Connection, run_id: str, attempt: int, result: Computed) -> int:
    """Store the bounded result, once per run: it is stored only by the commit that ends execution
    (atomic terminal or forward pre-dispatch), which never happens twice for a run. Returns the bytes
    stored, which the same transaction passes to ``count_stored`` as its last statement.

    The bytes reach the database ``WRITE_CHUNK_BYTES`` at a time, inside the caller's transaction (its
    fence check and all-or-nothing commit unchanged): binding the whole value as one parameter made the
    driver copy it whole (SQLite binds a blob with SQLITE_TRANSIENT, libpq copies each parameter into
    its output buffer), so storing cost twice the result (issue 29, finding 3). A result of at most one
    piece is bound whole, in one statement: the driver's copy of it is that piece."""
    data = memoryview(result.ipc_bytes).cast("B")  # a flat byte view: slices of it are never copies
    row = _row(run_id, attempt, result)
    if len(data) <= WRITE_CHUNK_BYTES:
        conn.execute(_INSERT_WHOLE, {**row, "bytes": bytes(data)})
        return len(data)
    dbapi_error: type[Exception] = conn.dialect.loaded_dbapi.Error
    try:
        if conn.dialect.name == "sqlite":
            _store_sqlite(conn, row, data)
        else:
            _store_postgres(conn, row, data)
    except dbapi_error as error:  # raised by the driver's own calls: translated as SQLAlchemy's are
        raise sa.exc.DBAPIError.instance(_COPY, None, error, dbapi_error, dialect=conn.dialect) from error
    return len(data)


def stored_at_once(result: Computed) -> bool:
    """Whether ``result`` is stored by one INSERT binding its bytes (at most one piece), so another
    module's PostgreSQL statement may carry that INSERT and the counter's upsert (:func:`stored_ctes`)."""
    return len(memoryview(result.ipc_bytes).cast("B")) <= WRITE_CHUNK_BYTES


def _row(run_id: str, attempt: int, result: Computed) -> dict[str, Any]:
    """A stored result's row but its bytes."""
    return {
        "run_id": run_id, "attempt": attempt, "output_digest": result.output_digest, "format": STORED_FORMAT,
        "row_count": result.row_count,
    }  # fmt: skip


def stored_ctes() -> tuple[sa.CTE, sa.CTE]:
    """:func:`store`'s INSERT of a one-piece result and :func:`count_stored`'s upsert, as data-modifying
    CTEs for another module's PostgreSQL statement (a transition's, which adds them with ``add_cte``);
    their values are :func:`stored_parameters`. Together they are ``store`` then ``count_stored``: the
    counter's row is held from that statement to the commit, as after ``count_stored``."""
    inserted = run_results.insert().values(
        {c.name: sa.bindparam(f"{_CTE_PREFIX}{c.name}", type_=c.type) for c in run_results.c}
    )
    counted = _add_stored_bytes("postgresql", _CTE_PREFIX)
    return inserted.cte("stored_result"), counted.cte("counted_result_bytes")


def stored_parameters(run_id: str, attempt: int, result: Computed, tenant: str) -> dict[str, Any]:
    """The values of :func:`stored_ctes`' bind parameters, for a result ``stored_at_once``."""
    data = memoryview(result.ipc_bytes).cast("B")
    values = {**_row(run_id, attempt, result), "bytes": bytes(data), "tenant": tenant, "size": len(data)}
    return {f"{_CTE_PREFIX}{name}": value for name, value in values.items()}


def count_stored(conn: Connection, tenant: str, size: int) -> None:
    """Add ``size`` stored bytes to ``tenant``'s counter, in the transaction that stored them (``store``)
    and as its last statement before the commit: on PostgreSQL the upsert holds the tenant's counter row
    until the commit, so the tenant's concurrent storing commits take turns only for that moment, never
    waiting on another tenant's. The counter and the results then agree at every commit."""
    conn.execute(_add_stored_bytes(conn.dialect.name), {"tenant": tenant, "size": size})


@functools.cache
def _add_stored_bytes(dialect: str, prefix: str = "") -> sa.Insert:
    """``INSERT … ON CONFLICT (tenant) DO UPDATE SET stored_bytes = stored_bytes + excluded``, built once
    per dialect (both spell the upsert the same; SQLAlchemy keeps it in each dialect's module); its bind
    parameters are ``tenant`` and ``size`` after ``prefix`` (``stored_ctes``'s)."""
    from sqlalchemy.dialects import postgresql, sqlite

    insert = sqlite.insert if dialect == "sqlite" else postgresql.insert
    tenant = sa.bindparam(f"{prefix}tenant", type_=sa.String)
    size = sa.bindparam(f"{prefix}size", type_=sa.BigInteger)
    statement = insert(tenant_result_bytes).values(tenant=tenant, stored_bytes=size)
    added = tenant_result_bytes.c.stored_bytes + statement.excluded.stored_bytes
    upsert: sa.Insert = statement.on_conflict_do_update(index_elements=["tenant"], set_={"stored_bytes": added})
    return upsert


def recount_stored(conn: Connection, tenant_of: Callable[[sa.ColumnElement[str]], sa.ColumnElement[str]]) -> int:
    """Rebuild every tenant's counter from the stored results (``tenant_of`` maps a run-id column to its
    run's tenant: ``runs.tenant_of``), in the caller's transaction; returns how many tenants have stored
    bytes. For an operator after stored results were deleted by hand, or stored by a process older than
    the counter (migration 0017); workers and servers may go on storing results meanwhile.

    On PostgreSQL it first locks the counter's table against writers (EXCLUSIVE: plain reads, the quota
    checks', go on). A storing commit counts its result in the transaction that stores it, so the lock
    waits for every commit that has counted a result, and every later one waits for the recount: each
    result is counted by the recount or after it, exactly once. (Without it, a recount beside a storing
    commit could insert a tenant's row that commit had inserted uncommitted, and fail on the key.) On
    SQLite write transactions run one at a time already."""
    if conn.dialect.name == "postgresql":
        table = conn.dialect.identifier_preparer.format_table(tenant_result_bytes)
        conn.execute(sa.text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))
    each = sa.select(
        tenant_of(run_results.c.run_id).label("tenant"), sa.func.length(run_results.c.bytes).label("size")
    ).subquery("each_result")
    sums = (
        sa.select(each.c.tenant, sa.func.sum(each.c.size))
        .where(each.c.tenant.is_not(None))  # a result whose run row is gone belongs to no tenant
        .group_by(each.c.tenant)
    )
    conn.execute(sa.delete(tenant_result_bytes))
    conn.execute(sa.insert(tenant_result_bytes).from_select(["tenant", "stored_bytes"], sums))
    return int(conn.execute(sa.select(sa.func.count()).select_from(tenant_result_bytes)).scalar_one())


def tenant_stored_bytes(tenant: sa.ColumnElement[str]) -> sa.ScalarSelect[int]:
    """A scalar subquery: the bytes of every result ``tenant``'s runs stored (0 when none), one
    primary-key read of the counter ``store`` keeps (the result_bytes quota, protocol/quotas.py)."""
    stored = sa.func.coalesce(sa.func.max(tenant_result_bytes.c.stored_bytes), 0)
    return sa.select(stored).where(tenant_result_bytes.c.tenant == tenant).scalar_subquery()


def _store_sqlite(conn: Connection, row: dict[str, Any], data: memoryview) -> None:
    rowid = conn.execute(_INSERT_ZEROBLOB, {**row, "size": len(data)}).lastrowid
    if len(data) == 0:
        return
    blob = conn.connection.driver_connection.blobopen("run_results", "bytes", rowid)  # type: ignore[union-attr]
    try:
        for start in range(0, len(data), WRITE_CHUNK_BYTES):
            blob.write(data[start : start + WRITE_CHUNK_BYTES])
    finally:
        blob.close()


def _copy_text(value: str) -> bytes:
    encoded = value.encode("utf-8")
    return struct.pack("!i", len(encoded)) + encoded


def _store_postgres(conn: Connection, row: dict[str, Any], data: memoryview) -> None:
    head = b"".join((
        _COPY_SIGNATURE, struct.pack("!h", len(_COPY_COLUMNS)),
        _copy_text(row["run_id"]), struct.pack("!ii", 4, row["attempt"]), _copy_text(row["output_digest"]),
        _copy_text(row["format"]), struct.pack("!iq", 8, row["row_count"]), struct.pack("!i", len(data)),
    ))  # fmt: skip
    with conn.connection.driver_connection.cursor() as cursor, cursor.copy(_COPY) as copy:  # type: ignore[union-attr]
        copy.write(head)
        for start in range(0, len(data), WRITE_CHUNK_BYTES):
            copy.write(data[start : start + WRITE_CHUNK_BYTES])
        copy.write(_COPY_TRAILER)


def facts(result: Computed) -> dict[str, Any]:
    """What ``result.committed`` and ``dispatch.authorized`` record of a result."""
    return {
        "output_digest": result.output_digest,
        "row_count": str(result.row_count),
        "source_fingerprint_digest": result.source_fingerprint_digest,
        "sources": [{"source": n, "kind": k, "fingerprint": f} for n, k, f in result.sources],
        "format": STORED_FORMAT,
    }


def stored(conn: Connection, run_id: str) -> tuple[str, bytes] | None:
    """The stored result's format and bytes, or None."""
    row = conn.execute(
        sa.select(run_results.c.format, run_results.c.bytes).where(run_results.c.run_id == run_id)
    ).one_or_none()
    return (str(row.format), bytes(row.bytes)) if row is not None else None


def stored_bytes(conn: Connection, run_id: str) -> bytes:
    found = stored(conn, run_id)
    if found is None:
        raise NotFound(f"run {run_id} has no stored result")
    return found[1]


READ_CHUNK_BYTES = 4 << 20  # a chunked reader asks the database for at most this many bytes at a time


class StoredReader:
    """A read-only file over one stored result's bytes (``read``, ``seek``, ``tell``, what pyarrow's
    IPC readers use), fetched from the database ``READ_CHUNK_BYTES`` at a time. ``chunks_read``
    counts the fetches."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes]) -> None:
        self.size = size
        self._fetch = fetch  # fetch(start, n) -> exactly the n bytes from offset start
        self._position = 0
        self.chunks_read = 0
        self.closed = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self.size}[whence]
        self._position = min(max(0, base + offset), self.size)
        return self._position

    def read(self, n: int = -1) -> bytes | bytearray:
        """Up to n bytes (all the rest when n < 0); one Arrow message is read by one call."""
        end = self.size if n < 0 else min(self.size, self._position + n)
        if end - self._position <= READ_CHUNK_BYTES:
            return self._chunk(end - self._position) if end > self._position else b""
        into = bytearray(end - self._position)  # filled in place: no second copy of a large message
        filled = 0
        while filled < len(into):
            piece = self._chunk(min(READ_CHUNK_BYTES, len(into) - filled))
            into[filled : filled + len(piece)] = piece
            filled += len(piece)
        return into

    def _chunk(self, n: int) -> bytes:
        data = self._fetch(self._position, n)
        if len(data) != n:
            raise InputError(f"the stored result ended after {self._position + len(data)} of {self.size} bytes")
        self._position += n
        self.chunks_read += 1
        return data

    def close(self) -> None:
        self.closed = True


_SIZE = sa.select(run_results.c.format, sa.func.length(run_results.c.bytes).label("size"))  # no bytes read
_ROWID = sa.literal_column("rowid", sa.Integer)  # SQLite's row id of a run_results row, for its blob I/O


def _sqlite_blob(conn: Connection, run_id: str) -> Any:
    """SQLite's incremental blob I/O on the row (Python 3.11's ``blobopen``), in the caller's transaction."""
    rowid = conn.execute(sa.select(_ROWID).select_from(run_results).where(run_results.c.run_id == run_id)).scalar_one()
    return conn.connection.driver_connection.blobopen("run_results", "bytes", rowid, readonly=True)  # type: ignore[union-attr]


def _postgres_fetch(conn: Connection, run_id: str) -> Callable[[int, int], bytes]:
    """``substring(bytes from :start for :n)`` (1-based): PostgreSQL detoasts only the slice asked for
    when the value is stored uncompressed (a compressed value is decompressed up to the slice's end)."""

    def fetch(start: int, n: int) -> bytes:
        piece = sa.func.substring(run_results.c.bytes, start + 1, n)
        return bytes(conn.execute(sa.select(piece).where(run_results.c.run_id == run_id)).scalar_one())

    return fetch


@contextlib.contextmanager
def open_stored(conn: Connection, run_id: str) -> Iterator[tuple[str, StoredReader] | None]:
    """The stored result's format and a chunked reader over its bytes, in the caller's transaction; None
    when the run stored none. The reader is valid inside the ``with`` block only."""
    row = conn.execute(_SIZE.where(run_results.c.run_id == run_id)).one_or_none()
    if row is None:
        yield None
        return
    if conn.dialect.name != "sqlite":
        yield str(row.format), StoredReader(int(row.size), _postgres_fetch(conn, run_id))
        return
    blob = _sqlite_blob(conn, run_id)
    try:

        def fetch(start: int, n: int) -> bytes:
            blob.seek(start)
            return bytes(blob.read(n))

        yield str(row.format), StoredReader(int(row.size), fetch)
    finally:
        blob.close()


def encode_ipc(table: pa.Table) -> bytes:
    """One-batch-per-column IPC stream bytes of table (chunks combined first, so stable for equal tables)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    combined = table.combine_chunks()
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, combined.schema) as writer:
        writer.write_table(combined)
    return bytes(sink.getvalue().to_pybytes())


@contextlib.contextmanager
def ipc_reader(source: Any) -> Iterator[pa.RecordBatchStreamReader]:
    """A reader of the record batches of an IPC stream (bytes, a buffer, or a file such as a
    ``StoredReader``), one at a time; bytes that are not an IPC stream are InputError, when opened or
    when a batch is read."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        with ipc.open_stream(source) as reader:
            yield reader
    except pa.ArrowInvalid as exc:
        raise InputError(f"stored result bytes are not an Arrow IPC stream: {exc}") from None


def decode_ipc(data: bytes | memoryview) -> pa.Table:
    """The table stored as IPC stream bytes."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        with ipc.open_stream(pa.BufferReader(data)) as reader:
            return reader.read_all()
    except pa.ArrowInvalid as exc:
        raise InputError(f"stored result bytes are not an Arrow IPC stream: {exc}") from None


def _json_value(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or infinity
    return value


def _export_json(table: pa.Table) -> bytes:
    try:
        pylist = table.to_pylist()
    except (OverflowError, ValueError):  # Python's dates and times end at year 9999 (Arrow's do not)
        raise InputError(
            "the result holds a date or time outside years 1 to 9999, which JSON export cannot write: "
            "export it as csv or parquet"
        ) from None
    rows = [{k: _json_value(v) for k, v in row.items()} for row in pylist]
    return json.dumps(rows, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def export(table: pa.Table, fmt: ExportFormat) -> bytes:
    """The table as CSV (with header), Parquet, or JSON (a list of row objects, decimals as strings)."""
    if fmt == "json":
        return _export_json(table)
    # Imported here: only exports need the writers (~7 MiB that a worker never uses).
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    if fmt == "csv":
        try:
            pacsv.write_csv(table, sink)
        except pa.ArrowInvalid:  # a binary column whose bytes are not UTF-8 text has no CSV form
            raise InputError(
                "the result cannot be written as CSV (a binary column holds bytes that are not UTF-8 text): "
                "export it as parquet or json"
            ) from None
    elif fmt == "parquet":
        pq.write_table(table, sink)
    else:
        raise InputError(f"unknown export format {fmt!r}: use csv, parquet or json")
    return bytes(sink.getvalue().to_pybytes())
