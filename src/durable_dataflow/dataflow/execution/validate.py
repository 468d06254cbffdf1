"""Validation without data (``dataflow validate``, ``POST /v1/definitions/validate``): every check a run
would make that needs no row of data, each problem named with the step, source or column it concerns.

It checks the parameters (``definitions.parameters``), reads only the sources' schemas (a Parquet
footer, a CSV's header with its declared types, a Delta snapshot's schema, a PostgreSQL query
described with ``LIMIT 0`` on its read-only session), binds every step over EMPTY tables of those
schemas in the engine's own sandbox (``duckdb_engine.bind_steps``), and checks that the result has
the declared columns and that each converts to its declared type by the rule the engine applies to
the result (``resultstream.cast_batch``). The placement checks (the SQL gate, confinement, secrets,
the target's provider and preflight) are the caller's: ``dataflow.protocol.validation``. Nothing here
writes anything. A Spark definition is checked up to the bind, which would need a Spark session.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from durable_dataflow.core.errors import DataflowError, InputError
from durable_dataflow.dataflow.definitions import parameters
from durable_dataflow.dataflow.definitions.definitions import Definition, PostgresSource
from durable_dataflow.dataflow.execution import duckdb_engine, resultstream
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.postgres_source import PostgresStream
from durable_dataflow.dataflow.execution.sources import resolve_for_schemas

# Values a step is bound with when the parameters given do not fit: binding needs a value of the
# declared type, never a particular one (the problem with the parameter is reported on its own).
_PLACEHOLDERS: dict[str, Any] = {
    "string": "", "int": 0, "float": 0.0, "bool": False, "date": dt.date(2000, 1, 1),
    "timestamp": dt.datetime(2000, 1, 1), "decimal": decimal.Decimal(0),
}  # fmt: skip
# Decimal digits of the largest value of each integer width: an integer fits a decimal with as many
# digits before its point.
_INTEGER_DIGITS = {8: 3, 16: 5, 32: 10, 64: 20}
# DuckDB's binder names the column a step refers to but no relation has.
_REFERENCED_COLUMN = re.compile(r'Referenced column "([^"]+)" not found')
SPARK_NOT_BOUND = (
    "engine spark: the steps were gated but not bound (binding needs a Spark session); "
    "the output columns and types are checked when the run executes"
)


@dataclass(frozen=True)
class Problem:
    """One reason the definition would fail, with what it concerns (None: the definition as a whole)."""

    message: str
    step: str | None = None
    source: str | None = None
    column: str | None = None
    parameter: str | None = None

    def as_json(self) -> dict[str, str | None]:
        return dataclasses.asdict(self)


@dataclass
class Report:
    """What validation found: problems (the definition would fail), notes (what may still fail on
    values, or was not checked) and, once bound, the result's columns with their Arrow types."""

    name: str
    version: int
    engine: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    result_columns: list[tuple[str, str]] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "definition": {"name": self.name, "version": self.version, "engine": self.engine},
            "problems": [p.as_json() for p in self.problems],
            "notes": list(self.notes),
            "result_columns": [{"name": n, "type": t} for n, t in self.result_columns],
        }


def bound_parameters(d: Definition, raw: Mapping[str, Any], report: Report) -> dict[str, Any]:
    """The Python values steps bind with: the given ones when they fit, placeholders of the declared
    types otherwise (the problem is reported, naming the parameter)."""
    try:
        return parameters.bind_values(d, raw)
    except InputError as error:
        name = next((n for n in sorted(set(raw) | set(d.parameters)) if repr(n) in error.message), None)
        report.problems.append(Problem(error.message, parameter=name))
    return {name: _PLACEHOLDERS[spec.type] for name, spec in d.parameters.items()}


def _postgres_schema(name: str, spec: PostgresSource, ctx: ExecutionContext) -> pa.Schema:
    """The query's result schema, declared types applied, from the query wrapped in ``LIMIT 0`` on the
    source's own read-only session (``postgres_source``): the server plans it and returns no row."""
    query = spec.query.rstrip().rstrip(";")
    described = spec.model_copy(update={"query": f"SELECT * FROM (\n{query}\n) AS dataflow_validate LIMIT 0"})
    stream = PostgresStream(described, name, ctx.limits.source_bytes_max, ctx.limits.time_limit_s, ctx.secrets)
    try:
        schema, _batches = stream.batches()
        return schema
    finally:
        stream.close()


def source_schemas(d: Definition, ctx: ExecutionContext, report: Report) -> dict[str, pa.Schema]:
    """Each source's schema as the steps see it; a source that cannot be described is a problem."""
    schemas: dict[str, pa.Schema] = {}
    resolved = []
    for name, spec in d.sources.items():
        try:
            if isinstance(spec, PostgresSource):
                schemas[name] = _postgres_schema(name, spec, ctx)
            else:
                resolved.append(resolve_for_schemas(name, spec, ctx))
        except DataflowError as error:
            report.problems.append(Problem(error.message, source=name))
    for name, found in duckdb_engine.describe_sources(resolved, ctx.limits).items():
        if isinstance(found, DataflowError):
            report.problems.append(Problem(found.message, source=name))
        else:
            schemas[name] = found
    return {name: schemas[name] for name in d.sources if name in schemas}  # in definition order


def _integer_fits(actual: pa.DataType, declared: pa.DataType) -> bool:
    if pa.types.is_signed_integer(actual) == pa.types.is_signed_integer(declared):
        return bool(declared.bit_width >= actual.bit_width)
    return bool(pa.types.is_signed_integer(declared) and declared.bit_width > actual.bit_width)


def always_fits(actual: pa.DataType, declared: pa.DataType) -> bool:
    """Whether every value of ``actual`` converts to ``declared`` (a widening): otherwise the result's
    conversion depends on its values, and a value that does not fit fails the run."""
    if actual == declared or pa.types.is_null(actual) or pa.types.is_string(declared):
        return True
    if pa.types.is_integer(actual) and pa.types.is_integer(declared):
        return _integer_fits(actual, declared)
    if pa.types.is_floating(actual) and pa.types.is_floating(declared):
        return bool(declared.bit_width >= actual.bit_width)
    if pa.types.is_integer(actual) and pa.types.is_floating(declared):
        return bool(actual.bit_width <= 32 and declared.bit_width == 64)
    if pa.types.is_integer(actual) and pa.types.is_decimal(declared):
        return bool(declared.precision - declared.scale >= _INTEGER_DIGITS[actual.bit_width])
    if pa.types.is_decimal(actual) and pa.types.is_decimal(declared):
        whole_digits_fit = declared.precision - declared.scale >= actual.precision - actual.scale
        return bool(declared.scale >= actual.scale and whole_digits_fit)
    if pa.types.is_date(actual) and pa.types.is_timestamp(declared):
        return True
    return bool(pa.types.is_large_string(declared) and pa.types.is_string(actual))


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def check_output(d: Definition, step: str, result: pa.Schema, report: Report) -> None:
    """The result's columns against output.schema: names and order, then each column's type by the
    engine's cast rule over an empty column (it refuses what no value could convert), then text declared
    as another type (every value would be parsed when the run ends: a wrong declaration, or a cast the
    step should spell out)."""
    declared = d.output.arrow_schema()
    for column in declared.names:
        if column not in result.names:
            report.problems.append(Problem(
                f"the result of step {step!r} has no column {column!r} that output.schema declares", step=step,
                column=column,
            ))  # fmt: skip
    extra = [n for n in result.names if n not in declared.names]
    for column in extra:
        report.problems.append(Problem(
            f"the result of step {step!r} has a column {column!r} that output.schema does not declare", step=step,
            column=column,
        ))  # fmt: skip
    if not extra and len(result.names) == len(declared.names) and result.names != declared.names:
        report.problems.append(Problem(
            f"the result of step {step!r} has the declared columns in another order: output.schema declares "
            f"{declared.names}", step=step,
        ))  # fmt: skip
    for target in declared:
        if target.name in result.names:
            _check_column_type(step, target, result.field(target.name).type, report)


def _check_column_type(step: str, target: pa.Field, actual: pa.DataType, report: Report) -> None:
    empty = pa.RecordBatch.from_arrays([pa.array([], type=actual)], names=[target.name])
    try:
        resultstream.cast_batch(empty, pa.schema([target]))
    except DataflowError as error:
        report.problems.append(Problem(f"step {step!r}: {error.message}", step=step, column=target.name))
        return
    if _is_text(actual) and not _is_text(target.type):
        report.problems.append(Problem(
            f"column {target.name!r} of step {step!r} is text ({actual}) but output.schema declares {target.type}: "
            f"every value would be parsed when the run ends, and the first that does not parse fails it; declare "
            f"it string, or convert it in the step (CAST({target.name} AS ...))", step=step, column=target.name,
        ))  # fmt: skip
    elif not always_fits(actual, target.type):
        report.notes.append(
            f"column {target.name!r} of step {step!r} is {actual}, converted to the declared {target.type} when the "
            "run ends: a value that does not fit fails the run"
        )


def check_steps(d: Definition, raw_params: Mapping[str, Any], ctx: ExecutionContext, report: Report) -> None:
    """Parameters, source schemas, the bind over empty tables and the output's columns and types."""
    bound = bound_parameters(d, raw_params, report)
    schemas = source_schemas(d, ctx, report)
    if d.engine != "duckdb":
        report.notes.append(SPARK_NOT_BOUND)
        return
    missing = [name for name in d.sources if name not in schemas]
    if missing:
        report.notes.append(f"the steps were not bound: source {missing[0]!r} could not be described")
        return
    try:
        result = duckdb_engine.bind_steps(d, schemas, bound, ctx.limits)
    except duckdb_engine.StepBindError as error:
        named = _REFERENCED_COLUMN.search(error.message)
        report.problems.append(Problem(error.message, step=error.step, column=named.group(1) if named else None))
        return
    except DataflowError as error:  # a refusal of the sandbox, naming the step in its message
        report.problems.append(Problem(error.message, step=_step_named(d, error.message)))
        return
    report.result_columns = [(f.name, str(f.type)) for f in result]
    check_output(d, d.steps[-1].name, result, report)


def _step_named(d: Definition, message: str) -> str | None:
    return next((s.name for s in d.steps if f"step {s.name!r}" in message), None)


def new_report(d: Definition) -> Report:
    return Report(name=d.name, version=d.version, engine=d.engine)
