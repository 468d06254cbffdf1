"""Declared source types on DuckDB: every declared column reaches the steps as its declared type, whatever
the step does with it, and a value that is not of that type fails the run as invalid input naming the
source and the column, never the value or the path (docs/engines.md, "Declared source types")."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.errors import ExecutionError, InputError
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from support import flows

BAD_VALUE = "abc-not-a-number"


def _run(tmp_path: Path, sources: dict[str, Any], sql: str, columns: dict[str, str]) -> list[dict[str, Any]]:
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    rows: list[dict[str, Any]] = execute(flows.one_step(sources, sql, columns), {}, ctx).table.to_pylist()
    return rows


def _refused(tmp_path: Path, sources: dict[str, Any], sql: str, columns: dict[str, str]) -> InputError:
    with pytest.raises(InputError) as caught:
        _run(tmp_path, sources, sql, columns)
    return caught.value


def _csv(tmp_path: Path, values: list[str]) -> dict[str, Any]:
    (tmp_path / "x.csv").write_text("n,s\n" + "".join(f"{v},r{i}\n" for i, v in enumerate(values)))
    return {"x": {"kind": "csv", "path": "x.csv", "schema": {"n": "int64"}}}


def _assert_names_source_and_column(error: InputError, tmp_path: Path, value: str) -> None:
    assert error.code == "invalid_input"
    assert "source 'x'" in error.message and "column 'n'" in error.message and "int64" in error.message
    assert value not in error.message and str(tmp_path) not in error.message and "x.csv" not in error.message


@pytest.mark.parametrize("sql", [
    "select n::varchar as v from x order by s",
    "select try_cast(n as varchar) as v from x order by s",
    "select v from (select n as v, s from x union all select 'z', 'zz') order by s",
])
def test_a_csv_column_declared_int64_reads_007_as_7_whatever_the_step_casts_it_to(tmp_path: Path, sql: str) -> None:
    """Proves `007` in a column declared int64 reaches a step that casts it to text (directly, with
    try_cast, or through a union with text) as the integer 7: the cast is not pushed into the reader."""
    rows = _run(tmp_path, _csv(tmp_path, ["007", "42"]), sql, {"v": "string"})
    assert [r["v"] for r in rows][:2] == ["7", "42"]


@pytest.mark.parametrize("sql", [
    "select n::varchar as v from x",
    "select cast(n as double)::varchar as v from x",
    "select n::varchar as v from x where s = 'r0'",
    "select v from (select n::varchar as v from x union all select 'z')",
])
def test_a_csv_value_that_is_not_the_declared_type_fails_naming_source_and_column(tmp_path: Path, sql: str) -> None:
    """Proves a value that does not parse as the declared int64 fails the run with invalid_input naming
    the source and the column but neither the value nor the file, even when the step casts the column to
    text or filters the row out after reading it."""
    error = _refused(tmp_path, _csv(tmp_path, ["007", BAD_VALUE]), sql, {"v": "string"})
    _assert_names_source_and_column(error, tmp_path, BAD_VALUE)


def test_an_earlier_step_that_materializes_a_csv_column_as_text_sees_the_typed_value(tmp_path: Path) -> None:
    """Proves a step materialized as a TEMP table (an earlier step) reads the declared type too: `007`
    arrives as 7, and `abc` fails as invalid input."""
    d = Definition.model_validate({
        "name": "f", "version": 1, "sources": _csv(tmp_path, ["007"]),
        "steps": [{"name": "t", "sql": "select n::varchar as v from x"}, {"name": "r", "sql": "select v from t"}],
        "output": {"schema": {"v": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
    })
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    assert execute(d, {}, ctx).table.to_pylist() == [{"v": "7"}]
    _csv(tmp_path, [BAD_VALUE])
    with pytest.raises(InputError) as caught:
        execute(d, {}, ctx)
    _assert_names_source_and_column(caught.value, tmp_path, BAD_VALUE)


@pytest.mark.parametrize("sql", [
    "select n::varchar as v from read_csv('{path}', all_varchar = true)",
    "select n::varchar as v from READ_CSV_AUTO(['{path}'])",
    "select n::varchar as v from '{path}'",
    'select n::varchar as v from "{path}"',
    "select n::varchar as v from x where n in (select n from sniff_csv('{path}'))",
    "with t as (select * from query('select * from read_csv(''{path}'')')) select n::varchar as v from t",
    "select v from (select 1) s, lateral (select n::varchar as v from main.read_csv('{path}'))",
    "select * from json_execute_serialized_sql(json_serialize_sql('select 1'))",
])
def test_a_step_cannot_read_its_declared_file_around_the_typed_source(tmp_path: Path, sql: str) -> None:
    """Proves a step that reads the declared CSV itself (a reader function, a replacement scan of its
    path, query(), a serialized statement; anywhere in the tree) is refused as invalid input before any
    step runs, so it cannot see the raw text of a column declared int64."""
    error = _refused(tmp_path, _csv(tmp_path, ["007", BAD_VALUE]), sql.format(path=tmp_path / "x.csv"), {"v": "string"})
    assert "reads files itself" in error.message and BAD_VALUE not in error.message


def _parquet(tmp_path: Path, column: pa.Array, declared: str) -> dict[str, Any]:
    rows = pa.array([f"r{i}" for i in range(len(column))])
    pq.write_table(pa.table({"n": column, "s": rows}), tmp_path / "p.parquet")
    return {"x": {"kind": "parquet", "path": "p.parquet", "schema": {"n": declared}}}


@pytest.mark.parametrize(("stored", "declared", "expected"), [
    (pa.array(["007", "42", None]), "int64", [7, 42, None]),
    (pa.array([7, 42, None], pa.int32()), "int64", [7, 42, None]),
    (pa.array([7.0, 42.0, None]), "int64", [7, 42, None]),
    (pa.array([7, 42, None], pa.int64()), "int8", [7, 42, None]),
])
def test_a_parquet_column_stored_as_another_type_reaches_the_step_as_declared(
    tmp_path: Path, stored: pa.Array, declared: str, expected: list[int | None]
) -> None:
    """Proves a Parquet column whose stored type differs from the declared one is converted before any
    step sees it: text that parses, a narrower or wider integer, a whole double; the step's cast to text
    sees the declared integer."""
    sources = _parquet(tmp_path, stored, declared)
    rows = _run(tmp_path, sources, "select n, n::varchar as v, typeof(n) as t from x order by s",
                {"n": declared, "v": "string", "t": "string"})
    assert [r["n"] for r in rows] == expected
    assert [r["v"] for r in rows] == [None if e is None else str(e) for e in expected]
    assert {r["t"] for r in rows} == {"BIGINT" if declared == "int64" else "TINYINT"}


@pytest.mark.parametrize(("stored", "declared", "bad"), [
    (pa.array(["007", BAD_VALUE]), "int64", BAD_VALUE),
    (pa.array([7.0, 1.5]), "int64", "1.5"),
    (pa.array([7, 300], pa.int64()), "int8", "300"),
    (pa.array([dt.datetime(2026, 11, 2), dt.datetime(2026, 11, 2, 10, 30)]), "date", "10:30"),
    (pa.array([1.25, 1.005]), "decimal(10,2)", "1.005"),
])
def test_a_parquet_value_that_does_not_convert_exactly_fails_naming_source_and_column(
    tmp_path: Path, stored: pa.Array, declared: str, bad: str
) -> None:
    """Proves a stored value that does not parse (text) or does not convert exactly (a fraction to an
    integer, an overflow, a time of day to a date, a lost decimal digit) fails as invalid input naming
    the source and the column, also when the step casts the column to text."""
    sources = _parquet(tmp_path, stored, declared)
    error = _refused(tmp_path, sources, "select n::varchar as v from x", {"v": "string"})
    assert error.code == "invalid_input" and "source 'x'" in error.message and "column 'n'" in error.message
    assert bad not in error.message and str(tmp_path) not in error.message


def test_a_declared_parquet_column_must_exist(tmp_path: Path) -> None:
    """Proves a declared column the Parquet file lacks fails the run, naming the column."""
    pq.write_table(pa.table({"n": [1]}), tmp_path / "p.parquet")
    sources = {"x": {"kind": "parquet", "path": "p.parquet", "schema": {"m": "int64"}}}
    with pytest.raises(ExecutionError, match="no column 'm' that its schema declares"):
        _run(tmp_path, sources, "select 1 as v", {"v": "int64"})


def test_a_schema_on_parquet_and_postgres_sources_leaves_existing_definitions_hashes_alone() -> None:
    """Proves the new optional `schema` of parquet and postgres sources is absent from the pinned body
    when not declared (an existing definition keeps its hash) and present, in order, when declared."""
    plain = flows.one_step({"p": {"kind": "parquet", "path": "p.parquet"},
                            "q": {"kind": "postgres", "dsn": {"secret": "S"}, "query": "select 1"}},
                           "select 1 as v", {"v": "int64"})
    body = definitions.canonical_body(plain)
    assert "schema" not in body["sources"]["p"] and "schema" not in body["sources"]["q"]
    typed = flows.one_step({"p": {"kind": "parquet", "path": "p.parquet", "schema": {"b": "int64", "a": "date"}}},
                           "select 1 as v", {"v": "int64"})
    assert definitions.canonical_body(typed)["sources"]["p"]["schema"] == [["b", "int64"], ["a", "date"]]
    assert Definition.model_validate(definitions.canonical_body(typed)) == typed
