"""The Spark SQL gate's rendered SQL, run on one local Spark session per module (marker ``spark``).

Split from tests/unit/test_spark_gate.py (issue 28, item 6): the unit tier starts no JVM.
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

from durable_dataflow.dataflow.execution.spark_gate import gate_step, render
from support.spark_gate_cases import FUNCTION_SAMPLES, HOSTILE, Q1, Q3, Q6, Q_CTE, TPCH_VALUES, gate, sample_query

SPARK_VIEWS = {  # the temp views the Spark tests read
    "lineitem": (
        "values (1, 10.00, 100.00, 0.05, 0.01, 'A', 'F', date'1994-03-01'),"
        " (1, 20.00, 200.00, 0.06, 0.02, 'N', 'O', date'1995-04-01'),"
        " (2, 5.00, 50.00, 0.07, 0.00, 'A', 'F', date'1994-06-01'),"
        " (3, 30.00, 300.00, 0.10, 0.03, 'R', 'F', date'1999-01-01')"
        " as v(l_orderkey, l_quantity, l_extendedprice, l_discount, l_tax, l_returnflag, l_linestatus,"
        " l_shipdate)"
    ),
    "orders": (
        "values (1, 1, date'1995-03-01', 0, 300.00), (2, 2, date'1994-05-01', 0, 50.00),"
        " (3, 1, date'1998-12-01', 0, 300.00) as v(o_orderkey, o_custkey, o_orderdate, o_shippriority,"
        " o_totalprice)"
    ),
    "customer": (
        "values (1, 'Customer#1', 'BUILDING', 10.0), (2, 'Customer#2', 'AUTOMOBILE', 20.0),"
        " (3, 'Bob', 'BUILDING', null) as v(c_custkey, c_name, c_mktsegment, c_acctbal)"
    ),
    "f": (
        "select 7 as i, 2.5D as x, 'Abc,def' as s, date'2026-11-02' as d,"
        " timestamp'2026-11-02 08:30:00' as ts, array(3, 1, 2) as arr, '{\"a\": 1, \"b\": \"x\"}' as j,"
        " map('k', 1) as m, true as b, 1700000000L as n"
    ),
}


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.logger import PySparkLogger
    from pyspark.sql import SparkSession

    from durable_dataflow.dataflow.execution import spark_engine

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL + 1)
    # An engine session left by an earlier module of this process has the engine's settings (substitution
    # off): getOrCreate would return it. And pyspark's mark of a process that made a Connect session
    # would make the builder build a Connect one.
    spark_engine.stop_session()
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    session = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "1")
        # The views hold a few rows: compiling generated code would cost more than running the queries.
        .config("spark.sql.codegen.wholeStage", "false")
        .config("spark.sql.codegen.factoryMode", "NO_CODEGEN")
        .config("spark.sql.adaptive.enabled", "false")
        # Spark's default, stated: the substitution test shows what the engine turns off, and a JVM that
        # served the engine earlier in this process may still carry the engine's setting.
        .config("spark.sql.variable.substitute", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    for name, body in SPARK_VIEWS.items():
        query = body if body.startswith("select") else f"select * from {body}"
        session.sql(f"create or replace temp view {name} as {query}")
    try:
        yield session
    finally:
        session.stop()


@pytest.mark.spark
def test_spark_returns_hostile_and_typed_parameters_exactly(spark: Any) -> None:
    """On real Spark, every hostile string comes back exactly as given and each typed literal has its
    value and type, and so do the user's own escaped literals; the same session shows why '${' is refused:
    Spark substitutes it into the text."""
    names = [f"v{number}" for number in range(len(HOSTILE))]
    bound: dict[str, tuple[str, Any]] = {n: ("string", v) for n, v in zip(names, HOSTILE, strict=True)}
    bound |= {
        "i": ("int", -5), "f": ("float", 0.1), "tiny": ("float", 5e-324), "b": ("bool", True),
        "d": ("date", "2026-11-02"), "ltz": ("timestamp", "2026-11-02T09:30:00+01:00"),
        "ntz": ("timestamp", "2026-11-02T08:30:00.25"), "dec": ("decimal", "-12.3"),
    }  # fmt: skip
    sql = (
        "select " + ", ".join(f"${n} as {n}" for n in names) + ", $i as i, $f as f, $tiny as tiny, $b as b,"
        " $d as d, cast($ltz as string) as ltz, cast($ntz as string) as ntz, $dec as dec,"
        " typeof($dec) as dec_type, typeof($ntz) as ntz_type, typeof($i) as i_type"
    )
    row = spark.sql(render(gate_step("x", sql, ()), bound)).collect()[0].asDict()
    assert [row[n] for n in names] == list(HOSTILE)
    assert row["i"] == -5 and row["f"] == 0.1 and row["tiny"] == 5e-324 and row["b"] is True
    assert row["d"] == dt.date(2026, 11, 2) and row["dec"] == decimal.Decimal("-12.3")
    assert (row["ltz"], row["ntz"]) == ("2026-11-02 08:30:00", "2026-11-02 08:30:00.25")
    assert (row["dec_type"], row["ntz_type"], row["i_type"]) == ("decimal(3,1)", "timestamp_ntz", "int")
    # A user's own literals are printed by sqlglot with backslash escapes, which Spark reads back the same.
    own = spark.sql(render(gate("select 'it\\'s \\\\ \"x\"\\n--\\t' as v, '\\u0041\\%' as w"), {})).collect()[0]
    assert (own.v, own.w) == ("it's \\ \"x\"\n--\t", "A\\%")
    substituted = spark.sql("select '${system:user.home}' as v").collect()[0].v
    assert substituted != "${system:user.home}"


@pytest.mark.spark
def test_spark_runs_the_rendered_tpch_queries(spark: Any) -> None:
    """The rendered TPC-H-shaped queries run on Spark over small temp views and return the results
    worked out by hand."""

    def run(sql: str) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in spark.sql(render(gate(sql), TPCH_VALUES)).collect()]

    q1 = run(Q1)
    assert [(r[0], r[1], r[2], r[-1]) for r in q1] == [("A", "F", decimal.Decimal("15.00"), 2),
                                                        ("N", "O", decimal.Decimal("20.00"), 1)]
    assert run(Q3) == [(1, decimal.Decimal("188.0000"), dt.date(1995, 3, 1), 0)]
    assert run(Q6) == [(decimal.Decimal("8.5000"),)]
    assert run(Q_CTE) == [("Customer#1", 3, "many", 1, "1")]


@pytest.mark.spark
def test_spark_accepts_every_allow_listed_function_as_rendered(spark: Any) -> None:
    """Every allow-listed function, printed by the gate, is SQL Spark parses and analyses (resolves each
    function and checks its argument types) in four queries over a one-row view: scalars, aggregates,
    windows, generators. Analysis only: running 170 expressions once costs seconds of JVM warm-up."""
    for kind in ("scalar", "aggregate", "window", "generator"):
        samples = [s for k, s in FUNCTION_SAMPLES if k == kind]
        columns = spark.sql(render(gate(sample_query(kind, samples)), {})).columns
        assert len(columns) >= len(samples), kind


@pytest.mark.spark
def test_spark_reads_quoted_lateral_view_aliases_as_written(spark: Any) -> None:
    """The gate prints LATERAL VIEW's table and column aliases quoted, and Spark reads them as written:
    `x--` and `p q` name their views (before, `x--` reached Spark as x plus a comment, an error here)."""
    sql = (
        "select `x--`.`y--`, `p q`.`i/*`, `p q`.`c--` from f lateral view explode(arr) `x--` as `y--`"
        " lateral view outer posexplode(array(5)) `p q` as `i/*`, `c--` order by 1"
    )
    rows = spark.sql(render(gate(sql), {})).collect()
    assert [tuple(row) for row in rows] == [(1, 0, 5), (2, 0, 5), (3, 0, 5)]
    assert rows[0].__fields__ == ["y--", "i/*", "c--"]
