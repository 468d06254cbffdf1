"""Declared source types beyond DuckDB's own files: a PostgreSQL source (real server), the Spark engine and
the CLI. Every declared column reaches the steps as its declared type, and a value that is not of that
type fails the run as invalid input naming the source and the column, never the value or the path."""

from __future__ import annotations

import decimal
import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from support.cli import make_cli

BAD_VALUE = "abc-not-a-number"
SECRET = "DECLARED_TYPES_PG_DSN"


def _definition(sources: dict[str, Any], sql: str, columns: dict[str, str], engine: str = "duckdb") -> Definition:
    return Definition.model_validate({
        "name": "typed", "version": 1, "engine": engine, "sources": sources,
        "steps": [{"name": "r", "sql": sql}],
        "output": {"schema": columns, "max_rows": 100, "max_bytes": "1MiB"},
    })  # fmt: skip


def _execute(tmp_path: Path, d: Definition) -> list[dict[str, Any]]:
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    rows: list[dict[str, Any]] = execute(d, {}, ctx).table.to_pylist()
    return rows


def _assert_refused(tmp_path: Path, d: Definition, source: str, column: str, *hidden: str) -> None:
    with pytest.raises(InputError) as caught:
        _execute(tmp_path, d)
    message = caught.value.message
    assert caught.value.code == "invalid_input"
    assert f"source {source!r}" in message and f"column {column!r}" in message, message
    for text in (*hidden, str(tmp_path)):
        assert text not in message, message


@pytest.fixture
def typed_table(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A table `t` whose text column `n` holds '007' and whose numeric(12,3) column `amount` holds 1.250."""
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table t (id int, n text, amount numeric(12,3))")
        conn.execute("insert into t values (1, '007', 1.250), (2, '42', null)")
    monkeypatch.setenv(SECRET, dsn)
    return dsn


def _pg_source(query: str, schema: dict[str, str]) -> dict[str, Any]:
    return {"s": {"kind": "postgres", "dsn": {"secret": SECRET}, "query": query, "schema": schema}}


@pytest.mark.parametrize("engine", ["duckdb", pytest.param("spark", marks=pytest.mark.spark)])
def test_a_postgres_column_of_another_type_reaches_the_step_as_declared(
    typed_table: str, tmp_path: Path, engine: str
) -> None:
    """Proves a PostgreSQL text column declared int64 arrives as integers (`007` as 7, also when the step
    casts it back to text) and a numeric(12,3) declared decimal(12,2) as that decimal, on both engines."""
    sources = _pg_source("select id, n, amount from t order by id", {"n": "int64", "amount": "decimal(12,2)"})
    d = _definition(sources, "select n, cast(n as string) as v, amount from s order by id",
                    {"n": "int64", "v": "string", "amount": "decimal(12,2)"}, engine)
    assert _execute(tmp_path, d) == [{"n": 7, "v": "7", "amount": decimal.Decimal("1.25")},
                                     {"n": 42, "v": "42", "amount": None}]


@pytest.mark.parametrize("engine", ["duckdb", pytest.param("spark", marks=pytest.mark.spark)])
@pytest.mark.parametrize(("query", "column", "hidden"), [
    (f"select '{BAD_VALUE}'::text as n, 1.0::numeric(12,3) as amount", "n", BAD_VALUE),
    ("select '7'::text as n, 1.005::numeric(12,3) as amount", "amount", "1.005"),
])
def test_a_postgres_value_that_is_not_the_declared_type_fails_naming_source_and_column(
    typed_table: str, tmp_path: Path, engine: str, query: str, column: str, hidden: str
) -> None:
    """Proves a PostgreSQL value that does not parse (text declared int64) or does not convert exactly (a
    third decimal digit declared decimal(12,2)) fails as invalid input naming the source and the column,
    not the value, even when the step casts the column to text."""
    sources = _pg_source(query, {"n": "int64", "amount": "decimal(12,2)"})
    d = _definition(sources, f"select cast({column} as string) as v from s", {"v": "string"}, engine)
    _assert_refused(tmp_path, d, "s", column, hidden)


def _csv(tmp_path: Path, values: list[str]) -> dict[str, Any]:
    (tmp_path / "x.csv").write_text("n,s\n" + "".join(f"{v},r{i}\n" for i, v in enumerate(values)))
    return {"x": {"kind": "csv", "path": "x.csv", "schema": {"n": "int64"}}}


@pytest.mark.spark
def test_spark_reads_a_declared_csv_column_as_declared_and_names_a_bad_value_s_column(tmp_path: Path) -> None:
    """Proves the Spark engine gives a step that casts a CSV column declared int64 to text `7` for `007`,
    and fails a run whose column holds text that is not an integer as invalid input naming the source
    and the column, not the value or the file."""
    sql = "select cast(n as string) as v from x order by s"
    assert _execute(tmp_path, _definition(_csv(tmp_path, ["007", "42"]), sql, {"v": "string"}, "spark")) == [
        {"v": "7"}, {"v": "42"}]
    _assert_refused(tmp_path, _definition(_csv(tmp_path, ["007", BAD_VALUE]), sql, {"v": "string"}, "spark"),
                    "x", "n", BAD_VALUE, "x.csv")


@pytest.mark.spark
@pytest.mark.parametrize(("stored", "good"), [
    (pa.array(["007", "42"]), True), (pa.array([7.0, 42.0]), True),
    (pa.array(["007", BAD_VALUE]), False), (pa.array([7.0, 1.5]), False),
])
def test_spark_converts_a_parquet_column_stored_as_another_type_exactly(
    tmp_path: Path, stored: pa.Array, good: bool
) -> None:
    """Proves the Spark engine gives steps a Parquet column stored as text or double but declared int64 as
    int64 (`007` is 7, 42.0 is 42), and fails as invalid input on text that does not parse or a fraction."""
    pq.write_table(pa.table({"n": stored, "s": ["r0", "r1"]}), tmp_path / "p.parquet")
    sources = {"x": {"kind": "parquet", "path": "p.parquet", "schema": {"n": "int64"}}}
    d = _definition(sources, "select n, cast(n as string) as v from x order by s", {"n": "int64", "v": "string"},
                    "spark")
    if good:
        assert _execute(tmp_path, d) == [{"n": 7, "v": "7"}, {"n": 42, "v": "42"}]
    else:
        _assert_refused(tmp_path, d, "x", "n", BAD_VALUE, "1.5")


def test_cli_run_of_a_csv_value_that_is_not_its_declared_type_fails_invalid_input_and_publishes_nothing(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Proves `dataflow run` of a definition whose CSV source holds `abc` in a column declared int64 ends
    failed with invalid_input naming the source and the column (not the value), and its parquet target
    receives no data; the same definition over `007` publishes 7."""
    (tmp_path / "x.csv").write_text(f"n\n007\n{BAD_VALUE}\n")
    document = {
        "name": "typed", "version": 1,
        "sources": {"x": {"kind": "csv", "path": "x.csv", "schema": {"n": "int64"}}},
        "steps": [{"name": "r", "sql": "select n::varchar as v from x"}],
        "output": {"schema": {"v": "string"}, "max_rows": 10, "max_bytes": "1MiB"},
        "target": {"type": "datasources.publication", "provider": "parquet", "datasource": "analytics.typed",
                   "location": "warehouse/typed", "mode": "append"},
    }
    (tmp_path / "typed.yaml").write_text(json.dumps(document))
    cli = make_cli(sqlite_url, tmp_path)
    failed = cli("run", str(tmp_path / "typed.yaml"), "--idempotency-key", "bad", "--json")
    assert failed.code != 0, failed.output
    run = failed.json()
    assert run["status"] == "failed" and run["error_code"] == "invalid_input", run
    assert "source 'x'" in run["error_message"] and "column 'n'" in run["error_message"]
    assert BAD_VALUE not in failed.output and str(tmp_path) not in run["error_message"]
    assert not list((tmp_path / "warehouse").rglob("*.parquet"))
    (tmp_path / "x.csv").write_text("n\n007\n")
    ran = cli("run", str(tmp_path / "typed.yaml"), "--idempotency-key", "good", "--json")
    assert ran.code == 0, ran.output
    shown = cli("result", ran.json()["run_id"], "--format", "json")
    assert json.loads(shown.stdout) == [{"v": "7"}]
