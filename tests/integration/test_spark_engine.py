"""The Spark engine: every source kind, steps, parameters, bounds, the time limit, errors and isolation.

One Spark session serves the module (started through the engine, which keeps one per process); each
test runs definitions through ``execute`` like any other engine, several against DuckDB for digests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import spark_engine
from durable_dataflow.dataflow.execution.compute import ExecutionResult, execute, preflight

# No importorskip: without pyspark or Java the `spark` marker skips these locally and fails them in CI.
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits

pytestmark = pytest.mark.spark

INLINE = {"t": {"kind": "inline", "schema": {"n": "int64", "s": "string"},
                "rows": [{"n": 2, "s": "b"}, {"n": 1, "s": "a"}, {"n": 3, "s": None}]}}
TYPED = {"t": {"kind": "inline",
               "schema": {"n": "int32", "s": "string", "ts": "timestamp[us]", "tz": "timestamp[us, tz=UTC]",
                          "d": "decimal128(10, 3)"},
               "rows": [{"n": 2, "s": "b", "ts": "2024-03-01T10:20:30.123456", "tz": "2024-03-01T10:20:30+02:00",
                         "d": "1.500"}, {"n": 1, "s": "a", "d": "-2.250"}, {"n": 3}]}}


@pytest.fixture(scope="module", autouse=True)
def spark() -> Iterator[Any]:
    """The engine's own per-process session, started once for the module."""
    yield spark_engine.session()


def definition(sources: dict[str, Any], *sqls: str, schema: dict[str, str], engine: str = "spark",
               max_rows: int = 1000, max_bytes: str | int = "1MiB", parameters: dict[str, Any] | None = None,
               ) -> Definition:
    return Definition.model_validate({
        "name": "spark_test", "version": 1, "engine": engine, "sources": sources,
        "parameters": parameters or {},
        "steps": [{"name": f"s{i}", "sql": sql} for i, sql in enumerate(sqls)],
        "output": {"schema": schema, "max_rows": max_rows, "max_bytes": max_bytes},
    })


def run(d: Definition, tmp_path: Path, params: dict[str, Any] | None = None, **limits: Any) -> ExecutionResult:
    return execute(d, params or {}, ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(**limits)))


def test_inline_source_and_digest_equal_to_duckdb(tmp_path: Path) -> None:
    """Proves inline rows run on Spark (int32 widened, a wider decimal narrowed, wall-clock and UTC
    timestamps, nulls) and digest exactly like the same definition on DuckDB."""
    sql = "select n, s, ts, tz, d, d * 2 as d2 from t order by n, s, ts, tz, d, d2"
    schema = {"n": "int64", "s": "string", "ts": "timestamp[us]", "tz": "timestamp[us, tz=UTC]",
              "d": "decimal128(10, 3)", "d2": "decimal128(12, 3)"}
    on_spark = run(definition(TYPED, sql, schema=schema), tmp_path)
    on_duckdb = run(definition(TYPED, sql, schema=schema, engine="duckdb"), tmp_path)
    rows = on_spark.table.to_pylist()
    assert [(r["n"], r["s"], r["d2"]) for r in rows] == [(1, "a", Decimal("-4.500")), (2, "b", Decimal("3.000")),
                                                         (3, None, None)]
    assert str(rows[1]["ts"]) == "2024-03-01 10:20:30.123456" and str(rows[1]["tz"]) == "2024-03-01 08:20:30+00:00"
    assert on_spark.output_digest == on_duckdb.output_digest
    assert on_spark.source_fingerprint_digest == on_duckdb.source_fingerprint_digest


def test_parquet_file_and_folder_read_only_listed_files_and_match_duckdb(tmp_path: Path) -> None:
    """Proves a Parquet file (with a space and % in its name) and a folder are read from exactly their
    resolved files: a Parquet file without the .parquet name, which Spark would read in the folder, is
    not; digests equal DuckDB's."""
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"n": [1, 2]}), folder / "a b%.parquet")
    pq.write_table(pa.table({"n": [10]}), folder / "sub" / "c.parquet")
    pq.write_table(pa.table({"n": [1000]}), folder / "_skipped.parquet")
    pq.write_table(pa.table({"n": [10000]}), folder / ".hidden.parquet")
    pq.write_table(pa.table({"n": [100000]}), folder / "not_listed.data")  # Spark reads it in a folder
    sql = "select count(*) as rows_, sum(n) as total from t"
    schema = {"rows_": "int64", "total": "int64"}
    cases = (("folder", [{"rows_": 3, "total": 13}]), ("folder/a b%.parquet", [{"rows_": 2, "total": 3}]))
    for path, expected in cases:
        sources = {"t": {"kind": "parquet", "path": path}}
        on_spark = run(definition(sources, sql, schema=schema), tmp_path)
        on_duckdb = run(definition(sources, sql, schema=schema, engine="duckdb"), tmp_path)
        assert on_spark.table.to_pylist() == expected
        assert (on_spark.output_digest, on_spark.row_count) == (on_duckdb.output_digest, on_duckdb.row_count)


def test_csv_with_header_declared_types_by_name_and_inferred_others(tmp_path: Path) -> None:
    """Proves a CSV with a header types its declared columns by name (in any order) and infers the others;
    a declared column the file lacks is an ExecutionError naming it."""
    (tmp_path / "h.csv").write_text('id;price;note\n1;2.50;"x;y"\n2;3.25;"say ""hi"""\n')
    declared = {"note": "string", "price": "decimal128(10, 2)"}  # not in the header's order
    sources = {"t": {"kind": "csv", "path": "h.csv", "delimiter": ";", "schema": declared}}
    sql = "select id, price, note from t order by id"
    d = definition(sources, sql, schema={"id": "int64", "price": "decimal128(10, 2)", "note": "string"})
    assert run(d, tmp_path).table.to_pylist() == [
        {"id": 1, "price": Decimal("2.50"), "note": "x;y"},
        {"id": 2, "price": Decimal("3.25"), "note": 'say "hi"'},
    ]
    missing = {"t": {"kind": "csv", "path": "h.csv", "delimiter": ";", "schema": {"cost": "int64"}}}
    with pytest.raises(ExecutionError, match="source 't': the file has no column 'cost' that its schema declares"):
        run(definition(missing, "select 1 as id from t", schema={"id": "int64"}), tmp_path)


def test_csv_without_header_is_named_by_the_declared_schema_or_like_duckdb(tmp_path: Path) -> None:
    """Proves a headerless CSV takes its column names (and types) from the declared schema, in order, and
    without one is named column0.. like DuckDB, with the same digest."""
    (tmp_path / "n.csv").write_text("1,2024-01-05\n2,2024-02-29\n")
    typed = {"t": {"kind": "csv", "path": "n.csv", "header": False, "schema": {"k": "int32", "day": "date32"}}}
    result = run(definition(typed, "select k, day from t order by k", schema={"k": "int32", "day": "date32"}),
                 tmp_path)
    assert [str(r["day"]) for r in result.table.to_pylist()] == ["2024-01-05", "2024-02-29"]
    plain = {"t": {"kind": "csv", "path": "n.csv", "header": False}}
    sql = "select column0, column1 from t order by column0"
    schema = {"column0": "int64", "column1": "date32"}
    assert run(definition(plain, sql, schema=schema), tmp_path).output_digest == run(
        definition(plain, sql, schema=schema, engine="duckdb"), tmp_path).output_digest


def test_csv_bad_value_fails_without_quoting_the_file(tmp_path: Path) -> None:
    """Proves a CSV value that does not fit its declared type is invalid input naming the source and the
    column (declared source types, issue 26), without the canary value or the file path in the message."""
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n2,CANARY_7f3e_SECRET\n")
    d = definition({"t": {"kind": "csv", "path": "bad.csv", "schema": {"a": "int64", "b": "int64"}}},
                   "select a, b from t", schema={"a": "int64", "b": "int64"})
    with pytest.raises(InputError) as caught:
        run(d, tmp_path)
    message = str(caught.value)
    assert message.startswith("source 't': column 'b' holds a value that is not of its declared type int64")
    assert "CANARY" not in message and str(tmp_path) not in message and "\tat " not in message
    assert len(message) <= 340


def test_delta_snapshot_plain_and_partitioned(tmp_path: Path) -> None:
    """Proves a Delta source reads its pinned version, both unpartitioned (files read by Spark) and
    partitioned (partition values from the log), with DuckDB's digest."""
    deltalake = pytest.importorskip("deltalake")
    deltalake.write_deltalake(str(tmp_path / "plain"), pa.table({"n": [1, 2], "p": ["a", "b"]}))
    deltalake.write_deltalake(str(tmp_path / "plain"), pa.table({"n": [10], "p": ["a"]}), mode="append")
    deltalake.write_deltalake(str(tmp_path / "parted"), pa.table({"n": [1, 2, 3], "p": ["a", "b", "a"]}),
                              partition_by=["p"])
    sql = "select p, sum(n) as total from t group by p order by p"
    schema = {"p": "string", "total": "int64"}
    cases = [({"kind": "delta", "path": "plain", "version": 0}, [{"p": "a", "total": 1}, {"p": "b", "total": 2}]),
             ({"kind": "delta", "path": "plain"}, [{"p": "a", "total": 11}, {"p": "b", "total": 2}]),
             ({"kind": "delta", "path": "parted"}, [{"p": "a", "total": 4}, {"p": "b", "total": 2}])]
    for source, expected in cases:
        on_spark = run(definition({"t": source}, sql, schema=schema), tmp_path)
        assert on_spark.table.to_pylist() == expected
        assert on_spark.output_digest == run(definition({"t": source}, sql, schema=schema, engine="duckdb"),
                                             tmp_path).output_digest


def test_parameters_and_multi_step_definitions(tmp_path: Path) -> None:
    """Proves date, decimal and quoted string parameters reach Spark as typed literals, and later steps
    read earlier ones (each earlier step read twice), giving DuckDB's digest."""
    sources = {"t": {"kind": "inline", "schema": {"day": "date32", "amount": "decimal128(12, 2)", "who": "string"},
                     "rows": [{"day": "2024-01-01", "amount": "10.50", "who": "O'Brien \"x\""},
                              {"day": "2024-01-02", "amount": "99.99", "who": "O'Brien \"x\""},
                              {"day": "2024-01-03", "amount": "1.25", "who": "other"}]}}
    parameters = {"since": {"type": "date"}, "floor": {"type": "decimal"}, "who": {"type": "string"}}
    steps = ("select day, amount from t where day >= $since and amount > $floor and who = $who",
             "select count(*) as n, sum(amount) as total from s0",
             "select a.n, a.total, b.n as again from s1 a cross join s1 b")
    schema = {"n": "int64", "total": "decimal128(22, 2)", "again": "int64"}
    params = {"since": "2024-01-01", "floor": "10.00", "who": "O'Brien \"x\""}
    on_spark = run(definition(sources, *steps, schema=schema, parameters=parameters), tmp_path, params)
    assert on_spark.table.to_pylist() == [{"n": 2, "total": Decimal("110.49"),
                                           "again": 2}]
    on_duckdb = run(definition(sources, *steps, schema=schema, parameters=parameters, engine="duckdb"),
                    tmp_path, params)
    assert on_spark.output_digest == on_duckdb.output_digest


def test_result_bounds_rows_and_bytes(tmp_path: Path) -> None:
    """Proves output.max_rows and output.max_bytes stop the result with LimitExceeded, as on DuckDB."""
    sql = "select id as n from range(100000)"
    with pytest.raises(LimitExceeded, match=r"more than output.max_rows = 10 rows"):
        run(definition(INLINE, sql, schema={"n": "int64"}, max_rows=10), tmp_path)
    with pytest.raises(LimitExceeded, match=r"more than output.max_bytes = 4096"):
        run(definition(INLINE, sql, schema={"n": "int64"}, max_rows=1_000_000, max_bytes=4096), tmp_path)


def test_time_limit_stops_a_long_query_promptly(tmp_path: Path) -> None:
    """Proves a query far longer than the time limit stops within ~2 s of a 2 s limit with LimitExceeded
    naming the step, and the session still runs the next execution."""
    sql = "select count(*) as n from range(200000) a cross join range(200000) b where a.id + b.id < 0"
    started = time.monotonic()
    with pytest.raises(LimitExceeded, match=r"step 's0' exceeded the time limit of 2 s"):
        run(definition(INLINE, sql, schema={"n": "int64"}), tmp_path, time_limit_s=2)
    assert time.monotonic() - started < 4.5
    assert run(definition(INLINE, "select count(*) as n from t", schema={"n": "int64"}), tmp_path).row_count == 1


def test_data_error_withholds_the_value(tmp_path: Path) -> None:
    """Proves an ANSI cast error is an ExecutionError with Spark's error class and no quoted value."""
    d = definition(INLINE, "select cast(concat('ab', 'c', s) as int) as n from t", schema={"n": "int32"})
    with pytest.raises(ExecutionError, match=r"step 's0' failed: \[CAST_INVALID_INPUT\]") as caught:
        run(d, tmp_path)
    assert "abca" not in str(caught.value) and "(value withheld)" in str(caught.value)
    (tmp_path / "h.csv").write_text("hidden_header_name\n1\n")
    d = definition({"t": {"kind": "csv", "path": "h.csv"}}, "select * from t", "select nope from s0",
                   schema={"n": "int64"})
    with pytest.raises(ExecutionError, match=r"step 's1' failed: \[UNRESOLVED_COLUMN\.\w+\] .*`nope`") as caught:
        run(d, tmp_path)
    assert "hidden_header_name" not in str(caught.value)  # Spark's suggestion names a column of the file


def test_gate_refusal_needs_no_spark_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves reflect() and an undeclared parameter are refused as InputError by preflight and execute
    before the engine runs anything (the engine's run and the session are never called)."""
    def no_spark(*args: object) -> None:
        raise AssertionError("the gate must refuse before Spark is used")

    monkeypatch.setattr(spark_engine, "session", no_spark)
    ctx = ExecutionContext(tmp_path, (tmp_path,))
    reflect = definition(INLINE, "select n from t", "select reflect('java.lang.System', 'exit', '0') as n from s0",
                         schema={"n": "string"})
    for call in (lambda: preflight(reflect, ctx), lambda: execute(reflect, {}, ctx)):
        with pytest.raises(InputError, match=r"step 's1'.*reflect"):
            call()
    with pytest.raises(InputError, match=r"step 's0' uses \$x, which is not a declared parameter"):
        preflight(definition(INLINE, "select n from t where n = $x", schema={"n": "int64"}), ctx)


def test_concurrent_executions_do_not_see_each_others_views(tmp_path: Path) -> None:
    """Proves two executions in threads, with the same source and step names but other rows, each get
    their own result (a shared session would let one replace the other's views)."""
    results: dict[int, int] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def one(k: int) -> None:
        sources = {"t": {"kind": "inline", "schema": {"n": "int64"}, "rows": [{"n": k}] * k}}
        d = definition(sources, "select n from t",
                       "select sum(n) as n from s0 cross join (select id from range(300)) where id >= 0",
                       "select n from s1", schema={"n": "int64"})
        try:
            barrier.wait()
            for _ in range(3):
                results[k] = run(d, tmp_path).table.column("n")[0].as_py()
                assert results[k] == k * k * 300
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in (2, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert results == {2: 2 * 2 * 300, 7: 7 * 7 * 300}


def test_progress_is_reported_while_executing(tmp_path: Path) -> None:
    """Proves a watched execution reports the executing phase while Spark works. The query cannot end
    before its 2 s time limit, and the watch reports every 0.5 s before it fires that limit, so the
    reports do not depend on how fast this machine is."""
    from durable_dataflow.dataflow.execution import progress

    seen: list[progress.Progress] = []
    sql = "select count(*) as n from range(200000) a cross join range(200000) b where a.id + b.id < 0"
    context = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(time_limit_s=2))
    with pytest.raises(LimitExceeded, match=r"step 's0' exceeded the time limit of 2 s"):
        execute(definition(INLINE, sql, schema={"n": "int64"}), {}, context, progress_sink=seen.append)
    assert seen and all(p.phase is progress.Phase.EXECUTING and p.result_rows == 0 for p in seen)


def test_spark_conf_from_env_refuses_malformed_entries_without_echoing() -> None:
    """Proves DATAFLOW_SPARK_CONF parses newline- and ';'-separated pairs and refuses a malformed entry
    naming the variable and the entry's number, never its text."""
    env = {spark_engine.SPARK_CONF_ENV: "spark.driver.memory=2g; spark.sql.shuffle.partitions = 4\n"}
    assert spark_engine.spark_conf_from_env(env) == {"spark.driver.memory": "2g", "spark.sql.shuffle.partitions": "4"}
    with pytest.raises(InputError, match=r"DATAFLOW_SPARK_CONF: entry 2 is not key=value") as caught:
        spark_engine.spark_conf_from_env({spark_engine.SPARK_CONF_ENV: "a.b=1;hunter2-password"})
    assert "hunter2" not in str(caught.value)


@pytest.mark.postgres
def test_postgres_source_streams_into_spark(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves a PostgreSQL source's batches reach Spark typed (numeric, date) with DuckDB's digest, and a
    failing query is the stream's own error (naming the source), not one Spark wrapped."""
    import psycopg

    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table c (id bigint, credit numeric(12,2), since date)")
        conn.execute("insert into c values (1, 10.50, '2026-01-02'), (2, null, '2025-05-06')")
    monkeypatch.setenv("SPARK_PG_TEST_DSN", dsn)

    def pg(query: str, engine: str = "spark") -> Definition:
        sources = {"c": {"kind": "postgres", "dsn": {"secret": "SPARK_PG_TEST_DSN"}, "query": query}}
        return definition(sources, "select id, credit, since from c order by id", engine=engine,
                          schema={"id": "int64", "credit": "decimal128(12, 2)", "since": "date32"})

    on_spark = run(pg("select id, credit, since from c"), tmp_path)
    assert on_spark.table.column("credit").to_pylist() == [Decimal("10.50"), None]
    assert on_spark.output_digest == run(pg("select id, credit, since from c", "duckdb"), tmp_path).output_digest
    with pytest.raises(ExecutionError, match=r"^source 'c': the postgres query failed: .*\(SQLSTATE 22012\)$"):
        run(pg("select id, credit / 0 as credit, since from c"), tmp_path)
