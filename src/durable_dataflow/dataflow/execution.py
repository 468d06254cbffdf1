"""Typed execution: resolve sources, run the SQL steps in the sandbox, cast to the declared schema.

Everything here is recomputable and nothing is committed: the caller (the run service) stores the
IPC bytes, digests and row count in its fenced terminal transaction. All bounds (rows, bytes,
time, memory) are enforced here, before the caller can commit anything.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow import arrowdigest, parameters, results, sandbox
from durable_dataflow.dataflow.definitions import Definition, LoadedDefinition
from durable_dataflow.dataflow.sources import (
    ResolvedSource,
    confine_path,
    resolve_sources,
    source_fingerprint_digest,
)

DATA_ROOTS_ENV = "DATAFLOW_DATA_ROOTS"
SOURCE_BYTES_MAX_DEFAULT = 1024**3
ERROR_LINE_CHARS_MAX = 300
RESULT_BATCH_ROWS = 64 * 1024

__all__ = [
    "ExecutionContext",
    "ExecutionLimits",
    "ExecutionResult",
    "ResolvedSource",
    "execute",
    "preflight",
    "resolve_sources",
    "source_fingerprint_digest",
]


@dataclass(frozen=True)
class ExecutionLimits:
    """Bounds of one execution. memory_limit and threads configure the per-process sandbox database."""

    time_limit_s: float = 60
    memory_limit: str = "1GB"
    threads: int = 2
    source_bytes_max: int = SOURCE_BYTES_MAX_DEFAULT


@dataclass(frozen=True)
class ExecutionContext:
    """Where relative source paths start, which directories sources may read, and the limits."""

    base_dir: Path
    allowed_roots: tuple[Path, ...]
    limits: ExecutionLimits = field(default_factory=ExecutionLimits)

    @classmethod
    def for_definition(cls, loaded: LoadedDefinition, limits: ExecutionLimits | None = None) -> ExecutionContext:
        """Roots: the definition's directory plus every directory in $DATAFLOW_DATA_ROOTS."""
        extra = [Path(p) for p in os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep) if p.strip()]
        roots = (loaded.base_dir, *extra)
        return cls(base_dir=loaded.base_dir, allowed_roots=roots, limits=limits or ExecutionLimits())


@dataclass(frozen=True)
class ExecutionResult:
    """The typed result of one execution and the digests that describe it."""

    table: pa.Table
    row_count: int
    output_digest: str
    ipc_bytes: bytes
    source_fingerprint_digest: str
    sources: tuple[tuple[str, str, str], ...]  # (name, kind, fingerprint) in definition order


class _Deadline:
    """Interrupts the cursor's running query when the execution's time budget runs out.

    One timer covers every statement of the execution (a thread per statement costs more than a
    small query); ``run`` translates an interrupt into the limit that was hit.
    """

    def __init__(self, cursor: duckdb.DuckDBPyConnection, limits: ExecutionLimits) -> None:
        self.cursor = cursor
        self.time_limit_s = limits.time_limit_s
        self.memory_limit = limits.memory_limit
        self.fired = threading.Event()
        self._timer = threading.Timer(limits.time_limit_s, self._interrupt)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()

    def _interrupt(self) -> None:
        self.fired.set()
        self.cursor.interrupt()

    def run(self, step: str, statement: str, params: dict[str, Any]) -> None:
        """Execute one statement under the remaining budget, translating DuckDB errors."""
        if self.fired.is_set():
            raise self.exceeded(step)
        try:
            self.cursor.execute(statement, params)
        except duckdb.InterruptException:
            raise self.exceeded(step) from None
        except duckdb.Error as exc:
            raise _translate(step, exc, self.memory_limit) from None

    def fetch_bounded(self, step: str, statement: str, params: dict[str, Any], rows_max: int) -> pa.Table:
        """Stream the statement's result and stop as soon as it has more than ``rows_max`` rows, so
        an oversized result is refused without ever being held in memory whole."""
        if self.fired.is_set():
            raise self.exceeded(step)
        try:
            reader = self.cursor.sql(statement, params=params).to_arrow_reader(RESULT_BATCH_ROWS)
            batches: list[pa.RecordBatch] = []
            rows = 0
            for batch in reader:
                batches.append(batch)
                rows += batch.num_rows
                if rows > rows_max:
                    raise LimitExceeded(
                        f"the result has more than output.max_rows = {rows_max} rows (stopped reading at {rows})"
                    )
            return pa.Table.from_batches(batches, schema=reader.schema)
        except duckdb.InterruptException:
            raise self.exceeded(step) from None
        except duckdb.Error as exc:
            raise _translate(step, exc, self.memory_limit) from None

    def exceeded(self, step: str) -> LimitExceeded:
        return LimitExceeded(f"step {step!r} exceeded the time limit of {self.time_limit_s:g} s")


def _translate(step: str, exc: duckdb.Error, memory_limit: str) -> Exception:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:ERROR_LINE_CHARS_MAX]
    if isinstance(exc, duckdb.OutOfMemoryException):
        return LimitExceeded(f"step {step!r} exceeded the memory limit of {memory_limit}")
    if isinstance(exc, duckdb.PermissionException):
        return InputError(
            f"step {step!r} tried to reach files, the network or extensions, which the sandbox forbids: {text}"
        )
    return ExecutionError(f"step {step!r} failed: {text}")


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


def _cast_column(name: str, column: pa.ChunkedArray, declared: pa.DataType) -> pa.ChunkedArray:
    actual = column.type
    if actual == declared:
        return column
    if pa.types.is_floating(actual) and pa.types.is_decimal(declared):
        raise ExecutionError(
            f"column {name!r} is {actual} but the schema declares {declared}: a float-to-decimal cast "
            f"rounds silently, so cast in SQL instead (e.g. {name}::DECIMAL({declared.precision},{declared.scale}))"
        )
    try:
        return column.cast(declared, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        reason = (str(exc).strip().splitlines() or ["cast failed"])[0][:ERROR_LINE_CHARS_MAX]
        raise ExecutionError(
            f"column {name!r} is {actual} and cannot be cast to the declared {declared}: {reason}"
        ) from None


def cast_to_schema(table: pa.Table, declared: pa.Schema, step: str) -> pa.Table:
    """table cast column by column to the declared schema; names and order must already match."""
    if table.column_names != declared.names:
        raise ExecutionError(
            f"the result of step {step!r} has columns {table.column_names} but output.schema declares {declared.names}"
        )
    columns = [_cast_column(f.name, table.column(f.name), f.type) for f in declared]
    return pa.Table.from_arrays(columns, schema=declared)


def _run_steps(
    cursor: duckdb.DuckDBPyConnection,
    d: Definition,
    gated: list[sandbox.GatedStep],
    bound: dict[str, Any],
    limits: ExecutionLimits,
) -> pa.Table:
    with _Deadline(cursor, limits) as deadline:
        # Earlier steps become private TEMP tables that later steps read by name; the last step's
        # result is streamed straight out, in its own order.
        for step in gated[:-1]:
            params = {name: bound[name] for name in step.parameter_names}
            deadline.run(step.name, sandbox.materialize_statement(cursor, step), params)
        last = gated[-1]
        params = {name: bound[name] for name in last.parameter_names}
        return deadline.fetch_bounded(last.name, last.sql, params, d.output.max_rows)


def _register_sources(cursor: duckdb.DuckDBPyConnection, resolved: list[ResolvedSource]) -> None:
    for source in resolved:
        cursor.register(source.name, source.table)


def preflight(d: Definition, ctx: ExecutionContext) -> None:
    """Everything that can be refused without reading data: the SQL gate, undeclared $parameters and
    file paths outside the allowed roots. Call it before recording a run so hostile input leaves no trace.
    """
    cursor = sandbox.open_cursor(ctx.limits)
    try:
        _gate_all(cursor, d)
    finally:
        cursor.close()
    for name, spec in d.sources.items():
        path = getattr(spec, "path", None)
        if isinstance(path, str):
            confine_path(name, path, ctx)


def execute(
    d: Definition,
    params: Mapping[str, Any],
    ctx: ExecutionContext,
    sources: list[ResolvedSource] | None = None,
) -> ExecutionResult:
    """Resolve sources (unless given), run the steps sandboxed, type, bound and digest the result."""
    bound = parameters.bind_values(d, params)
    cursor = sandbox.open_cursor(ctx.limits)
    try:
        gated = _gate_all(cursor, d)  # refuse hostile SQL before reading any source
        resolved = sources if sources is not None else resolve_sources(d, ctx)
        _register_sources(cursor, resolved)
        raw = _run_steps(cursor, d, gated, bound, ctx.limits)
    finally:
        cursor.close()  # drops this execution's registered views and TEMP tables
    typed = cast_to_schema(raw, d.output.arrow_schema(), d.steps[-1].name).combine_chunks()
    ipc_bytes = results.encode_ipc(typed)
    if len(ipc_bytes) > d.output.max_bytes_int:
        raise LimitExceeded(
            f"the result is {len(ipc_bytes)} bytes as Arrow IPC, more than output.max_bytes = {d.output.max_bytes}"
        )
    recorded = tuple((s.name, s.kind, s.fingerprint) for s in resolved)
    return ExecutionResult(
        table=typed,
        row_count=typed.num_rows,
        output_digest=arrowdigest.output_digest(typed),
        ipc_bytes=ipc_bytes,
        source_fingerprint_digest=source_fingerprint_digest(resolved),
        sources=recorded,
    )
