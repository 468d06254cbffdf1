"""Source resolution: every source becomes an Arrow table with a fingerprint of what was read.

Files are read once into memory; the fingerprint is the sha256 of exactly those bytes and the
table is parsed from the same bytes, so the fingerprint cannot describe a different version of
the file than the one that was executed. Paths are confined to the allowed roots after resolving
symlinks and ``..``. Query sources are fingerprinted by the output digest of their result.
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from durable_dataflow.core import hashing, secrets
from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.dataflow import arrowdigest
from durable_dataflow.dataflow.definitions import (
    CsvSource,
    DeltaSource,
    InlineSource,
    ParquetSource,
    PostgresSource,
    arrow_schema_of,
    parse_arrow_type,
)

if TYPE_CHECKING:
    from durable_dataflow.dataflow.definitions import Definition, SourceSpec
    from durable_dataflow.dataflow.execution import ExecutionContext

PARQUET_FOLDER_FILES_MAX = 10_000
POSTGRES_CONNECT_TIMEOUT_S = 10
POSTGRES_FETCH_BATCH_ROWS = 10_000
POSTGRES_ROWS_MAX = 5_000_000
ERROR_LINE_CHARS_MAX = 300

# PostgreSQL type OIDs with a fixed Arrow type; numeric is typed from its declared precision.
_PG_ARROW_TYPES: dict[int, pa.DataType] = {
    16: pa.bool_(), 20: pa.int64(), 21: pa.int16(), 23: pa.int32(), 25: pa.string(),
    700: pa.float32(), 701: pa.float64(), 1042: pa.string(), 1043: pa.string(),
    1082: pa.date32(), 1114: pa.timestamp("us"), 1184: pa.timestamp("us", tz="UTC"),
}
_PG_NUMERIC_OID = 1700


@dataclass(frozen=True)
class ResolvedSource:
    """A source as an Arrow table, with the fingerprint of what it was read from."""

    name: str
    kind: str
    table: pa.Table
    fingerprint: str


def confine_path(source: str, raw_path: str, ctx: ExecutionContext) -> Path:
    """The resolved path of a source, which must exist and lie inside one of ctx.allowed_roots."""
    candidate = Path(raw_path)
    if not candidate.is_absolute():
        candidate = ctx.base_dir / candidate
    try:
        resolved = candidate.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"source {source!r}: path {raw_path!r} does not exist") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise InputError(f"source {source!r}: path {raw_path!r} cannot be resolved: {exc}") from None
    roots = [root.resolve() for root in ctx.allowed_roots]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise InputError(
            f"source {source!r}: path {raw_path!r} resolves outside the allowed data roots "
            "(the definition's directory and DATAFLOW_DATA_ROOTS); symlinks and '..' cannot leave them"
        )
    return resolved


def _read_bounded(source: str, path: Path, bytes_max: int) -> bytes:
    """The file's bytes, refusing files above bytes_max (checked before and while reading)."""
    try:
        if not path.is_file():
            raise InputError(f"source {source!r}: {path.name!r} is not a regular file")
        if path.stat().st_size > bytes_max:
            raise InputError(f"source {source!r}: {path.name!r} is larger than the source limit of {bytes_max} bytes")
        # O_NOFOLLOW: a file swapped for a symlink after confine_path() is refused, not followed.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(descriptor, "rb") as handle:
            data = handle.read(bytes_max + 1)
    except OSError as exc:
        raise InputError(f"source {source!r}: cannot read {path.name!r}: {exc.strerror or exc}") from None
    if len(data) > bytes_max:  # the file grew after stat()
        raise InputError(f"source {source!r}: {path.name!r} is larger than the source limit of {bytes_max} bytes")
    return data


def _resolve_csv(name: str, spec: CsvSource, ctx: ExecutionContext) -> ResolvedSource:
    path = confine_path(name, spec.path, ctx)
    data = _read_bounded(name, path, ctx.limits.source_bytes_max)
    types = {column: parse_arrow_type(t) for column, t in (spec.columns or {}).items()}
    # Without a header line the declared schema names the columns, in order.
    names = list(types) if not spec.header and types else None
    try:
        table = pacsv.read_csv(
            pa.BufferReader(data),
            read_options=pacsv.ReadOptions(column_names=names, autogenerate_column_names=not spec.header and not names),
            parse_options=pacsv.ParseOptions(delimiter=spec.delimiter),
            convert_options=pacsv.ConvertOptions(column_types=types),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ExecutionError(f"source {name!r}: cannot parse {spec.path!r} as CSV: {exc}") from None
    missing = [column for column in types if column not in table.column_names]
    if missing:
        raise ExecutionError(f"source {name!r}: {spec.path!r} has no column {missing[0]!r} that its schema declares")
    return ResolvedSource(name, "csv", table, hashing.sha256_bytes(data))


def _parquet_files(name: str, root: Path, ctx: ExecutionContext) -> list[tuple[str, Path]]:
    """(relative name, confined path) of the *.parquet files of a file or folder, sorted by name."""
    if root.is_file():
        return [(root.name, root)]
    found = sorted(p for p in root.rglob("*.parquet") if not p.name.startswith((".", "_")))
    if len(found) > PARQUET_FOLDER_FILES_MAX:
        raise InputError(f"source {name!r}: more than {PARQUET_FOLDER_FILES_MAX} parquet files")
    if not found:
        raise InputError(f"source {name!r}: the folder holds no .parquet files")
    # Every file is confined again: a symlink inside an allowed folder may point anywhere.
    return [(p.relative_to(root).as_posix(), confine_path(name, str(p), ctx)) for p in found]


def _resolve_parquet(name: str, spec: ParquetSource, ctx: ExecutionContext) -> ResolvedSource:
    root = confine_path(name, spec.path, ctx)
    bytes_left = ctx.limits.source_bytes_max
    tables: list[pa.Table] = []
    parts: list[list[str]] = []
    for relative, path in _parquet_files(name, root, ctx):
        data = _read_bounded(name, path, bytes_left)
        bytes_left -= len(data)
        parts.append([relative, hashing.sha256_bytes(data)])
        try:
            tables.append(pq.read_table(pa.BufferReader(data)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise ExecutionError(f"source {name!r}: cannot read {relative!r} as Parquet: {exc}") from None
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as exc:
        raise ExecutionError(f"source {name!r}: the parquet files do not share one schema: {exc}") from None
    fingerprint = parts[0][1] if root.is_file() else hashing.digest({"files": parts})
    return ResolvedSource(name, "parquet", table, fingerprint)


def _inline_value(value: Any, t: pa.DataType) -> Any:
    """A YAML/JSON scalar in the Python form pyarrow expects for t (dates and decimals come as text)."""
    if isinstance(value, str):
        if pa.types.is_date(t):
            return dt.date.fromisoformat(value)
        if pa.types.is_timestamp(t):
            return dt.datetime.fromisoformat(value)
    if pa.types.is_decimal(t) and isinstance(value, str | int) and not isinstance(value, bool):
        return decimal.Decimal(str(value))
    return value


def _rows_to_table(name: str, rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    arrays = []
    for field in schema:
        try:
            values = [_inline_value(row.get(field.name), field.type) for row in rows]
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError, decimal.InvalidOperation) as exc:
            raise InputError(
                f"source {name!r}: column {field.name!r} does not hold {field.type} values: {exc}"
            ) from None
    return pa.Table.from_arrays(arrays, schema=schema)


def _masked_driver_text(exc: Exception, dsn: str) -> str:
    """The first line of a driver message with the DSN, its password and every quoted echo masked."""
    import psycopg

    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    fragments = [dsn]
    try:
        password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        password = None
    if password:
        fragments.append(str(password))
    for fragment in fragments:
        text = text.replace(fragment, "***")
    # libpq echoes parts of a malformed connection string in double quotes.
    return re.sub(r'"[^"]*"', '"***"', text)[:ERROR_LINE_CHARS_MAX]


def _pg_arrow_type(column: Any) -> pa.DataType | None:
    if column.type_code == _PG_NUMERIC_OID:
        if column.precision and column.precision <= 38:
            return pa.decimal128(column.precision, column.scale or 0)
        return None  # unconstrained numeric: inferred from the values
    return _PG_ARROW_TYPES.get(column.type_code, pa.string())


def _pg_rows_to_table(name: str, columns: list[Any], rows: list[tuple[Any, ...]]) -> pa.Table:
    arrays = []
    for index, column in enumerate(columns):
        t = _pg_arrow_type(column)
        values = [row[index] for row in rows]
        if t is not None and pa.types.is_string(t):
            values = [None if v is None else str(v) for v in values]
        try:
            arrays.append(pa.array(values, type=t))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ExecutionError(f"source {name!r}: column {column.name!r} cannot become Arrow: {exc}") from None
    return pa.Table.from_arrays(arrays, names=[c.name for c in columns])


def _fetch_postgres(name: str, spec: PostgresSource, time_limit_s: float) -> pa.Table:
    """Run the query in a READ ONLY transaction; the DSN lives only in a local variable.

    The decoded table is checked against the source byte limit by resolve_sources.
    """
    import psycopg  # imported here: only definitions with a postgres source need the driver

    dsn = secrets.resolve(spec.dsn.secret).reveal()
    connected = False
    try:
        with psycopg.connect(dsn, connect_timeout=POSTGRES_CONNECT_TIMEOUT_S) as conn:
            connected = True
            conn.read_only = True
            with conn.cursor() as cur:
                cur.execute("SELECT set_config('statement_timeout', %s, true)", [str(int(time_limit_s * 1000))])
                cur.execute(spec.query)
                columns = list(cur.description or [])
                rows = _fetch_bounded(name, cur)
            conn.rollback()
    except psycopg.Error as exc:
        if not connected:
            raise ExecutionError(
                f"source {name!r}: cannot connect to PostgreSQL with the DSN in secret {spec.dsn.secret!r}: "
                f"{_masked_driver_text(exc, dsn)}"
            ) from None
        primary = getattr(getattr(exc, "diag", None), "message_primary", None) or _masked_driver_text(exc, dsn)
        raise ExecutionError(f"source {name!r}: the postgres query failed: {primary}") from None
    return _pg_rows_to_table(name, columns, rows)


def _fetch_bounded(name: str, cur: Any) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    while True:  # ends when the cursor is exhausted or the row bound is hit
        batch = cur.fetchmany(POSTGRES_FETCH_BATCH_ROWS)
        if not batch:
            return rows
        rows.extend(batch)
        if len(rows) > POSTGRES_ROWS_MAX:
            raise InputError(f"source {name!r}: the query returned more than {POSTGRES_ROWS_MAX} rows")


# An inline source is part of an immutable definition: its typed table and fingerprint are computed
# once per spec object (keyed by id(), dropped by a finalizer when the spec dies).
_inline_by_id: dict[int, ResolvedSource] = {}


def _resolve_inline(name: str, spec: InlineSource) -> ResolvedSource:
    cached = _inline_by_id.get(id(spec))
    if cached is not None and cached.name == name:
        return cached
    resolved = _build_inline(name, spec)
    _inline_by_id[id(spec)] = resolved
    weakref.finalize(spec, _inline_by_id.pop, id(spec), None)
    return resolved


def _build_inline(name: str, spec: InlineSource) -> ResolvedSource:
    table = _rows_to_table(name, spec.rows, arrow_schema_of(spec.columns))
    # The typed table's digest covers the schema (names, order, types) and every value; it is an
    # Arrow digest, far cheaper than canonical JSON of the rows for large inline sources.
    return ResolvedSource(name, "inline", table, arrowdigest.output_digest(table))


def _resolve_delta(name: str, spec: DeltaSource, ctx: ExecutionContext) -> ResolvedSource:
    try:
        import deltalake  # optional extra: imported only when a delta source is used
    except ImportError:
        raise InputError(
            f"source {name!r} is a delta table but the deltalake package is not installed: "
            "install durable-dataflow[delta]"
        ) from None
    path = confine_path(name, spec.path, ctx)
    try:
        table_handle = deltalake.DeltaTable(str(path), version=spec.version)
        table = table_handle.to_pyarrow_table()
        version = int(table_handle.version())
    except Exception as exc:  # deltalake raises many unrelated types; all mean "cannot read it"
        raise ExecutionError(f"source {name!r}: cannot read the delta table {spec.path!r}: {exc}") from None
    return ResolvedSource(name, "delta", table, hashing.digest({"uri": path.as_uri(), "version": version}))


def _resolve_one(name: str, spec: SourceSpec, ctx: ExecutionContext) -> ResolvedSource:
    if isinstance(spec, CsvSource):
        return _resolve_csv(name, spec, ctx)
    if isinstance(spec, ParquetSource):
        return _resolve_parquet(name, spec, ctx)
    if isinstance(spec, InlineSource):
        return _resolve_inline(name, spec)
    if isinstance(spec, PostgresSource):
        table = _fetch_postgres(name, spec, ctx.limits.time_limit_s)
        return ResolvedSource(name, "postgres", table, arrowdigest.output_digest(table))
    return _resolve_delta(name, spec, ctx)


def resolve_sources(d: Definition, ctx: ExecutionContext) -> list[ResolvedSource]:
    """Every source of d as an Arrow table with its fingerprint, in definition order."""
    resolved: list[ResolvedSource] = []
    for name, spec in d.sources.items():
        source = _resolve_one(name, spec, ctx)
        if source.table.nbytes > ctx.limits.source_bytes_max:
            raise InputError(
                f"source {name!r} decodes to {source.table.nbytes} bytes, more than the source limit "
                f"of {ctx.limits.source_bytes_max} bytes"
            )
        resolved.append(source)
    return resolved


def source_fingerprint_digest(sources: list[ResolvedSource] | tuple[Any, ...]) -> str:
    """Digest over the sorted list of {source, kind, fingerprint}.

    Accepts ResolvedSource objects or (name, kind, fingerprint) tuples, so the digest can be
    recomputed from what a run recorded.
    """
    entries = []
    for item in sources:
        name, kind, fingerprint = (
            (item.name, item.kind, item.fingerprint) if isinstance(item, ResolvedSource) else item
        )
        entries.append({"source": name, "kind": kind, "fingerprint": fingerprint})
    entries.sort(key=lambda e: (e["source"], e["kind"], e["fingerprint"]))
    return hashing.digest(entries)


