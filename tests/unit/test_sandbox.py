"""User SQL runs sandboxed: only one SELECT, no files/extensions/settings, bounded in time and memory."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import sandbox
from durable_dataflow.dataflow.execution.compute import execute, preflight
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.sources import ArrowTable, ResolvedSource

THREADS = 2
RUNS_PER_THREAD = 15


def _definition(*sqls: str, columns: dict[str, str] | None = None, rows: list[dict[str, Any]] | None = None,
                max_rows: int = 1000) -> Definition:
    return Definition.model_validate({
        "name": "sandboxed", "version": 1,
        "sources": {"t": {"kind": "inline", "rows": rows if rows is not None else [{"n": 1}, {"n": 2}],
                          "schema": {"n": "int64"}}},
        "steps": [{"name": f"s{i}", "sql": sql} for i, sql in enumerate(sqls)],
        "output": {"schema": columns or {"n": "int64"}, "max_rows": max_rows, "max_bytes": "1MiB"},
    })


def _ctx(tmp_path: Path, **limits: Any) -> ExecutionContext:
    return ExecutionContext(base_dir=tmp_path, allowed_roots=(tmp_path,), limits=ExecutionLimits(**limits))


@pytest.mark.parametrize(
    ("sql", "statement_type"),
    [
        ("drop view t", "DROP"),
        ("copy (select 1) to '/tmp/dataflow-escape.csv'", "COPY"),
        ("attach ':memory:' as m", "ATTACH"),
        ("attach '/tmp/other.duckdb' as o", "ATTACH"),
        ("install httpfs", "LOAD"),
        ("load httpfs", "LOAD"),
        ("set enable_external_access = true", "SET"),
        ("reset lock_configuration", "SET"),
        ("pragma enable_profiling", "PRAGMA"),
        ("call pragma_version()", "CALL"),
        ("create table z as select 1 as n", "CREATE"),
        ("insert into t values (3)", "INSERT"),
        ("export database '/tmp/x'", "EXPORT"),
    ],
)
def test_non_select_statements_are_refused_before_running(tmp_path: Path, sql: str, statement_type: str) -> None:
    """Proves each non-SELECT statement is refused with an InputError naming the step and the statement type."""
    d = _definition("select n from t", sql)
    with pytest.raises(InputError, match=f"step 's1' must be a SELECT .*found a statement of type {statement_type}"):
        execute(d, {}, _ctx(tmp_path))


def test_preflight_refuses_without_reading_sources(tmp_path: Path) -> None:
    """Proves preflight() refuses hostile SQL, undeclared parameters and escaping paths, and passes good input."""
    ctx = _ctx(tmp_path)
    preflight(_definition("select n from t"), ctx)
    with pytest.raises(InputError, match="found a statement of type ATTACH"):
        preflight(_definition("attach ':memory:' as m"), ctx)
    with pytest.raises(InputError, match=r"uses \$day"):
        preflight(_definition("select n from t where n = $day"), ctx)
    escaping = Definition.model_validate({
        "name": "f", "version": 1, "sources": {"t": {"kind": "csv", "path": "/etc/passwd"}},
        "steps": [{"name": "s", "sql": "select 1 as n"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": 100},
    })
    with pytest.raises(InputError, match="resolves outside the run's data roots"):
        preflight(escaping, ctx)


def test_several_statements_are_refused(tmp_path: Path) -> None:
    """Proves a string with two statements (even two SELECTs) is refused, naming the count."""
    d = _definition("select n from t; drop view t")
    with pytest.raises(InputError, match="step 's0' must be exactly one SELECT statement, found 2 statements"):
        execute(d, {}, _ctx(tmp_path))


def test_refusal_happens_before_any_step_runs(tmp_path: Path) -> None:
    """Proves the gate checks every step first: a bad last step stops a runaway first step from starting."""
    runaway = "with recursive r(n) as (select 1 union all select n + 1 from r) select count(*) as n from r"
    d = _definition(runaway, "drop view t")
    with pytest.raises(InputError, match="DROP"):
        execute(d, {}, _ctx(tmp_path, time_limit_s=30))


@pytest.mark.parametrize(
    "sql",
    [
        "select count(*) as n from read_csv('/etc/passwd')",
        "select count(*) as n from read_text('/etc/passwd')",
        "select count(*) as n from glob('/etc/*')",
        "select count(*) as n from read_parquet('https://example.com/x.parquet')",
    ],
)
def test_file_and_network_access_in_a_select_is_refused(tmp_path: Path, sql: str) -> None:
    """Proves a SELECT that reads files or the network fails with an InputError saying the sandbox forbids it."""
    with pytest.raises(InputError, match="step 's0' tried to reach files, the network or extensions"):
        execute(_definition(sql), {}, _ctx(tmp_path))


def test_sql_errors_name_the_step(tmp_path: Path) -> None:
    """Proves an ordinary SQL error is an ExecutionError naming the step; a parse error an InputError."""
    with pytest.raises(ExecutionError, match=r"step 's1' failed: .*no_such_table"):
        execute(_definition("select n from t", "select n from no_such_table"), {}, _ctx(tmp_path))
    with pytest.raises(InputError, match="step 's0': the SQL does not parse"):
        execute(_definition("selec n frm t"), {}, _ctx(tmp_path))


def test_undeclared_parameter_is_refused(tmp_path: Path) -> None:
    """Proves a step using $x that the definition does not declare is refused before running."""
    with pytest.raises(InputError, match=r"step 's0' uses \$x, which is not a declared parameter"):
        execute(_definition("select n from t where n = $x"), {}, _ctx(tmp_path))


def test_query_that_never_ends_hits_the_time_limit_and_database_stays_usable(tmp_path: Path) -> None:
    """Proves an endless recursive CTE stops at the time limit with LimitExceeded, and the sandbox still works."""
    runaway = "with recursive r(n) as (select 1 union all select n + 1 from r) select count(*) as n from r"
    with pytest.raises(LimitExceeded, match=r"step 's0' exceeded the time limit of 0\.5 s"):
        execute(_definition(runaway), {}, _ctx(tmp_path, time_limit_s=0.5))
    after = execute(_definition("select sum(n) as n from t"), {}, _ctx(tmp_path, time_limit_s=0.5))
    assert after.table.to_pylist() == [{"n": 3}]


def test_exploding_cross_join_hits_the_time_limit(tmp_path: Path) -> None:
    """Proves an exploding cross join is stopped by the time limit, naming the limit."""
    cross = "select count(*) as n from range(100000) a, range(100000) b, range(1000) c"
    with pytest.raises(LimitExceeded, match="exceeded the time limit"):
        execute(_definition(cross), {}, _ctx(tmp_path, time_limit_s=0.5))


def test_query_that_exhausts_memory_hits_the_memory_limit(tmp_path: Path) -> None:
    """Proves a query that needs more memory than the limit fails with LimitExceeded naming the memory limit.

    The 64 MB database is a separate sandbox database (limits are per database), so the shared one is
    unaffected.
    """
    hog = "select list(range) as l from range(50000000)"  # one 400 MB list, kept as the step's result
    d = _definition(hog, "select len(l) as n from s0")
    with pytest.raises(LimitExceeded, match="step 's0' exceeded the memory limit of 64MiB"):
        execute(d, {}, _ctx(tmp_path, memory_bytes_max=64 * 1024**2, time_limit_s=60))


def test_registered_views_and_temp_tables_are_private_to_a_cursor() -> None:
    """Proves two cursors on the shared database see only their own view 't' and TEMP table 's0', interleaved."""
    limits = ExecutionLimits()
    first, second = sandbox.open_cursor(limits), sandbox.open_cursor(limits)
    try:
        first.register("t", pa.table({"n": [1]}))
        second.register("t", pa.table({"n": [2]}))
        first.execute('create temp table "s0" as select n * 10 as n from t')
        assert second.execute("select count(*) from duckdb_tables() where table_name = 's0'").fetchall() == [(0,)]
        second.execute('create temp table "s0" as select n * 100 as n from t')
        assert first.execute('select n from "s0"').fetchall() == [(10,)]
        assert second.execute('select n from "s0"').fetchall() == [(200,)]
    finally:
        first.close()
        second.close()


def test_concurrent_executions_in_threads_see_only_their_own_sources(tmp_path: Path) -> None:
    """Proves isolation under threads: each of two threads runs the same view name with its own data."""
    d = _definition("select sum(n) as n from t")
    ctx = _ctx(tmp_path)
    barrier = threading.Barrier(THREADS)
    seen: dict[int, list[int]] = {k: [] for k in range(THREADS)}
    failures: list[BaseException] = []

    def work(k: int) -> None:
        try:
            barrier.wait()
            for run in range(RUNS_PER_THREAD):
                value = k * 1000 + run
                table = pa.table({"n": pa.array([value], pa.int64())})
                source = ResolvedSource("t", "inline", ArrowTable(table), "sha256:x")
                seen[k].append(execute(d, {}, ctx, sources=[source]).table.column("n")[0].as_py())
        except BaseException as exc:  # collected and re-raised by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    for k in range(THREADS):
        assert seen[k] == [k * 1000 + run for run in range(RUNS_PER_THREAD)]


@pytest.mark.parametrize(
    "sql",
    [
        "select count(*)::varchar as s from duckdb_secrets()",
        "select current_setting('secret_directory') as s",
        "select string_agg(name || '=' || value, ';') as s from duckdb_settings()",
    ],
)
@pytest.mark.parametrize("confined", [False, True])
def test_a_step_learns_nothing_of_the_service_users_home(tmp_path: Path, sql: str, confined: bool) -> None:
    """Proves DuckDB's secret manager points nowhere: by default duckdb_secrets() fails quoting
    ~/.duckdb/stored_secrets and duckdb_settings() shows it, handing the home folder to a step."""
    # A CSV source makes the execution use a confined database of its own; inline-only the shared one.
    (tmp_path / "t.csv").write_text("n\n1\n")
    sources = {"t": {"kind": "csv", "path": "t.csv"}} if confined else None
    document = _definition(sql, columns={"s": "string"}).model_dump(mode="json")
    if sources is not None:
        document["sources"] = sources
    home = str(Path.home())
    try:
        value = str(execute(Definition.model_validate(document), {}, _ctx(tmp_path)).table.column("s")[0])
    except (ExecutionError, InputError) as error:
        value = error.message
    assert home not in value and ".duckdb" not in value, value


VALUE_CANARY = "VALUE-CANARY-41c9"


@pytest.mark.parametrize(
    ("sql", "columns"),
    [
        ("select line::int as n from t", None),
        ("select cast(line as date)::varchar as s from t", {"s": "string"}),
        ("select strptime(line, '%Y')::varchar as s from t", {"s": "string"}),
        ("select error(line) as s from t", {"s": "string"}),
        ("select (select string_agg(line, ';') from t)::int as n", None),
        ("select regexp_matches('x', line || '(')::varchar as s from t", {"s": "string"}),
        ("select line::json::varchar as s from t", {"s": "string"}),
        ("select line::uuid::varchar as s from t", {"s": "string"}),
        ("select line as n from t", None),  # the declared int64 output cast, done by Arrow
    ],
)
def test_an_error_never_quotes_a_data_value(tmp_path: Path, sql: str, columns: dict[str, str] | None) -> None:
    """Proves conversion and input errors withhold the values they would quote: a run's stored error
    message is no channel for the data it read (DuckDB says `Could not convert string "…"`)."""
    (tmp_path / "t.csv").write_text(f"line\n{VALUE_CANARY}\n")
    document = _definition(sql, columns=columns).model_dump(mode="json")
    document["sources"] = {"t": {"kind": "csv", "path": "t.csv", "schema": {"line": "string"}}}
    with pytest.raises((ExecutionError, InputError)) as failed:
        execute(Definition.model_validate(document), {}, _ctx(tmp_path))
    assert VALUE_CANARY not in failed.value.message, failed.value.message


def test_a_csv_that_does_not_fit_its_schema_names_the_column_not_the_value(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text(f"n\n{VALUE_CANARY}\n")
    document = _definition("select n from t").model_dump(mode="json")
    document["sources"] = {"t": {"kind": "csv", "path": "t.csv", "schema": {"n": "int64"}}}
    # A declared column's value that does not parse is the source's invalid input (typed_sources).
    with pytest.raises(InputError, match="source 't': column 'n' holds a value that is not of its declared type") \
            as failed:
        execute(Definition.model_validate(document), {}, _ctx(tmp_path))
    assert VALUE_CANARY not in failed.value.message
