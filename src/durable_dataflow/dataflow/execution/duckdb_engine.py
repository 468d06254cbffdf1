"""The DuckDB engine: bind the resolved sources, run the gated steps, stream the bounded result.

File sources (CSV, Parquet) are read by DuckDB itself through views over ``read_csv`` /
``read_parquet`` in a database confined to exactly those files (``sandbox.open_confined``); a Delta
snapshot is scanned as a pyarrow dataset with pushdown; a PostgreSQL query streams into a private
table; inline rows are registered as an Arrow table. A watch per execution, ticked by the process's one watcher
thread (execution.watcher), interrupts the engine when the time is up, or the process is interrupted,
and reports progress (docs/engines.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from durable_dataflow.core import crashpoints
from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, Interrupted, LimitExceeded
from durable_dataflow.dataflow.definitions import parameters
from durable_dataflow.dataflow.definitions.definitions import Definition, parse_arrow_type
from durable_dataflow.dataflow.execution import interruption, progress, resultstream, sandbox, typed_sources, watcher
from durable_dataflow.dataflow.execution.engine import PROGRESS_INTERVAL_S, RESULT_BATCH_ROWS, EngineRun
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, format_size
from durable_dataflow.dataflow.execution.postgres_source import PostgresStream
from durable_dataflow.dataflow.execution.sources import ArrowDataset, ArrowTable, FileScan, ResolvedSource


def _cancel_streams(streams: tuple[PostgresStream, ...]) -> None:
    """Cancel each PostgreSQL source query an execution may be waiting on; one failed cancel does not
    keep the others running."""
    for stream in streams:
        with contextlib.suppress(Exception):
            stream.cancel()


class _Watch:
    """The watch of one execution, ticked by the process's watcher thread (execution.watcher): interrupts
    the engine when the time budget runs out or the process is interrupted (an interruption is a deadline
    reached now), until the execution notices, and, when someone watches, reports the engine's progress
    and the result stream's size meanwhile. Once the ``with`` block is left it never touches the
    connection again (a late interrupt would stop the connection's next query)."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        limits: ExecutionLimits,
        deadline_at: float,
        sink: progress.ProgressSink | None,
        reports_percent: bool,
        streams: tuple[PostgresStream, ...] = (),
        own_text: str = "",
        interrupted: interruption.Interruption | None = None,
    ) -> None:
        self.con = con
        self.interruption = interrupted
        self.own_text = own_text  # the definition's SQL and names: what engine messages may quote
        self.deadline_at = deadline_at
        self.streams = streams  # queries the engine may be waiting on: cancelled with it
        self.time_limit_s = limits.time_limit_s
        self.memory_limit = limits.memory_limit
        # The shared database never spills; a confined one's limits carry the spill limit it was opened with.
        self.temp_limit = "no spilling" if limits.temp_bytes_max is None else format_size(limits.temp_bytes_max)
        self.sink = sink
        self.reports_percent = reports_percent
        self.collector: resultstream.ResultCollector | None = None
        self.fired = threading.Event()
        self._lock = threading.Lock()  # held by a tick; the block's end takes it to mark the watch done
        self._done = False
        self._next_report_at: float | None = None
        self._watcher = watcher.watcher()

    def __enter__(self) -> _Watch:
        now = time.monotonic()
        if self.sink is not None:
            self._next_report_at = now + PROGRESS_INTERVAL_S
        self._watcher.add(self, self._next_wake_at(now))
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:  # a tick under way ends first; none after this touches the connection
            self._done = True
        self._watcher.remove(self)

    # The declared-type checks of the bound sources (replaced by _bind_sources): a data error that one
    # of them reports is the source's invalid input, naming the source and the column.
    type_checks = typed_sources.TypeChecks()

    def tick(self, now: float) -> float | None:
        """What is due at ``now`` (watcher.Watched): the next instant to be woken at, None once done."""
        with self._lock:
            if self._done:
                return None
            if self.fired.is_set():  # an interrupt that lands between two statements is not kept: again
                self.con.interrupt()
                return now + interruption.POLL_S
            if now >= self.deadline_at or self._interrupted():
                self.fired.set()
                self.con.interrupt()
                if self.streams:  # a cancel request may wait on the network: never on the shared watcher thread
                    threading.Thread(target=_cancel_streams, args=(self.streams,), name="dataflow-source-cancel",
                                     daemon=True).start()  # fmt: skip
                return now + interruption.POLL_S
            if self._next_report_at is not None and now >= self._next_report_at:
                self._report()
                self._next_report_at = time.monotonic() + PROGRESS_INTERVAL_S
            return self._next_wake_at(now)

    def _next_wake_at(self, now: float) -> float:
        """The deadline, the next progress report, and the next look for an interruption: the earliest."""
        at = self.deadline_at
        if self._next_report_at is not None:
            at = min(at, self._next_report_at)
        if self.interruption is not None:
            at = min(at, now + interruption.POLL_S)
        return at

    def _interrupted(self) -> bool:
        return self.interruption is not None and self.interruption.requested

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

    def stopped(self, part: str) -> DataflowError:
        """Why the watch stopped the engine: the process's interruption, else the time limit."""
        cause = self.interruption.cause if self.interruption is not None else None
        if cause is not None:
            return Interrupted(f"{part} was interrupted ({cause.signal})")
        return LimitExceeded(f"{part} exceeded the time limit of {self.time_limit_s:g} s")

    def translate(self, step: str, exc: BaseException, what: str = "step") -> DataflowError:
        """An engine or Arrow error, raised while a statement ran, a source was bound or any batch was read.

        ``what`` names the part that failed (``step`` or ``source``) in the message."""
        if isinstance(exc, DataflowError):
            return exc
        text = sandbox.engine_message(exc, own_text=self.own_text)
        raw = str(exc)  # classified on the engine's own words, shown only as ``text``
        part = f"{what} {step!r}"
        if self.fired.is_set() or isinstance(exc, duckdb.InterruptException) or text.startswith("INTERRUPT"):
            return self.stopped(part)
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
        return self.type_checks.failure(raw) or ExecutionError(f"{part} failed: {text}")

    def run(self, step: str, statement: str, params: dict[str, Any]) -> None:
        """Execute one statement under the remaining budget, translating every error."""
        if self.fired.is_set():
            raise self.stopped(f"step {step!r}")
        try:
            self.con.execute(statement, params)
        except (duckdb.Error, pa.ArrowException, OSError) as exc:
            raise self.translate(step, exc) from None

    def stream(self, step: str, statement: str, params: dict[str, Any], collector: resultstream.ResultCollector,
               declared: pa.Schema) -> None:
        """Stream the statement's result into the collector, which stops at the first bound hit."""
        if self.fired.is_set():
            raise self.stopped(f"step {step!r}")
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


# A definition is immutable, so the steps it passed the gate with are kept per object (keyed by
# id(), dropped by a finalizer when it dies): a submit's preflight and the execution gate it once.
# A refusal is not kept; it is found again, as cheaply, on the next attempt.
_gated_by_id: dict[int, tuple[sandbox.GatedStep, ...]] = {}


def _gate(d: Definition, limits: ExecutionLimits) -> list[sandbox.GatedStep]:
    cached = _gated_by_id.get(id(d))
    if cached is not None:
        return list(cached)
    cursor = sandbox.open_cursor(limits)
    try:
        gated = _gate_all(cursor, d)
    finally:
        cursor.close()
    _gated_by_id[id(d)] = tuple(gated)
    weakref.finalize(d, _gated_by_id.pop, id(d), None)
    return gated


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


def _quoted(column: str) -> str:
    return '"' + column.replace('"', '""') + '"'


def _bind_csv(con: duckdb.DuckDBPyConnection, name: str, scan: FileScan, checks: typed_sources.TypeChecks) -> None:
    """A view over the file whose declared columns DuckDB's reader parses as declared; with the
    ``type_pushdown`` optimizer off (sandbox), no step's cast can make it read them as another type."""
    declared = scan.declared or {}
    if declared:
        checks.csv_files.update({s.path: (name, declared) for s in scan.stamps})
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


def _bind_parquet(con: duckdb.DuckDBPyConnection, name: str, scan: FileScan, checks: typed_sources.TypeChecks) -> None:
    """A view over the files; each declared column whose stored type differs is converted by a checked
    cast (typed_sources), so the steps see exactly the declared types."""
    con.execute(f'CREATE TEMP VIEW "{name}" AS SELECT * FROM {_scan_sql(scan, None)}')
    if scan.declared:
        _declare_types(con, name, _scan_sql(scan, None), scan.declared, checks)


def _declare_types(
    con: duckdb.DuckDBPyConnection, name: str, from_sql: str, declared_types: dict[str, str],
    checks: typed_sources.TypeChecks,
) -> None:
    """Replace the view ``name`` (over ``from_sql``) by one whose declared columns are converted by checked
    casts (typed_sources) where their stored type differs: the steps see exactly the declared types."""
    stored = {str(row[0]): str(row[1]) for row in con.execute(f'DESCRIBE "{name}"').fetchall()}
    missing = [c for c in declared_types if c not in stored]
    if missing:
        raise ExecutionError(f"source {name!r}: the files have no column {missing[0]!r} that its schema declares")
    columns = []
    for column, stored_type in stored.items():
        declared = duckdb_type(declared_types[column]) if column in declared_types else stored_type
        if _same_duckdb_type(declared, stored_type):
            columns.append(_quoted(column))
            continue
        marker = checks.add(name, column, declared_types[column])
        cast = typed_sources.duckdb_checked_cast(_quoted(column), stored_type, declared, marker)
        columns.append(f"{cast} AS {_quoted(column)}")
    con.execute(f'CREATE OR REPLACE TEMP VIEW "{name}" AS SELECT {", ".join(columns)} FROM {from_sql}')


def _bind_dataset(
    con: duckdb.DuckDBPyConnection, name: str, binding: ArrowDataset, checks: typed_sources.TypeChecks
) -> None:
    """A pyarrow dataset scanned with projection and filter pushdown; with declared types (a store's
    Parquet or CSV objects) a view of checked casts over it, registered under a name no source or step
    can have (it holds a space)."""
    # DuckDB recognises a dataset only once pyarrow.dataset is imported: an executor process unpickles
    # one without importing it.
    import pyarrow.dataset  # noqa: F401

    if not binding.declared:
        con.register(name, binding.dataset)
        return
    staging = f"dataflow dataset {name}"
    con.register(staging, binding.dataset)
    con.execute(f'CREATE TEMP VIEW "{name}" AS SELECT * FROM "{staging}"')
    _declare_types(con, name, f'"{staging}"', binding.declared, checks)


def _same_duckdb_type(declared: str, stored: str) -> bool:
    aliases = {"TIMESTAMPTZ": "TIMESTAMP WITH TIME ZONE"}
    return aliases.get(declared, declared) == aliases.get(stored, stored)


def _bind_one(con: duckdb.DuckDBPyConnection, source: ResolvedSource, checks: typed_sources.TypeChecks) -> None:
    name, binding = source.name, source.binding
    if isinstance(binding, ArrowTable):
        con.register(name, binding.table)
    elif isinstance(binding, ArrowDataset):
        _bind_dataset(con, name, binding, checks)
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
        _bind_csv(con, name, binding, checks)
    else:
        _bind_parquet(con, name, binding, checks)


def _bind_sources(con: duckdb.DuckDBPyConnection, resolved: list[ResolvedSource], watch: _Watch) -> None:
    watch.type_checks = typed_sources.TypeChecks()
    for source in resolved:
        if watch.fired.is_set():
            raise watch.translate(source.name, duckdb.InterruptException("INTERRUPT"), "source")
        try:
            _bind_one(con, source, watch.type_checks)
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
    interrupted: interruption.Interruption | None = None,
) -> resultstream.BoundedResult:
    declared = d.output.arrow_schema()
    bytes_max = d.output.max_bytes_int
    collector = resultstream.ResultCollector(
        declared, d.output.max_rows, bytes_max, f"output.max_bytes = {d.output.max_bytes}"
    )
    streams = tuple(s.binding for s in resolved if isinstance(s.binding, PostgresStream))
    own_text = "\n".join([*(s.sql for s in d.steps), *d.sources, *(s.name for s in d.steps), *d.output.columns])
    with _Watch(con, limits, deadline_at, sink, confined, streams, own_text, interrupted) as watch:
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



@contextlib.contextmanager
def _engine(
    limits: ExecutionLimits, resolved: list[ResolvedSource]
) -> Iterator[tuple[duckdb.DuckDBPyConnection, bool, ExecutionLimits]]:
    """The connection an execution runs on: its own confined database (True), or a shared cursor, with
    the limits it runs under (a confined database's with the spill limit it was opened with)."""
    if _needs_own_database(resolved):
        with sandbox.open_confined(limits, _allowed_paths(resolved)) as confined:
            yield confined.database, True, dataclasses.replace(limits, temp_bytes_max=confined.spill_bytes_max)
        return
    cursor = sandbox.open_cursor(limits)
    try:
        yield cursor, False, limits
    finally:
        cursor.close()  # drops this execution's registered views and TEMP tables


class DuckDBEngine:
    """The default engine (``engine: duckdb``)."""

    name = "duckdb"

    def gate(self, d: Definition, limits: ExecutionLimits) -> list[sandbox.GatedStep]:
        return _gate(d, limits)

    def run(self, job: EngineRun, gated: Sequence[object]) -> resultstream.BoundedResult:
        if job.crashpoints_reached:
            crashpoints.reach(crashpoints.DURING_EXECUTION)  # sources resolved, no step run yet
        steps = [step for step in gated if isinstance(step, sandbox.GatedStep)]
        d = job.definition
        bound = {name: parameters.to_python(d.parameters[name].type, value) for name, value in job.params.items()}
        resolved = list(job.resolved)
        with _engine(job.limits, resolved) as (con, confined, bounds):
            for step in steps:  # a step reads its sources by name, never their files (typed_sources)
                sandbox.refuse_server_reads(con, step)
            return _run_steps(con, d, steps, bound, resolved, bounds, job.deadline_at, job.progress_sink,
                              confined, job.interruption)


ENGINE = DuckDBEngine()


# ---- validation without data (``dataflow validate``, execution/validate.py) ------------------------


class StepBindError(InputError):
    """A step that does not bind over its sources' schemas; ``step`` names it."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"step {step!r}: {message}")
        self.step = step


def describe_sources(
    resolved: Sequence[ResolvedSource], limits: ExecutionLimits
) -> dict[str, pa.Schema | DataflowError]:
    """The schema each source presents to the steps, or why it cannot be bound. File sources are bound
    exactly as a run binds them (declared types, checked casts) in a confined database and read with
    ``LIMIT 0``: DuckDB reads a Parquet footer, and a CSV's header and sniffing sample, never the data
    pages. In-memory bindings (inline rows, a Delta snapshot) give their Arrow schema."""
    found: dict[str, pa.Schema | DataflowError] = {}
    # A dataset with declared types (a store's objects) is bound as a run binds it, like a file.
    files = [s for s in resolved if isinstance(s.binding, FileScan)
             or (isinstance(s.binding, ArrowDataset) and s.binding.declared)]  # fmt: skip
    for source in resolved:
        if isinstance(source.binding, ArrowTable):
            found[source.name] = source.binding.table.schema
        elif isinstance(source.binding, ArrowDataset) and not source.binding.declared:
            found[source.name] = source.binding.dataset.schema
    if not files:
        return found
    with sandbox.open_confined(limits, _allowed_paths(files)) as confined:
        con = confined.database
        for source in files:
            try:
                _bind_one(con, source, typed_sources.TypeChecks())
                found[source.name] = con.sql(f'SELECT * FROM "{source.name}" LIMIT 0').to_arrow_table().schema
            except (duckdb.Error, pa.ArrowException, OSError) as exc:
                found[source.name] = InputError(f"source {source.name!r} cannot be read: {sandbox.engine_message(exc)}")
            except DataflowError as error:
                found[source.name] = error
    return found


def bind_steps(
    d: Definition, schemas: dict[str, pa.Schema], bound: dict[str, Any], limits: ExecutionLimits
) -> pa.Schema:
    """The last step's result schema, every step bound over EMPTY tables of the sources' schemas on a
    cursor of the engine's own sandbox (same settings, same gate, same refusals): nothing is read.
    StepBindError names the first step that does not bind."""
    gated = _gate(d, limits)
    own_text = "\n".join([*(s.sql for s in d.steps), *d.sources, *(s.name for s in d.steps), *d.output.columns])
    cursor = sandbox.open_cursor(limits)
    try:
        for step in gated:
            sandbox.refuse_server_reads(cursor, step)
        for name, schema in schemas.items():
            cursor.register(name, schema.empty_table())
        for step in gated:
            params = {name: bound[name] for name in step.parameter_names}
            try:
                if step is gated[-1]:
                    return cursor.sql(step.sql, params=params).to_arrow_table().schema
                cursor.execute(sandbox.materialize_statement(cursor, step), params)
            except (duckdb.Error, pa.ArrowException) as exc:
                raise StepBindError(step.name, sandbox.engine_message(exc, own_text=own_text)) from None
    finally:
        cursor.close()
    raise InputError("a definition has at least one step")  # unreachable: steps has min_length 1
