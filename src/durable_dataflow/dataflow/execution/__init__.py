"""Typed execution: resolve sources, run the SQL steps in the sandbox, stream the bounded result.

Everything here is recomputable and nothing is committed: the caller (the run service) stores the
IPC bytes, digests and row count in its fenced terminal transaction. All bounds (rows, bytes,
time, memory, spill) are enforced here, while the result streams, before the caller can commit
anything; every engine or Arrow error at any batch becomes a ``DataflowError`` naming the step.

The engine is DuckDB (docs/engines.md). File sources (CSV, Parquet) are read by DuckDB itself
through views over ``read_csv`` / ``read_parquet`` in a database confined to exactly those files;
a Delta snapshot is scanned as a pyarrow dataset with pushdown; a PostgreSQL query streams into a
private table; inline rows are registered as an Arrow table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from durable_dataflow.core import secrets
from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow import parameters, progress, results
from durable_dataflow.dataflow.definitions import Definition, LoadedDefinition, parse_arrow_type
from durable_dataflow.dataflow.execution import resultstream, sandbox
from durable_dataflow.dataflow.limits import ExecutionLimits, format_size
from durable_dataflow.dataflow.postgres_source import PostgresStream, check_query
from durable_dataflow.dataflow.sources import (
    ArrowDataset,
    ArrowTable,
    FileScan,
    ResolvedSource,
    check_unchanged,
    confine_path,
    resolve_sources,
    source_fingerprint_digest,
)
from durable_dataflow.dataflow.workspace import DATA_ROOTS_ENV, data_roots_from_env

RESULT_BATCH_ROWS = 16 * 1024
PROGRESS_INTERVAL_S = 0.5

__all__ = [
    "DATA_ROOTS_ENV",
    "ExecutionContext",
    "ExecutionLimits",
    "ExecutionResult",
    "ResolvedSource",
    "execute",
    "preflight",
    "resolve_sources",
    "source_fingerprint_digest",
]


def secrets_folders() -> tuple[Path, ...]:
    """The secrets directory, when one is configured: no source may read inside it."""
    folder = secrets.secrets_dir()
    return (folder,) if folder is not None else ()


@dataclass(frozen=True)
class ExecutionContext:
    """Where relative source paths start, which directories sources may read, and the limits."""

    base_dir: Path
    allowed_roots: tuple[Path, ...]
    limits: ExecutionLimits = field(default_factory=ExecutionLimits)
    # Paths no source may read even inside a root: the secrets directory and the platform database.
    forbidden: tuple[Path, ...] = field(default_factory=secrets_folders)
    # When the execution's time runs out (time.monotonic()); None until ``started()``.
    deadline_at: float | None = None
    # The secrets the definition may name (a tenant's grants, or the local operator's scope).
    secrets: secrets.SecretScope = field(default_factory=secrets.SecretScope.local)

    def started(self) -> ExecutionContext:
        """This context with the time limit counting from now (resolution and engine together)."""
        return dataclasses.replace(self, deadline_at=time.monotonic() + self.limits.time_limit_s)

    @classmethod
    def for_definition(cls, loaded: LoadedDefinition, limits: ExecutionLimits | None = None) -> ExecutionContext:
        """Roots: the definition's directory plus every directory in $DATAFLOW_DATA_ROOTS."""
        roots = (loaded.base_dir, *data_roots_from_env())
        return cls(base_dir=loaded.base_dir, allowed_roots=roots, limits=limits or ExecutionLimits())


@dataclass(frozen=True)
class ExecutionResult:
    """The typed result of one execution (as stored IPC bytes) and the digests that describe it."""

    row_count: int
    output_digest: str
    ipc_bytes: bytes
    source_fingerprint_digest: str
    sources: tuple[tuple[str, str, str], ...]  # (name, kind, fingerprint) in definition order

    @property
    def table(self) -> pa.Table:
        """The result decoded from its IPC bytes (a view over them, not a copy of the values)."""
        return results.decode_ipc(self.ipc_bytes)


class _Watch:
    """One thread per execution: interrupts the engine when the time budget runs out and, when
    someone watches, reports the engine's progress and the result stream's size meanwhile."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        limits: ExecutionLimits,
        deadline_at: float,
        sink: progress.ProgressSink | None,
        reports_percent: bool,
        streams: tuple[PostgresStream, ...] = (),
        own_text: str = "",
    ) -> None:
        self.con = con
        self.own_text = own_text  # the definition's SQL and names: what engine messages may quote
        self.deadline_at = deadline_at
        self.streams = streams  # queries the engine may be waiting on: cancelled with it
        self.time_limit_s = limits.time_limit_s
        self.memory_limit = limits.memory_limit
        self.temp_limit = format_size(limits.temp_bytes_max)
        self.sink = sink
        self.reports_percent = reports_percent
        self.collector: resultstream.ResultCollector | None = None
        self.fired = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dataflow-execution-watch", daemon=True)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        interval = PROGRESS_INTERVAL_S if self.sink is not None else self.time_limit_s
        while True:  # ends when the execution ends or its time is up
            remaining = self.deadline_at - time.monotonic()
            if remaining <= 0:
                self.fired.set()
                self.con.interrupt()
                for stream in self.streams:
                    stream.cancel()
                return
            if self._done.wait(min(interval, remaining)):
                return
            self._report()

    def _report(self) -> None:
        if self.sink is None:
            return
        percent = None
        if self.reports_percent:
            value = self.con.query_progress()
            percent = value if value >= 0 else None
        collector = self.collector
        progress.report(self.sink, progress.Progress(
            progress.Phase.EXECUTING, percent,
            collector.rows if collector else 0, collector.bytes if collector else 0,
        ))  # fmt: skip

    def exceeded(self, step: str) -> LimitExceeded:
        return LimitExceeded(f"step {step!r} exceeded the time limit of {self.time_limit_s:g} s")

    def translate(self, step: str, exc: BaseException, what: str = "step") -> DataflowError:
        """An engine or Arrow error, raised while a statement ran, a source was bound or any batch was read.

        ``what`` names the part that failed (``step`` or ``source``) in the message."""
        if isinstance(exc, DataflowError):
            return exc
        text = sandbox.engine_message(exc, own_text=self.own_text)
        raw = str(exc)  # classified on the engine's own words, shown only as ``text``
        part = f"{what} {step!r}"
        if self.fired.is_set() or isinstance(exc, duckdb.InterruptException) or text.startswith("INTERRUPT"):
            return LimitExceeded(f"{part} exceeded the time limit of {self.time_limit_s:g} s")
        if "max_temp_directory_size" in raw:
            return LimitExceeded(
                f"{part} exceeded the spill limit of {self.temp_limit} (--temp-max / DATAFLOW_TEMP_MAX): {text}"
            )
        if isinstance(exc, duckdb.OutOfMemoryException) or text.startswith("Out of Memory Error"):
            return LimitExceeded(f"{part} exceeded the memory limit of {self.memory_limit}: {text}")
        if isinstance(exc, duckdb.PermissionException) or text.startswith("Permission Error"):
            return InputError(
                f"{part} tried to reach files, the network or extensions, which the sandbox forbids: {text}"
            )
        if isinstance(exc, pa.ArrowCapacityError) or "offset overflow" in raw:
            return LimitExceeded(f"{part} produced a batch larger than Arrow can hold (2 GiB): {text}")
        return ExecutionError(f"{part} failed: {text}")

    def run(self, step: str, statement: str, params: dict[str, Any]) -> None:
        """Execute one statement under the remaining budget, translating every error."""
        if self.fired.is_set():
            raise self.exceeded(step)
        try:
            self.con.execute(statement, params)
        except (duckdb.Error, pa.ArrowException, OSError) as exc:
            raise self.translate(step, exc) from None

    def stream(self, step: str, statement: str, params: dict[str, Any], collector: resultstream.ResultCollector,
               declared: pa.Schema) -> None:
        """Stream the statement's result into the collector, which stops at the first bound hit."""
        if self.fired.is_set():
            raise self.exceeded(step)
        self.collector = collector
        try:
            reader = self.con.sql(statement, params=params).to_arrow_reader(RESULT_BATCH_ROWS)
            resultstream.check_columns(reader.schema, declared, step)
            collector.add_all(reader)
        except (duckdb.Error, pa.ArrowException, OSError) as exc:
            raise self.translate(step, exc) from None


def _gate_all(cursor: duckdb.DuckDBPyConnection, d: Definition) -> list[sandbox.GatedStep]:
    """Every step passes the gate before any step runs."""
    gated = []
    for step in d.steps:
        checked = sandbox.gate_step(cursor, step.name, step.sql)
        undeclared = sorted(checked.parameter_names - set(d.parameters))
        if undeclared:
            raise InputError(f"step {step.name!r} uses ${undeclared[0]}, which is not a declared parameter")
        gated.append(checked)
    return gated


def _gate(d: Definition, limits: ExecutionLimits) -> list[sandbox.GatedStep]:
    cursor = sandbox.open_cursor(limits)
    try:
        return _gate_all(cursor, d)
    finally:
        cursor.close()


def duckdb_type(arrow_type_name: str) -> str:
    """The DuckDB type that reads a column declared with this Arrow type name."""
    t = parse_arrow_type(arrow_type_name)
    if pa.types.is_decimal(t):
        return f"DECIMAL({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        if t.tz is not None:
            return "TIMESTAMPTZ"
        return {"s": "TIMESTAMP_S", "ms": "TIMESTAMP_MS", "us": "TIMESTAMP", "ns": "TIMESTAMP_NS"}[t.unit]
    names = {
        pa.string(): "VARCHAR", pa.large_string(): "VARCHAR", pa.binary(): "BLOB", pa.large_binary(): "BLOB",
        pa.int8(): "TINYINT", pa.int16(): "SMALLINT", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
        pa.uint8(): "UTINYINT", pa.uint16(): "USMALLINT", pa.uint32(): "UINTEGER", pa.uint64(): "UBIGINT",
        pa.float32(): "FLOAT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN", pa.date32(): "DATE",
    }
    return names[t]


def _scan_sql(scan: FileScan, columns: dict[str, str] | None) -> str:
    """The platform-built table function call that reads the scan's files (never user text)."""
    paths = ", ".join(sandbox.string_literal(s.path) for s in scan.stamps)
    options = [f"{key} = {value}" for key, value in scan.options]
    if columns:
        types = ", ".join(f"{sandbox.string_literal(c)}: {sandbox.string_literal(duckdb_type(t))}"
                          for c, t in columns.items())
        options.append(f"types = {{{types}}}")
    return f"{scan.reader}([{paths}]{''.join(', ' + o for o in options)})"


def _bind_csv(con: duckdb.DuckDBPyConnection, name: str, scan: FileScan) -> None:
    declared = scan.declared or {}
    header = dict(scan.options).get("header") == "true"
    if declared and not header:  # without a header line the declared schema names the columns, in order
        names = ", ".join(sandbox.string_literal(c) for c in declared)
        scan = FileScan(scan.reader, scan.stamps, (*scan.options, ("names", f"[{names}]")), scan.declared)
    elif declared:
        con.execute(f'CREATE TEMP VIEW "{name}" AS SELECT * FROM {_scan_sql(scan, None)}')
        found = {row[0] for row in con.execute(f'DESCRIBE "{name}"').fetchall()}
        missing = [c for c in declared if c not in found]
        if missing:
            raise ExecutionError(f"source {name!r}: the file has no column {missing[0]!r} that its schema declares")
        con.execute(f'DROP VIEW "{name}"')
    con.execute(f'CREATE TEMP VIEW "{name}" AS SELECT * FROM {_scan_sql(scan, declared or None)}')


def _bind_one(con: duckdb.DuckDBPyConnection, source: ResolvedSource) -> None:
    name, binding = source.name, source.binding
    if isinstance(binding, ArrowTable):
        con.register(name, binding.table)
    elif isinstance(binding, ArrowDataset):
        con.register(name, binding.dataset)
    elif isinstance(binding, PostgresStream):
        schema, batches = binding.batches()
        reader = pa.RecordBatchReader.from_batches(schema, batches)
        staging = f"dataflow stream {name}"  # a space: no source or step name can collide with it
        try:
            con.register(staging, reader)
            con.execute(f'CREATE TEMP TABLE "{name}" AS SELECT * FROM "{staging}"')
            con.unregister(staging)
        except (duckdb.Error, pa.ArrowException, OSError):
            if binding.failure is not None:  # the stream's own error, which the engine wrapped
                raise binding.failure from None
            raise
        finally:
            binding.close()
    elif binding.reader == "read_csv":
        _bind_csv(con, name, binding)
    else:
        con.execute(f'CREATE TEMP VIEW "{name}" AS SELECT * FROM {_scan_sql(binding, None)}')


def _bind_sources(con: duckdb.DuckDBPyConnection, resolved: list[ResolvedSource], watch: _Watch) -> None:
    for source in resolved:
        if watch.fired.is_set():
            raise watch.translate(source.name, duckdb.InterruptException("INTERRUPT"), "source")
        try:
            _bind_one(con, source)
        except (duckdb.Error, pa.ArrowException, OSError) as exc:
            raise watch.translate(source.name, exc, "source") from None


def _run_steps(
    con: duckdb.DuckDBPyConnection,
    d: Definition,
    gated: list[sandbox.GatedStep],
    bound: dict[str, Any],
    resolved: list[ResolvedSource],
    limits: ExecutionLimits,
    deadline_at: float,
    sink: progress.ProgressSink | None,
    confined: bool,
) -> resultstream.BoundedResult:
    declared = d.output.arrow_schema()
    bytes_max = d.output.max_bytes_int
    collector = resultstream.ResultCollector(
        declared, d.output.max_rows, bytes_max, f"output.max_bytes = {d.output.max_bytes}"
    )
    streams = tuple(s.binding for s in resolved if isinstance(s.binding, PostgresStream))
    own_text = "\n".join([*(s.sql for s in d.steps), *d.sources, *(s.name for s in d.steps), *d.output.columns])
    with _Watch(con, limits, deadline_at, sink, confined, streams, own_text) as watch:
        _bind_sources(con, resolved, watch)
        # Earlier steps become private TEMP tables that later steps read by name; the last step's
        # result is streamed straight out, in its own order.
        for step in gated[:-1]:
            params = {name: bound[name] for name in step.parameter_names}
            watch.run(step.name, sandbox.materialize_statement(con, step), params)
        last = gated[-1]
        params = {name: bound[name] for name in last.parameter_names}
        watch.stream(last.name, last.sql, params, collector, declared)
    return collector.finish()


def _allowed_paths(resolved: list[ResolvedSource]) -> list[str]:
    return [s.path for source in resolved if isinstance(source.binding, FileScan) for s in source.stamps]


def _needs_own_database(resolved: list[ResolvedSource]) -> bool:
    """Only executions over inline rows alone share the process's database (they never spill)."""
    return any(not isinstance(source.binding, ArrowTable) for source in resolved)


def preflight(d: Definition, ctx: ExecutionContext) -> None:
    """Everything that can be refused without reading data: the SQL gate, undeclared $parameters and
    file paths outside the allowed roots. Call it before recording a run so hostile input leaves no trace.
    """
    _gate(d, ctx.limits)
    for name, spec in d.sources.items():
        check_query(name, spec)  # a postgres source: exactly one read statement
        path = getattr(spec, "path", None)
        if isinstance(path, str):
            confine_path(name, path, ctx)


def execute(
    d: Definition,
    params: Mapping[str, Any],
    ctx: ExecutionContext,
    sources: list[ResolvedSource] | None = None,
    progress_sink: progress.ProgressSink | None = None,
) -> ExecutionResult:
    """Resolve sources (unless given), run the steps sandboxed, type, bound and digest the result."""
    bound = parameters.bind_values(d, params)
    gated = _gate(d, ctx.limits)  # refuse hostile SQL before reading any source
    # The time limit counts from the caller's start (resolution included) or from here.
    deadline_at = ctx.deadline_at if ctx.deadline_at is not None else time.monotonic() + ctx.limits.time_limit_s
    ctx = dataclasses.replace(ctx, deadline_at=deadline_at)
    resolved = sources if sources is not None else resolve_sources(d, ctx)
    try:
        with _engine(ctx.limits, resolved) as (con, confined):
            result = _run_steps(con, d, gated, bound, resolved, ctx.limits, deadline_at, progress_sink, confined)
    except Exception:
        # A file swapped while the engine read it may have made the engine fail on (and quote) other
        # bytes than were fingerprinted: that is reported as the change, never with the engine's text.
        check_unchanged(resolved)
        raise
    check_unchanged(resolved)
    recorded = tuple((s.name, s.kind, s.fingerprint) for s in resolved)
    return ExecutionResult(
        row_count=result.row_count,
        output_digest=result.output_digest,
        ipc_bytes=result.ipc_bytes,
        source_fingerprint_digest=source_fingerprint_digest(recorded),
        sources=recorded,
    )


@contextlib.contextmanager
def _engine(
    limits: ExecutionLimits, resolved: list[ResolvedSource]
) -> Iterator[tuple[duckdb.DuckDBPyConnection, bool]]:
    """The connection an execution runs on: its own confined database (True), or a shared cursor."""
    if _needs_own_database(resolved):
        with sandbox.open_confined(limits, _allowed_paths(resolved)) as con:
            yield con, True
        return
    cursor = sandbox.open_cursor(limits)
    try:
        yield cursor, False
    finally:
        cursor.close()  # drops this execution's registered views and TEMP tables
