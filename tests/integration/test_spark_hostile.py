"""A hostile tenant and a careless user against the Spark engine (issue 14, item 3; docs/security.md).

Every attack goes through ``compute.preflight`` and ``compute.execute`` as a definition with
``engine: spark``; the gate's refusals must come before Spark is touched (the engine's session is
replaced by one that fails the test). What the gate lets through is checked twice: Spark's own parser
reads each rendering as nothing but declared relations and allow-listed functions, and the real engine
runs the attacks that only Spark can judge (memory and CPU bombs, strings that are not UTF-8, error
messages over a canary file, the session's own settings). The last tests run the same attacks through
a ``dataflow run`` subprocess, a real ``dataflow serve`` and a ``dataflow worker``; refusals there
record no run and start no Spark. The DuckDB hostile-SQL lists of the other suites run here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml

from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import spark_engine, spark_gate
from durable_dataflow.dataflow.execution.compute import execute, preflight

# No importorskip: without pyspark or Java the `spark` marker skips these locally and fails them in CI.
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from support.cli import make_cli
from support.hostile import canaries_in, start_server
from support.procs import alive

POLL_S = 0.1
ABANDONED_JOBS_WAIT_S = 30.0
JVM_GONE_WAIT_S = 10.0


def _stall_collects(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every collect (``DataFrame.toArrow``) wait up to 60 s for ``release``; ``entered`` is set once one waits."""
    from pyspark.sql.classic.dataframe import DataFrame

    entered, release = threading.Event(), threading.Event()
    real = DataFrame.toArrow

    def stalled(self: Any) -> Any:
        entered.set()
        release.wait(60)
        return real(self)

    monkeypatch.setattr(DataFrame, "toArrow", stalled)
    return entered, release


# The other suites' hostile lists, where they are module constants (imported, not copied).
from test_hostile_tenant import REFUSED_QUERIES, STEP_READS  # noqa: E402

from support.spark_gate_cases import FUNCTION_SAMPLES, Q1, Q3, Q6, Q_CTE, TPCH_VALUES, sample_query  # noqa: E402

pytestmark = pytest.mark.spark

CANARY = "cnry-7f3e-spark"
INLINE = {"t": {"kind": "inline", "schema": {"n": "int64", "s": "string"},
                "rows": [{"n": 1, "s": "a"}, {"n": 2, "s": "b"}]}}  # fmt: skip
V = {"v": "string"}


@pytest.fixture(scope="module", autouse=True)
def spark() -> Iterator[Any]:
    """The engine's own per-process session, started once for the module."""
    yield spark_engine.session()


@pytest.fixture(scope="module")
def warm(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One execution before the timing tests: a cold JVM binds its first source in seconds to tens of them."""
    run(definition("select s as v from t"), tmp_path_factory.mktemp("warm"))


def definition(sql: str | list[str], schema: dict[str, str] | None = None, sources: dict[str, Any] | None = None,
               parameters: dict[str, Any] | None = None, **limits: Any) -> Definition:
    sqls = [sql] if isinstance(sql, str) else sql
    document: dict[str, Any] = {
        "name": "hostile", "version": 1, "engine": "spark", "sources": INLINE if sources is None else sources,
        "parameters": parameters or {}, "steps": [{"name": f"s{i}", "sql": q} for i, q in enumerate(sqls)],
        "output": {"schema": schema or V, "max_rows": 1000, "max_bytes": "1MiB"},
    }  # fmt: skip
    if limits:
        document["limits"] = limits
    return Definition.model_validate(document)


def ctx(base: Path, time_limit_s: float = 120) -> ExecutionContext:
    return ExecutionContext(base, (base,), ExecutionLimits(time_limit_s=time_limit_s))


def run(d: Definition, base: Path, params: dict[str, Any] | None = None, time_limit_s: float = 120) -> Any:
    return execute(d, params or {}, ctx(base, time_limit_s))


def failure(d: Definition, base: Path, params: dict[str, Any] | None = None, time_limit_s: float = 120,
            ) -> DataflowError:
    with pytest.raises(DataflowError) as caught:
        run(d, base, params, time_limit_s)
    return caught.value


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's session and run fail the test: a refusal must come from the gate alone."""
    def refuse(*args: object) -> None:
        raise AssertionError("the gate must refuse before Spark is used")

    monkeypatch.setattr(spark_engine, "session", refuse)
    monkeypatch.setattr(spark_engine.SparkEngine, "_run", refuse, raising=False)


def assert_refused_before_spark(d: Definition, base: Path, *words: str) -> str:
    with pytest.raises(InputError) as by_preflight:
        preflight(d, ctx(base))
    with pytest.raises(InputError) as by_execute:
        execute(d, {name: "x" for name in d.parameters}, ctx(base))
    assert by_preflight.value.message == by_execute.value.message
    message = by_preflight.value.message
    assert message.startswith("step 's"), message
    for word in words:
        assert word in message, message
    return message


# ---- known-dangerous Spark SQL: refused by the gate, before anything runs ---------------------------

KNOWN_DANGEROUS = [
    ("select reflect('java.lang.System', 'getProperty', 'user.home') as v", "function reflect"),
    ("select java_method('java.lang.System', 'getenv', 'HOME') as v", "function java_method"),
    ("select try_reflect('java.lang.Runtime', 'getRuntime') as v", "function try_reflect"),
    ("select `reflect`('java.lang.System', 'getProperty', 'user.home') as v", "function reflect"),
    ("select ReFlEcT('java.lang.System', 'exit', '0') as v", "function ReFlEcT"),
    ("select s as v from t where s in (select java_method('java.lang.System', 'getenv', 'PATH'))", "java_method"),
    ("select cast(transform(array(1), x -> reflect('java.lang.System', 'getenv', 'HOME')) as string) as v",
     "function reflect"),
    ("select cast(aggregate(array(1), '', (a, x) -> java_method('java.lang.System', 'getenv', 'HOME')) as string)"
     " as v", "function java_method"),
    ("select cast(filter(array('x'), x -> try_reflect('java.lang.System', 'getenv', x) is null) as string) as v",
     "function try_reflect"),
    ("select value as v from text.`/etc/hostname`", "reads 'text./etc/hostname'"),
    ("select value as v from `text`.`/etc/hostname`", "reads 'text./etc/hostname'"),
    ("select * from parquet.`/etc`", "reads 'parquet./etc'"),
    ("select * from csv.`file:///etc/passwd`", "reads 'csv.file:///etc/passwd'"),
    ("select * from json.`/proc/self/environ`", "reads 'json./proc/self/environ'"),
    ("select * from orc.`/`", "reads 'orc./'"),
    ("select cast(content as string) as v from binaryFile.`/etc/hostname`", "reads 'binaryFile./etc/hostname'"),
    ("select * from delta.`/tmp`", "reads 'delta./tmp'"),
    ("select * from avro.`/tmp`", "reads 'avro./tmp'"),
    ("select * from `file:/etc/hostname`", "reads 'file:/etc/hostname'"),
    ("select * from read_files('/etc/hostname')", "table function read_files"),
    ("select transform('x') using 'cat /etc/hostname' as v", "script TRANSFORM"),
    ("select transform(s) using 'sh -c id' as (v string) from t", "script TRANSFORM"),
    ("from t select transform(s) using '/bin/sh'", "script TRANSFORM"),
    ("select '${env:HOME}' as v", "'${'"),
    ("select '${system:user.home}' as v", "'${'"),
    ("select '\\u0024{env:HOME}' as v", "'${'"),
    ("select '$\\{env:HOME}' as v", "'${'"),
    ("select 1 as `${spark.app.name}`", "'${'"),
    ("select ${day} as v", "not ${name}"),
    ("ADD JAR /tmp/x.jar", "must be a query"),
    ("ADD FILE /etc/passwd", "must be a query"),
    ("LIST FILES", "must be a query"),
    ("SET spark.sql.runSQLOnFiles=true", "must be a query"),
    ("SET spark.sql.variable.substitute=true", "must be a query"),
    ("RESET", "must be a query"),
    ("CREATE TEMPORARY FUNCTION f AS 'com.example.F'", "must be a query"),
    ("CREATE TEMPORARY VIEW t AS SELECT 'x' AS s", "must be a query"),
    ("CREATE OR REPLACE GLOBAL TEMPORARY VIEW v AS SELECT 1", "must be a query"),
    ("CACHE TABLE t", "must be a query"),
    ("CACHE LAZY TABLE c AS SELECT * FROM t", "must be a query"),
    ("UNCACHE TABLE t", "must be a query"),
    ("CLEAR CACHE", "must be a query"),
    ("EXECUTE IMMEDIATE 'select 1'", "must be a query"),
    ("DECLARE VARIABLE x STRING DEFAULT 'y'", "must be a query"),
    ("SET VAR x = 'y'", "must be a query"),
    ("DROP TEMPORARY VARIABLE x", "must be a query"),
    ("USE global_temp", "must be a query"),
    ("SHOW TABLES IN global_temp", "must be a query"),
    ("DESCRIBE t", "must be a query"),
    ("EXPLAIN SELECT 1", "must be a query"),
    ("INSERT OVERWRITE DIRECTORY '/tmp/out' SELECT * FROM t", "must be a query"),
    ("INSERT OVERWRITE LOCAL DIRECTORY '/tmp/x' STORED AS TEXTFILE SELECT 1", "must be a query"),
    ("LOAD DATA LOCAL INPATH '/etc/passwd' INTO TABLE t", "must be a query"),
    ("select * from identifier('t')", "table function identifier"),
    ("select identifier('s') as v from t", "function identifier"),
    ("select * from global_temp.x", "reads 'global_temp.x'"),
    ("select * from `global_temp`.`x`", "reads 'global_temp.x'"),
    ("select * from `global_temp.x`", "reads 'global_temp.x'"),
    ("select * from spark_catalog.default.t", "reads 'spark_catalog.default.t'"),
    ("select * from default.t", "reads 'default.t'"),
    ("select * from system.session.x", "reads 'system.session.x'"),
    ("select * from s1", "reads 's1'"),  # a later step
    ("select * from dataflow_runs", "reads 'dataflow_runs'"),
    ("select input_file_name() as v from t", "function input_file_name"),
    ("select input_file_block_start() as v from t", "function input_file_block_start"),
    ("select current_user() as v", "function current_user"),
    ("select current_user as v", "function current_user"),
    ("select user as v from t", "bare name 'user'"),
    ("select session_user() as v", "function session_user"),
    ("select current_database() as v", "function current_database"),
    ("select current_catalog() as v", "function current_catalog"),
    ("select version() as v", "function version"),
    ("select spark_partition_id() as v", "function spark_partition_id"),
    ("select cast(uuid() as string) as v", "function uuid"),
    ("select xpath_string('<a>x</a>', 'a') as v", "function xpath_string"),
    ("select cast(xpath('<!DOCTYPE x [<!ENTITY e SYSTEM \"file:///etc/passwd\">]><x>&e;</x>', 'x') as string) as v",
     "function xpath"),
    ("select url_decode(s) as v from t", "function url_decode"),
    ("select parse_url('http://x/', 'HOST') as v", "function parse_url"),
    ("select schema_of_json('{}') as v", "function schema_of_json"),
    ("select schema_of_csv('a') as v", "function schema_of_csv"),
    ("select cast(from_json('{}', schema_of_json('{\"a\": 1}')) as string) as v", "function schema_of_json"),
    ("select cast(from_csv('a', 'a string') as string) as v", "function from_csv"),
    ("select cast(from_xml('<a/>', 'a string') as string) as v", "function from_xml"),
    ("select cast(aes_decrypt(x'00', 'k') as string) as v", "function aes_decrypt"),
    ("select cast(decode(x'41', 'UTF-8') as string) as v", "function decode"),
    ("select cast(array_repeat(s, 100000000) as string) as v from t", "function array_repeat"),
    ("select space(100000000) as v", "is not allowed"),
    ("select raise_error(s) as v from t", "function raise_error"),
    ("select cast(assert_true(false) as string) as v", "function assert_true"),
    ("select default.upper(s) as v from t", "qualified function names"),
    ("select spark_catalog.default.f(s) as v from t", "qualified function names"),
    ("select system.builtin.reflect('a', 'b') as v", "qualified function names"),
    ("select s as v from t tablesample (1 rows)", "TABLESAMPLE"),
    ("with recursive r as (select 1 as n) select cast(n as string) as v from r", "WITH RECURSIVE"),
    ("select s as v from t; select 1", "exactly one query, found 2"),
    ("select s as v from t /* */; add jar x", "exactly one query, found 2"),
    ("select s as v from t -- x\n; set a=b", "exactly one query, found 2"),
    ("select 'it''s' as v", "write a quote inside a string"),
    ("select ? as v", "placeholders"),
    ("select :day as v", "placeholders"),
    ("select $1 as v", "plain name"),
    ("select * from explode(array(1))", "table function explode"),
    ("select * from stack(1, 1)", "table function stack"),
    ("select * from json_tuple('{}', 'a')", "table function json_tuple"),
    ("select cast(1 as `my type`) as v", "does not parse"),
    ("select " + "(" * 3000 + "1" + ")" * 3000 + " as v", "nested too deeply"),
    ("select " + "+".join(["n"] * 12_000) + " as v from t", "more than"),
]


@pytest.mark.parametrize(("sql", "rule"), KNOWN_DANGEROUS, ids=[f"k{i:03d}" for i in range(len(KNOWN_DANGEROUS))])
def test_known_dangerous_spark_sql_is_refused_before_spark_is_used(
    tmp_path: Path, no_spark: None, sql: str, rule: str
) -> None:
    """Proves reflect/java_method/try_reflect (also quoted, in any case, in subqueries and lambdas), file-path
    relations of every format, script TRANSFORM, ${…} substitution, ADD JAR/FILE, SET/RESET, temporary
    functions and views, CACHE, EXECUTE IMMEDIATE, session variables, IDENTIFIER(), catalog- and
    global_temp-qualified names, a later step's name, input_file_name/current_user and the other session
    functions, XML/URL/schema/crypto functions and multi-statement tricks are InputErrors from preflight and
    from execute alike, naming the step and the rule, with Spark never used."""
    assert_refused_before_spark(definition(["select s from t", sql]), tmp_path, rule)


# The DuckDB suites' hostile SQL (tests/unit/test_sandbox.py, tests/integration/test_data_path_attacks.py
# keep theirs inline in parametrize; the Spark-relevant ones are reproduced here).
DUCKDB_HOSTILE = [
    "drop view t", "copy (select 1) to '/tmp/dataflow-escape.csv'", "attach ':memory:' as m", "install httpfs",
    "load httpfs", "set enable_external_access = true", "reset lock_configuration", "pragma enable_profiling",
    "call pragma_version()", "create table z as select 1 as n", "insert into t values (3, 'x')",
    "export database '/tmp/x'", "select count(*) as n from read_csv('/etc/passwd')",
    "select count(*) as n from read_text('/etc/passwd')", "select count(*) as n from glob('/etc/*')",
    "select count(*) as n from read_parquet('https://example.com/x.parquet')", "select s from read_json('/etc/x.json')",
    "select content as s from read_blob('/etc/passwd')", "select * from parquet_metadata('/etc/x.parquet')",
    "select columns as s from sniff_csv('/etc/passwd')", "select s from '/etc/passwd'", "from '/etc/x.parquet'",
    "select s from query('select * from read_csv(''/etc/passwd'')')", "select s from query_table('/etc/passwd')",
    "select content as s from read_text('~/.bashrc')", "select extension_name as s from duckdb_extensions()",
    "select coalesce(max(name), 'none') as s from duckdb_secrets()",
    "select * from enable_logging(storage = 'file', storage_path = '/tmp/log')",
    "with c as (pragma enable_profiling) select 1", "select current_setting('secret_directory') as s",
    "select string_agg(name || '=' || value, ';') as s from duckdb_settings()",
    "select getenv('HOME') as s", "select * from (copy (select 1) to '/tmp/copy.csv')",
]


@pytest.mark.parametrize("sql", [*[p.values[0] for p in STEP_READS], *DUCKDB_HOSTILE],
                         ids=[*[str(p.id) for p in STEP_READS], *[f"d{i:02d}" for i in range(len(DUCKDB_HOSTILE))]])
def test_the_duckdb_hostile_sql_is_refused_on_spark_too(tmp_path: Path, no_spark: None, sql: str) -> None:
    """Proves every step attack of test_hostile_tenant (STEP_READS) and the DuckDB sandbox lists (file and
    network table functions, COPY/ATTACH/INSTALL/SET/PRAGMA, duckdb_* catalogs, getenv) is refused by the
    Spark gate before anything is recorded, without Spark."""
    assert_refused_before_spark(definition(sql.format(root="/r", cwd="/c", data="/d", sinks="/s", secrets="/x",
                                                      home="/h")), tmp_path)


@pytest.mark.parametrize("query", [p.values[0] for p in REFUSED_QUERIES], ids=[str(p.id) for p in REFUSED_QUERIES])
def test_postgres_source_scripts_are_refused_by_preflight_on_spark(
    tmp_path: Path, no_spark: None, query: str
) -> None:
    """Proves the PostgreSQL source's read-only check (test_hostile_tenant.REFUSED_QUERIES: scripts, COPY,
    SET ROLE, writing CTEs) holds for a definition whose steps run on Spark, before anything runs."""
    sources = {"src": {"kind": "postgres", "dsn": {"secret": "WAREHOUSE_DSN"}, "query": query.format(root="/r")}}
    with pytest.raises(InputError, match=r"^source 'src'"):
        preflight(definition("select cast(v as string) as v from src", sources=sources), ctx(tmp_path))


# ---- what the gate lets through: Spark's own parser reads it the same ------------------------------

# Accepted SQL with the odd corners of both parsers: quoting, escapes, comments, hints, keywords as names.
TRICKY = [
    "select `a``b`, `a``.``b`, `$x`, `{env:HOME}`, `/*+ x */`, `--`, `\n` from (select 1 as `a``b`, 2 as "
    "`a``.``b`, 3 as `$x`, 4 as `{env:HOME}`, 5 as `/*+ x */`, 6 as `--`, 7 as `\n`) q",
    "select '\\u0027) from x --', '\\\\', '\\\\\\'', 'a /* b', \"a'b\", \"a\\\\\", '\\U0001F600', '\\101', '\\z',"
    " '\\%\\_', '--', '*/', '$', '$' || '{env:HOME}', concat('$', '{system:user.home}'), '$' '{x}' from t",
    "select 1 /* a /* nested */ ; add jar x */ as v, '\t' /* c */ from t -- trailing",
    "select /*+ BROADCAST(u), REPARTITION(100000) */ t.s from t join u on t.s = u.s /*+ COALESCE(1) */",
    "select 1 as `select`, 2 as `from`, 3 as `reflect`, t.reflect, t.java_method, t.`current_user` from t",
    "select `select`.`from` from (select 1 as `from`) as `select`",
    "select user.s, `current_date`.s from t as user, t as `current_date`",
    "select x'', X'ABCDEF', 1L, 10Y, 1S, 1BD, 1.5F, 1.5D, 1e2D, .5, 5., 0x1F, 9223372036854775807 from t",
    "select * from t lateral view outer explode(array(1)) x as y lateral view json_tuple(s, 'a') j as a",
    "select * from t, lateral (select * from u) l join lateral (select t.s) x on true",
    "select s from t union select s from u minus select s from t except all select s from u",
    "with x as (select * from t), y as (select * from x) select * from y where s in (with q as (select 1) "
    "select * from q)",
    "select * exclude (s) from t natural join u",
    "select transform(array(1), x -> transform(array(x), y -> y + x)), filter(array(1), x -> x in (select 1)),"
    " aggregate(array(1), 0, (a, b) -> a + b, a -> a * 10), array_sort(array(1), (l, r) -> l - r) from t",
    "select s ->> 'a', s::struct<a:int>, cast(s as map<string, array<struct<x: int, `y z`: string>>>) from t",
    "select * from range(1, 10, 1, 2) r(x) where x in (select * from values (1), (2)) and exists (values (1))",
    "select s from t where s = $p and n < $q order by 1 limit $q",
    "from t select s where s is not null",
]
def _words(text: str) -> list[str]:
    return text.split()


# The function names Spark may read in a rendering: the allow-list as Spark spells it (reviewed by hand).
SPARK_FUNCTIONS = frozenset(_words("""
abs acos add_months aggregate approx_count_distinct array array_contains array_distinct array_except
array_intersect array_join array_max array_min array_position array_remove array_sort array_union arrays_overlap
arrays_zip ascii asin atan atan2 avg base64 between bit_length bool_and bool_or bround btrim cardinality cbrt
ceil chr coalesce collect_list collect_set concat concat_ws contains corr cos count count_if covar_pop covar_samp
crc32 cume_dist date_add date_format date_part date_trunc datediff day dayofmonth dayofweek dayofyear degrees
dense_rank endswith every exists exp explode extract filter first_value flatten floor forall format_number
format_string from_json from_unixtime get_json_object greatest hash hex hour if initcap inline inline_outer
interval isnan isnotnull isnull json_tuple kurtosis lag last_day last_value lead least left length levenshtein
ln locate log lower lpad make_date make_interval make_timestamp map map_filter map_from_arrays map_from_entries
map_keys map_values max max_by md5 median min min_by minute month months_between nanvl next_day nth_value
ntile nullif nvl2 octet_length percent_rank percentile pi pmod posexplode posexplode_outer positive power
quarter radians rank regexp_extract regexp_extract_all regexp_replace repeat replace reverse right round
row_number second sequence sha sha2 sign sin size skewness slice some soundex split split_part sqrt stack
startswith stddev stddev_pop stddev_samp str_to_map substring sum tan timestamp_seconds to_date to_json
to_timestamp transform transform_keys transform_values translate trim trunc try_add try_avg try_divide
try_multiply try_subtract try_sum try_to_number typeof unbase64 unhex unix_timestamp upper var_pop variance
weekday weekofyear width_bucket xxhash64 year zip_with
"""))
# Plan nodes that run programs, hint, change the session or reach the catalog other than by a relation name.
SPARK_REFUSED_NODES = ("ScriptTransformation", "UnresolvedHint", "Command", "SetCatalogAndNamespace",
                       "InsertIntoStatement", "CreateView", "CacheTable")


def _spark_reading(node: Any, found: dict[str, set[str]]) -> None:
    """Walk Spark's JSON plan: the relation names, function names and node classes it holds."""
    if isinstance(node, dict):
        kind = str(node.get("class", "")).rsplit(".", 1)[-1]
        if kind:
            found["classes"].add(kind)
        if kind == "UnresolvedFunction":
            found["functions"].add(str(node["nameParts"]).strip("[]").lower())
        elif kind == "UnresolvedGenerator":
            found["functions"].add(str(node["name"]["funcName"]).lower())
        elif kind == "UnresolvedRelation":
            found["relations"].add(str(node["multipartIdentifier"]).strip("[]").lower())
        elif kind == "UnresolvedTableValuedFunction":
            found["table_functions"].add(str(node["name"]).strip("[]").lower())
        for value in node.values():
            _spark_reading(value, found)
    elif isinstance(node, list):
        for value in node:
            _spark_reading(value, found)


def test_spark_reads_every_rendering_as_declared_relations_and_allowed_functions(spark: Any) -> None:
    """Proves there is no sqlglot-vs-Spark differential in what the gate renders: for every allow-listed
    function sample, the TPC-H shapes and queries full of quoting, escape, comment, hint, keyword and
    lambda corners, Spark's own parser reads the rendered text as relations that are declared (or CTEs of
    the query), functions of the reviewed allow-list and range() only, and no script, hint or command."""
    relations = ("lineitem", "orders", "customer", "t", "u", "f")
    corpus = [sample_query(kind, [s for k, s in FUNCTION_SAMPLES if k == kind])
              for kind in ("scalar", "aggregate", "window", "generator")]  # fmt: skip
    parser = spark._jsparkSession.sessionState().sqlParser()
    bound = {**TPCH_VALUES, "p": ("string", "it's ${env:HOME} \\ \n"), "q": ("int", 5)}
    for sql in [*corpus, Q1, Q3, Q6, Q_CTE, *TRICKY]:
        step = spark_gate.gate_step("x", sql, relations)
        text = spark_gate.render(step, {name: bound[name] for name in step.parameter_names})
        ctes = {cte.alias.lower() for cte in step.tree.find_all(spark_gate.exp.CTE)}
        found: dict[str, set[str]] = {"classes": set(), "functions": set(), "relations": set(),
                                      "table_functions": set()}  # fmt: skip
        _spark_reading(json.loads(parser.parsePlan(text).toJSON()), found)
        assert found["relations"] <= set(relations) | ctes, (sql, found["relations"])
        assert found["functions"] <= SPARK_FUNCTIONS, (sql, found["functions"] - SPARK_FUNCTIONS)
        assert found["table_functions"] <= {"range"}, (sql, found["table_functions"])
        refused = [c for c in found["classes"] if any(c.endswith(n) for n in SPARK_REFUSED_NODES)]
        assert not refused, (sql, refused)


def test_the_session_itself_refuses_file_relations_and_substitution(spark: Any) -> None:
    """Proves the second line behind the gate: in an execution's session (SESSION_CONF) Spark itself
    refuses text.`/etc/hostname` (runSQLOnFiles off) and leaves ${system:user.home} and ${env:HOME}
    unsubstituted, even in SQL the gate would never render."""
    session = spark.newSession()
    for key, value in spark_engine.SESSION_CONF.items():
        session.conf.set(key, value)
    with pytest.raises(Exception, match=r"TABLE_OR_VIEW_NOT_FOUND|UNSUPPORTED_DATASOURCE_FOR_DIRECT_QUERY|text"):
        session.sql("select * from text.`/etc/hostname`").collect()
    row = session.sql("select '${system:user.home}' as a, '${env:HOME}' as b").collect()[0]
    assert (row.a, row.b) == ("${system:user.home}", "${env:HOME}")


# ---- parameters, names, errors ------------------------------------------------------------------------

BREAKOUT_STRINGS = (
    "'", "\\", "\\'", "'; select reflect('java.lang.System', 'getProperty', 'user.home') --", "${env:HOME}",
    "${system:user.home}", "$", "{", "`) from t; --", "*/ select 1 /*", "a\x00b", "line\nbreak\r\n--", "\u2028",
    "é 𝄞 ｒｅｆｌｅｃｔ", "\\u0027", "X'41'", "",
)


def test_parameter_values_of_every_type_cannot_leave_their_literal(tmp_path: Path) -> None:
    """Proves values crafted to break out of a literal — quotes, backslashes, ${…}, comment markers,
    newlines, NUL, Unicode, a 10,000-character string — and the extremes of int, float, date, timestamp
    and decimal come back from Spark exactly, each as one typed value (one execution of one step)."""
    strings = {f"s{i}": value for i, value in enumerate((*BREAKOUT_STRINGS, "'\\$" * 3333 + "x"))}
    typed: dict[str, tuple[str, Any, str, Any]] = {  # name -> (type, given, output type, expected)
        "i_max": ("int", 2**53 - 1, "int64", 2**53 - 1), "i_min": ("int", -(2**53 - 1), "int64", -(2**53 - 1)),
        "f_big": ("float", 1.7976931348623157e308, "float64", 1.7976931348623157e308),
        "f_tiny": ("float", -5e-324, "float64", -5e-324), "b": ("bool", "off", "bool", False),
        "d_lo": ("date", "0001-01-01", "date32", "0001-01-01"), "d_hi": ("date", "9999-12-31", "date32", "9999-12-31"),
        "ts": ("timestamp", "2026-11-02T08:30:00.123456+14:00", "timestamp[us, tz=UTC]",
               "2026-11-01 18:30:00.123456+00:00"),
        "ntz": ("timestamp", "0001-01-01T00:00:00", "timestamp[us]", "0001-01-01 00:00:00"),
        "dec": ("decimal", "-9999999999999999999999999999", "decimal128(38, 0)",
                Decimal("-9999999999999999999999999999")),
        "frac": ("decimal", "0.00000000000000000000000000000000000001", "decimal128(38, 38)",
                 Decimal("1E-38")),
    }  # fmt: skip
    parameters = {n: {"type": "string"} for n in strings} | {n: {"type": t[0]} for n, t in typed.items()}
    schema = dict.fromkeys(strings, "string") | {n: t[2] for n, t in typed.items()}
    sql = "select " + ", ".join(f"${n} as {n}" for n in schema) + " from t where n = 1"
    params = strings | {n: t[1] for n, t in typed.items()}
    row = run(definition(sql, schema, parameters=parameters), tmp_path, params).table.to_pylist()[0]
    assert {n: row[n] for n in strings} == strings
    for name, (_, _, _, expected) in typed.items():
        got = row[name]
        assert (str(got) if isinstance(expected, str) else got) == expected, (name, got)


def test_column_names_that_are_sql_stay_names(tmp_path: Path) -> None:
    """Proves source and output column names holding backquotes, quotes, comment markers, ${…} and a
    statement are just names: the step reads them (quoted, or through *) and the result carries them."""
    names = ["a`b", "x` from t; --", "it's", "${env:HOME}", "/*+ x */", "select 1; drop", "_metadata"]
    sources = {"t": {"kind": "inline", "schema": dict.fromkeys(names, "string"),
                     "rows": [{name: f"v{i}" for i, name in enumerate(names)}]}}  # fmt: skip
    schema = dict.fromkeys(names, "string")
    assert run(definition("select * from t", schema, sources), tmp_path).table.to_pylist() == [
        {name: f"v{i}" for i, name in enumerate(names)}]
    quoted = ", ".join("`" + name.replace("`", "``") + "`" for name in names if "${" not in name)
    kept = {name: "string" for name in names if "${" not in name}
    assert run(definition(f"select {quoted} from t", kept, sources), tmp_path).row_count == 1


@pytest.fixture
def canary_files(tmp_path: Path) -> Path:
    """A CSV and a Parquet file whose values (and a header) hold the canary."""
    (tmp_path / "c.csv").write_text(f"s,j\n%q-{CANARY}-x,\"{{\"\"a\"\": {CANARY}}}\"\n")
    pq.write_table(pa.table({"s": [f"{CANARY}-p"], "n": [1]}), tmp_path / "p.parquet")
    return tmp_path


CANARY_SOURCES = {"c": {"kind": "csv", "path": "c.csv", "schema": {"s": "string", "j": "string"}},
                  "p": {"kind": "parquet", "path": "p.parquet"}}  # fmt: skip
CANARY_ERRORS = [
    "select cast(s as int) as v from c", "select format_string(s, 1) as v from c",
    "select cast(from_json(j, 'a int', map('mode', 'FAILFAST')) as string) as v from c",
    "select cast(to_date(s, 'yyyy') as string) as v from c",
    "select regexp_replace('x', concat('(', s), 'y') as v from c",
    "select cast(map_from_arrays(array(s, s), array(1, 2)) as string) as v from c",
    "select date_format(to_date('2020-01-01'), s) as v from c", "select nope as v from c",
    "select cast(s as interval day) as v from c", "select cast(_metadata.file_path as string) as v from p",
    "select cast(p._metadata as string) as v from p", "select cast(_metadata.file_name as string) as v from c",
]


def test_errors_never_quote_file_contents_paths_or_the_home_folder(canary_files: Path) -> None:
    """Proves Spark's errors over a canary file — a cast, a format string, FAILFAST JSON, a date pattern,
    a regex, a duplicate map key, an unresolved column (whose suggestion lists the file's header), a
    hidden _metadata column (file path, file name) — fail as ExecutionError without the canary, the
    file's folder or the service user's home, in one line of bounded length."""
    d = definition([*CANARY_ERRORS], sources=CANARY_SOURCES)  # only to check they all pass the gate
    assert len(d.steps) == len(CANARY_ERRORS)
    assert_canary_errors_withheld(canary_files)


def assert_canary_errors_withheld(canary_files: Path) -> None:
    """Each of CANARY_ERRORS fails as an ExecutionError of one bounded line without the canary, the
    files' folder or the home folder (also run through Spark Connect, test_spark_connect.py)."""
    sources = CANARY_SOURCES
    for sql in CANARY_ERRORS:
        error = failure(definition(sql, sources=sources), canary_files)
        message = error.message
        assert isinstance(error, ExecutionError), message
        assert CANARY not in message and str(canary_files) not in message and str(Path.home()) not in message, message
        assert "\n" not in message and len(message) <= 400, message


def test_no_execution_leaves_views_another_can_read(tmp_path: Path) -> None:
    """Proves an execution's sources and steps are gone from the shared context once it ends (no temp
    view in the process's session, nothing in global_temp), and a definition that names another one's
    source without declaring it is refused by the gate."""
    sources = {"secret_src": {"kind": "inline", "schema": {"s": "string"}, "rows": [{"s": CANARY}]}}
    assert run(definition(["select s from secret_src", "select s as v from s0"], sources=sources),
               tmp_path).row_count == 1
    base = spark_engine.session()
    assert [t.name for t in base.catalog.listTables()] == []
    assert [t.name for t in base.catalog.listTables("global_temp")] == []
    with pytest.raises(InputError, match="reads 'secret_src'"):
        preflight(definition("select s as v from secret_src"), ctx(tmp_path))


# ---- holes found: each fails without its fix ---------------------------------------------------------


def test_values_inside_in_is_refused_since_spark_reads_it_as_a_function(spark: Any, tmp_path: Path) -> None:
    """Hole (a sqlglot-vs-Spark differential): sqlglot read and printed `x IN (VALUES (1), (2))` as a VALUES
    relation, and Spark's parser reads the printed text as a call of a function named `values`, on no
    allow-list (it would resolve to whatever such a function the catalog held). Now refused; VALUES as a
    relation (FROM, JOIN, a CTE, IN (SELECT * FROM VALUES …), EXISTS) still passes."""
    parser = spark._jsparkSession.sessionState().sqlParser()
    printed = parser.parsePlan("SELECT 1 FROM `t` WHERE `n` IN (VALUES (1), (2))").toJSON()
    assert '"nameparts":"[values]"' in printed.lower()
    for sql in ("select s as v from t where n in (values (1), (2))", "select s as v from t where n in (values 1)"):
        assert_refused_before_spark(definition(sql), tmp_path, "VALUES is allowed only as a relation")
    for sql in ("select s as v from t where n in (select * from values (1), (2))", "values ('x')",
                "select s as v from t join (values (1)) x(n) using (n)", "with c as (values ('y')) select * from c"):
        preflight(definition(sql), ctx(tmp_path))


def test_a_decimal_parameter_of_38_digits_keeps_its_value() -> None:
    """Hole (dataflow/definitions/parameters.py): the canonical form of a decimal parameter with more than 28
    significant digits was rounded by Decimal.normalize()'s default context, e.g. 38 nines became 1E+38,
    which the Spark engine then refused as 39 digits and DuckDB bound as another number."""
    from durable_dataflow.dataflow.definitions import parameters

    for value in ("12345678901234567890123456789012345678", "9" * 38, "-0.1234567890123456789012345678901234567"):
        assert parameters.coerce("decimal", value) == value


@pytest.mark.parametrize("sql", [
    "select cast(unbase64('qA==') as string) as v",
    "select cast(x'C328' as string) as v from t",
    "select cast(array(cast(unhex('FF') as string)) as string) as v",
])
def test_a_string_that_is_not_utf8_fails_the_step(tmp_path: Path, sql: str) -> None:
    """Hole: Spark's CAST(binary AS STRING) keeps any bytes, so a step 'succeeded' with an Arrow string
    column that is not UTF-8; the stored result then broke every reader (`dataflow result`, the sinks:
    UnicodeDecodeError). DuckDB refuses such a cast. Now the step fails naming the column."""
    error = failure(definition(sql), tmp_path)
    assert isinstance(error, ExecutionError) and "column 'v'" in error.message and "UTF-8" in error.message, error


def _jvm_pid() -> int:
    return int(spark_engine.session().sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def test_a_memory_bomb_in_a_task_fails_and_the_shared_jvm_survives(canary_files: Path) -> None:
    """Hole: a task's OutOfMemoryError (repeat() of 2 GB over a Parquet source) made Spark exit the JVM
    that every execution of the process shares (local mode), failing them all; the next execution got a
    raw ConnectionRefusedError. Now the step ends limit_exceeded and the same JVM runs the next one."""
    before = _jvm_pid()
    sources = {"p": {"kind": "parquet", "path": "p.parquet"}}
    error = failure(definition("select cast(length(repeat(s, 100000000)) as string) as v from p", sources=sources),
                    canary_files)
    assert isinstance(error, LimitExceeded) and "memory" in error.message, error
    assert _jvm_pid() == before
    assert run(definition("select s as v from p", sources=sources), canary_files).row_count == 1


@pytest.mark.parametrize("sql", [
    "select cast(length(repeat(s, 2000000000)) as string) as v from t",  # ConvertToLocalRelation
    "select cast(length(repeat('0123456789', 200000000)) as string) as v",  # ConstantFolding
])
def test_a_memory_bomb_the_driver_evaluates_fails_at_once(tmp_path: Path, warm: None, sql: str) -> None:
    """Hole: Spark's optimizer evaluates expressions over inline rows and constants in the driver's
    'serve-Arrow' thread of toArrow(); its OutOfMemoryError killed that thread and left pyspark waiting on
    its socket forever (past the time limit; the execution never ended). Now the plan is made in the
    calling thread first, so the step ends limit_exceeded (memory) at once, long before its time limit."""
    started = time.monotonic()
    error = failure(definition(sql), tmp_path, time_limit_s=40)
    assert isinstance(error, LimitExceeded) and "memory" in error.message, error
    assert time.monotonic() - started < 25


def test_a_spark_call_that_does_not_return_ends_at_the_time_limit(
    tmp_path: Path, warm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hole: the time limit only cancels Spark *jobs*; work Spark does in the driver outside any job
    (optimizer rules over inline rows and constants, foldable arguments, a dead serve-Arrow thread) could
    not be stopped, and a collect returning late even let the execution succeed past its limit. Now each
    call is awaited only until the time is up: here a collect stalled for 60 s ends as limit_exceeded
    about a second after an 8 s limit."""
    entered, release = _stall_collects(monkeypatch)
    started = time.monotonic()
    try:
        error = failure(definition("select s as v from t"), tmp_path, time_limit_s=8)
    finally:
        release.set()
    assert entered.is_set(), "the collect was not reached within the time limit"
    assert isinstance(error, LimitExceeded) and "step 's0' exceeded the time limit of 8 s" in error.message, error
    assert time.monotonic() - started < 8 + spark_engine.CALL_GRACE_S + 4


def test_an_abandoned_call_cannot_start_a_job_that_outlives_its_execution(
    tmp_path: Path, warm: None, monkeypatch: pytest.MonkeyPatch, spark: Any
) -> None:
    """Proves the other half of abandoning a call: when Spark comes back from its driver-side work after the
    execution ended (here a stalled collect released then), the job it starts (a cross join of hours) is
    cancelled within seconds instead of running on with no watch to stop it."""
    entered, release = _stall_collects(monkeypatch)
    tracker = spark.sparkContext.statusTracker()
    sql = "select cast(count(*) as string) as v from range(200000) a cross join range(200000) b where a.id + b.id < 0"
    try:
        error = failure(definition(sql), tmp_path, time_limit_s=8)
        before = set(tracker.getJobIdsForGroup())
    finally:
        release.set()
    assert entered.is_set(), "the collect was not reached within the time limit"
    assert isinstance(error, LimitExceeded), error
    # Spark starts the collect's jobs one after another once it is released: each must be cancelled. A
    # job that was not would run for hours; poll (bounded) until the started jobs are all over.
    deadline = time.monotonic() + ABANDONED_JOBS_WAIT_S
    while True:
        started = sorted(set(tracker.getJobIdsForGroup()) - before)
        running = [job for job in started if str(getattr(tracker.getJobInfo(job), "status", "")) == "RUNNING"]
        if (started and not running) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    assert started and not running, f"the abandoned call's jobs {started} still run: {running}"


def test_regex_backtracking_in_the_driver_ends_at_the_time_limit(tmp_path: Path, warm: None) -> None:
    """Proves a backtracking regex (seconds to minutes of CPU) that Spark evaluates in the driver (inline
    rows: ConvertToLocalRelation, outside any job) ends as limit_exceeded about a second after its 1 s
    limit; before the fix the execution waited for the regex. Java's regex cannot be interrupted: the
    driver finishes it in the background (noted for docs/security.md)."""
    sources = {"t": {"kind": "inline", "schema": {"s": "string"}, "rows": [{"s": "a" * 24 + "x" * 30}]}}
    started = time.monotonic()
    error = failure(definition("select cast(s rlike '(.*a){25}' as string) as v from t", sources=sources), tmp_path,
                    time_limit_s=1)
    assert isinstance(error, LimitExceeded), error
    assert time.monotonic() - started < 1 + spark_engine.CALL_GRACE_S + 8


# ---- the CLI, the API and a worker --------------------------------------------------------------------


def _yaml(folder: Path, name: str, document: dict[str, Any]) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(document))
    return path


def _document(sql: str, schema: dict[str, str] | None = None, sources: dict[str, Any] | None = None,
              parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return definition(sql, schema, sources, parameters).model_dump(mode="json", exclude_none=True)


def _run_count(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM dataflow_runs")).scalar_one())
    finally:
        engine.dispose()


def test_cli_run_refuses_before_recording_and_binds_hostile_parameters(tmp_path: Path, sqlite_url: str) -> None:
    """Proves `dataflow run` refuses reflect() and a file-path relation with exit 2 before a run is recorded
    (no Spark started), and a string parameter crafted to break out of its literal comes back exactly."""
    cli = make_cli(sqlite_url, tmp_path)
    for number, sql in enumerate(("select reflect('java.lang.System', 'getProperty', 'user.home') as v",
                                  "select value as v from text.`/etc/hostname`")):
        refused = cli("run", str(_yaml(tmp_path, f"r{number}.yaml", _document(sql))), "--json")
        assert refused.code == 2 and "invalid_input" in refused.stderr, refused.output
    assert _run_count(sqlite_url) == 0
    value = "x'); select reflect('java.lang.System', 'getenv', 'HOME') -- ${env:HOME} \\"
    path = _yaml(tmp_path, "p.yaml", _document("select $who as v", parameters={"who": {"type": "string"}}))
    ran = cli("run", str(path), "--param", f"who={value}", "--json")
    assert ran.code == 0, ran.output
    shown = cli("result", ran.json()["run_id"], "--format", "json")
    assert shown.code == 0, shown.output
    assert json.loads(shown.stdout) == [{"v": value}]
    assert str(Path.home()) not in ran.output + shown.output


@contextlib.contextmanager
def _serve(tmp_path: Path, url: str) -> Iterator[tuple[str, str]]:
    """`dataflow serve` over url with tenant b's data folder; yields (base URL, b's submitter token)."""
    data, sinks = tmp_path / "data", tmp_path / "sinks"
    (data / "tenant_b").mkdir(parents=True)
    sinks.mkdir()
    pq.write_table(pa.table({"s": [f"{CANARY}-b"]}), data / "tenant_b" / "p.parquet")
    cli = make_cli(url, tmp_path)
    made = cli("tokens", "create", "--tenant", "tenant_b", "--role", "submitter", "--name", "b")
    assert made.code == 0, made.output
    server = start_server(["--db", url, "serve", "--port", "0", "--data-root", str(data), "--sink-root", str(sinks)],
                          cwd=tmp_path, env={**cli.env, "HOME": str(tmp_path / f"home-{CANARY}")},
                          log_path=tmp_path / "server.log")  # fmt: skip
    try:
        yield server.base_url, made.stdout.strip()
    finally:
        server.stop()


def test_api_refuses_before_recording_and_ends_the_utf8_attack_cleanly(tmp_path: Path, sqlite_url: str) -> None:
    """Proves a real `dataflow serve` answers a tenant's reflect(), text.`…`, ${env:HOME}, ADD JAR and
    global_temp steps with 422 invalid_input and no run recorded (no Spark started), and a step returning a
    string that is not UTF-8 becomes a failed run (execution_failed, naming the column) that every later
    read of the run answers without a 5xx and without the server's home or data folder."""
    refused_sql = ("select reflect('java.lang.System', 'getProperty', 'user.home') as v",
                   "select value as v from text.`/etc/hostname`", "select '${env:HOME}' as v", "ADD JAR /tmp/x.jar",
                   "select * from global_temp.x")
    with _serve(tmp_path, sqlite_url) as (base, token), httpx.Client(
        base_url=base, timeout=180, headers={"Authorization": f"Bearer {token}"}
    ) as client:
        for sql in refused_sql:
            answer = client.post("/v1/runs", json={"definition": _document(sql)})
            assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_input", answer.text
        assert _run_count(sqlite_url) == 0
        sources = {"p": {"kind": "parquet", "path": "p.parquet"}}
        answer = client.post("/v1/runs", json={"definition": _document(
            "select cast(unbase64('qA==') as string) as v from p", sources=sources)})
        assert answer.status_code == 201, answer.text
        found = answer.json()["run"]
        assert (found["status"], found["error_code"]) == ("failed", "execution_failed"), found
        assert "UTF-8" in found["error_message"] and "column 'v'" in found["error_message"], found
        seen = [answer.text]
        for path in (f"/v1/runs/{found['run_id']}", f"/v1/runs/{found['run_id']}/evidence", "/v1/runs"):
            again = client.get(path)
            assert again.status_code == 200, again.text
            seen.append(again.text)
        text = "\n".join(seen)
        assert not canaries_in(text, {"home": f"home-{CANARY}", "data": str(tmp_path / "data"), "canary": CANARY})


def test_worker_survives_a_memory_bomb_and_runs_the_next_run(tmp_path: Path, sqlite_url: str) -> None:
    """Proves `dataflow submit` refuses reflect() before recording, and one `dataflow worker --until-idle`
    process (one Spark JVM) ends a queued memory bomb as limit_exceeded and then runs the next queued run to
    success: the bomb no longer takes the worker's Spark down with it."""
    cli = make_cli(sqlite_url, tmp_path)
    pq.write_table(pa.table({"s": ["x"]}), tmp_path / "p.parquet")
    sources = {"p": {"kind": "parquet", "path": "p.parquet"}}
    refused = cli("submit", str(_yaml(tmp_path, "r.yaml", _document("select reflect('a', 'b') as v"))), "--json")
    assert refused.code == 2 and "invalid_input" in refused.stderr, refused.output
    assert _run_count(sqlite_url) == 0
    ids = []
    for name, sql in (("bomb", "select cast(length(repeat(s, 2000000000)) as string) as v from p"),
                      ("next", "select s as v from p")):
        submitted = cli("submit", str(_yaml(tmp_path, f"{name}.yaml", _document(sql, sources=sources))), "--json")
        assert submitted.code == 0, submitted.output
        ids.append(submitted.json()["run_id"])
    worked = cli("worker", "--until-idle", "--poll-interval", "0.05")
    assert worked.code == 0, worked.output
    shown = [cli("show", run_id, "--json").json() for run_id in ids]
    assert (shown[0]["status"], shown[0]["error_code"]) == ("failed", "limit_exceeded"), shown[0]
    assert shown[1]["status"] == "succeeded", shown[1]


# ---- last: the process's JVM is killed -----------------------------------------------------------------


def test_zz_a_lost_spark_jvm_is_replaced_by_the_next_execution(tmp_path: Path) -> None:
    """Hole: when the process's Spark JVM died (an executor's fatal error, the OOM killer, an operator),
    every later execution of that worker or server failed with a raw ConnectionRefusedError until the
    process restarted. Now the next execution notices the dead JVM and starts a new session. (Runs last:
    the rest of the module shares the session it replaces.)"""
    pid = _jvm_pid()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + JVM_GONE_WAIT_S
    while alive(pid) and time.monotonic() < deadline:  # bounded: until the JVM is gone (or a zombie)
        time.sleep(POLL_S)
    assert not alive(pid)
    assert run(definition("select s as v from t where n = 1"), tmp_path).table.to_pylist() == [{"v": "a"}]
