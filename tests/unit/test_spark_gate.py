"""The Spark SQL gate (execution/spark_gate.py): an allow-list over sqlglot's tree, and rendering with
platform-built literals. Pure sqlglot tests per rule (a case that passes and one that is refused), then
one local Spark session per module (marker ``spark``) that runs rendered SQL for real."""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.execution import spark_gate
from durable_dataflow.dataflow.execution.spark_gate import SparkStep, gate_step, render

RELATIONS = ("lineitem", "orders", "customer", "t", "u", "f")

Q1 = """select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty, sum(l_extendedprice) as sum_base_price,
  sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
  sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
  avg(l_quantity) as avg_qty, avg(l_discount) as avg_disc, count(*) as count_order
from lineitem
where l_shipdate <= date '1998-12-01' - interval '90' day
group by l_returnflag, l_linestatus
order by l_returnflag, l_linestatus"""
Q3 = """select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue, o_orderdate, o_shippriority
from customer, orders, lineitem
where c_mktsegment = $segment and c_custkey = o_custkey and l_orderkey = o_orderkey
  and o_orderdate < $day and l_shipdate > $day
group by l_orderkey, o_orderdate, o_shippriority
order by revenue desc, o_orderdate
limit 10"""
Q6 = """select sum(l_extendedprice * l_discount) as revenue
from lineitem
where l_shipdate >= date '1994-01-01' and l_shipdate < date '1994-01-01' + interval '1' year
  and l_discount between 0.06 - 0.01 and 0.06 + 0.01 and l_quantity < 24"""
Q_CTE = """with big as (
    select o.o_custkey, count(*) as n from orders o join lineitem l on l.l_orderkey = o.o_orderkey
    group by o.o_custkey),
  ranked as (
    select o_custkey, n, row_number() over (order by n desc, o_custkey) as rk,
      lag(n, 1) over (order by n) as prev
    from big)
select c.c_name, r.n, case when r.n > 2 then 'many' when r.n = 1 then 'one' else 'few' end as bucket,
  coalesce(r.prev, 0) as prev, cast(r.rk as string) as rk
from customer c left join ranked r on r.o_custkey = c.c_custkey
where c.c_custkey in (select o_custkey from orders where o_totalprice > $minprice)
  and exists (select 1 from orders o2 where o2.o_custkey = c.c_custkey)
  and c.c_name like 'C%' and c.c_acctbal is not null
order by c.c_name"""
TPCH_VALUES: dict[str, tuple[str, Any]] = {
    "segment": ("string", "BUILDING"),
    "day": ("date", "1995-03-15"),
    "minprice": ("decimal", "100"),
}

# Strings that would break out of a naively quoted literal, or that Spark would rewrite before parsing.
HOSTILE = (
    "it's \\ \"x\"\n--",
    "'; select reflect('java.lang.System', 'getProperty', 'user.home') --",
    "\\'; add jar /tmp/x.jar; --",
    "\\",
    "${env:HOME}",
    "${system:user.home}",
    "$",
    "`) from t; --",
    "*/ select 1 /*",
    "a\x00b",
    "€ 𝄞 ｒｅｆｌｅｃｔ",
    "\u2028\r\n\t",
    "",
)

# One sample per allow-listed function; kind says which query runs it on Spark (over the view f).
FUNCTION_SAMPLES: tuple[tuple[str, str], ...] = tuple(
    (kind, sample)
    for kind, samples in {
        "scalar": (
            "coalesce(s, 'z')", "nvl2(s, 1, 2)", "nullif(i, 0)", "greatest(i, 3)", "least(i, 3)",
            "isnan(x)", "nanvl(x, 0.0)", "abs(x)", "ceil(x)", "floor(x)", "round(x, 1)", "sqrt(x)",
            "cbrt(x)", "exp(x)", "ln(x)", "log(10, x)", "pow(x, 2)", "sign(x)", "sin(x)", "cos(x)",
            "tan(x)", "asin(0.5)", "acos(0.5)", "atan(x)", "atan2(x, 1)", "degrees(x)", "radians(x)",
            "pi()", "width_bucket(x, 0, 10, 5)", "try_add(i, 1)", "try_subtract(i, 1)",
            "try_multiply(i, 2)", "try_divide(i, 2)", "upper(s)", "lower(s)", "length(s)",
            "bit_length(s)", "trim(s)", "lpad(s, 10, '-')", "substring(s, 1, 3)", "left(s, 2)",
            "right(s, 2)", "concat(s, 'x')", "concat_ws('-', s, 'x')", "replace(s, 'A', 'a')",
            "translate(s, 'A', 'a')", "instr(s, 'b')", "split(s, ',')", "split_part(s, ',', 1)",
            "regexp_extract(s, '([a-z]+)', 1)", "regexp_extract_all(s, '([a-z]+)', 1)",
            "regexp_replace(s, '[a-z]', '_')", "initcap(s)", "reverse(s)", "repeat(s, 2)", "chr(65)",
            "startswith(s, 'A')", "endswith(s, 'f')", "contains(s, 'c')", "format_string('%d-%s', i, s)",
            "md5(s)", "sha1(s)", "sha2(s, 256)", "hex(i)", "unhex('41')", "levenshtein(s, 'abc')",
            "soundex(s)", "ascii(s)", "base64(s)", "unbase64('QUJD')", "date_add(d, 1)", "datediff(d, d)",
            "add_months(d, 1)", "months_between(ts, ts)", "date_trunc('MONTH', ts)", "trunc(d, 'MM')",
            "date_format(d, 'yyyy-MM')", "to_date('2026-11-02')", "to_timestamp('2026-11-02 08:30:00')",
            "to_timestamp('2026-11-02', 'yyyy-MM-dd')",
            "year(d)", "month(d)", "day(d)", "dayofmonth(d)", "dayofweek(d)", "dayofyear(d)",
            "weekofyear(d)", "quarter(d)", "hour(ts)", "minute(ts)", "second(ts)", "last_day(d)",
            "next_day(d, 'MO')", "make_timestamp(2026, 11, 2, 8, 30, 0)", "unix_timestamp(ts)",
            "from_unixtime(n)", "extract(year from d)", "timestampdiff(DAY, ts, ts)",
            "cast('2026-01-01' as timestamp)", "cast(make_interval(1) as string)", "array(1, 2)",
            "array_contains(arr, 1)",
            "array_distinct(arr)", "array_join(arr, ',')", "array_position(arr, 1)", "array_remove(arr, 1)",
            "array_sort(arr)", "array_intersect(arr, array(1))", "array_except(arr, array(1))",
            "arrays_zip(arr, arr)", "size(arr)", "array_max(arr)", "array_min(arr)", "flatten(array(arr, arr))",
            "sequence(1, 3)", "slice(arr, 1, 2)", "struct(i, s)", "map('a', 1)",
            "map_from_arrays(array('a'), array(1))", "map_keys(m)", "map_from_entries(array(struct('a', 1)))",
            "str_to_map('a:1,b:2')", "filter(arr, v -> v > 1)", "transform(arr, v -> v + 1)",
            "exists(arr, v -> v > 2)", "aggregate(arr, 0, (acc, v) -> acc + v)", "get_json_object(j, '$.a')",
            "from_json(j, 'a INT, b STRING')", "to_json(struct(i))", "typeof(i)", "pmod(i, 3)", "bround(x, 0)",
            "isnull(s)", "isnotnull(s)", "octet_length(s)", "btrim(s)", "format_number(x, 2)", "crc32(s)",
            "hash(s)", "xxhash64(s)", "make_date(2026, 1, 2)", "date_part('YEAR', d)", "timestamp_seconds(n)",
            "weekday(d)", "array_union(arr, arr)", "arrays_overlap(arr, arr)", "cardinality(arr)",
            "map_values(m)", "forall(arr, v -> v > 0)", "zip_with(arr, arr, (p, q) -> p + q)",
            "map_filter(m, (k, v) -> v > 0)", "transform_keys(m, (k, v) -> upper(k))",
            "transform_values(m, (k, v) -> v + 1)", "try_to_number('12', '99')", "positive(i)",
        ),
        "aggregate": (
            "sum(i)", "count(*)", "avg(x)", "min(i)", "max(i)", "stddev(x)", "stddev_pop(x)",
            "stddev_samp(x)", "variance(x)", "var_pop(x)", "count_if(i > 1)", "approx_count_distinct(i)",
            "percentile(x, 0.5)", "median(x)", "corr(x, x)", "covar_pop(x, x)", "covar_samp(x, x)",
            "bool_and(b)", "bool_or(b)", "max_by(i, x)", "min_by(i, x)", "skewness(x)", "kurtosis(x)",
            "array_sort(collect_list(i))", "array_sort(collect_set(i))", "try_sum(i)", "try_avg(i)",
            "every(b)", "some(b)",
        ),
        "window": (
            "row_number() over (order by i)", "rank() over (order by i)", "dense_rank() over (order by i)",
            "lag(i) over (order by i)", "lead(i) over (order by i)", "ntile(2) over (order by i)",
            "percent_rank() over (order by i)", "cume_dist() over (order by i)",
            "first_value(i) over (order by i)", "last_value(i) over (order by i)",
            "nth_value(i, 1) over (order by i)",
        ),
        "generator": (
            "explode(arr)", "posexplode(arr)", "posexplode_outer(arr)", "inline(array(struct(1, 'a')))",
            "inline_outer(array(struct(1, 'a')))", "stack(2, 1, 2)", "json_tuple(j, 'a', 'b')",
        ),
    }.items()
    for sample in samples
)  # fmt: skip


def _gate(sql: str, relations: tuple[str, ...] = RELATIONS) -> SparkStep:
    return gate_step("x", sql, relations)


def _refused(sql: str, *words: str, relations: tuple[str, ...] = RELATIONS) -> str:
    with pytest.raises(InputError) as info:
        _gate(sql, relations)
    message = info.value.message
    assert message.startswith("step 'x'"), message
    for word in words:
        assert word in message, message
    return message


def _sample_query(kind: str, samples: list[str]) -> str:
    """Scalars, aggregates or windows as the columns of one select over f; generators as lateral views."""
    if kind == "generator":
        views = " ".join(f"lateral view {sample} g{number}" for number, sample in enumerate(samples))
        return f"select * from f {views}"
    return "select " + ", ".join(f"{sample} as c{number}" for number, sample in enumerate(samples)) + " from f"


def _shape(tree: exp.Expr) -> list[tuple[str, str | None]]:
    # sqlglot reads Spark's CAST back as TryCast (non-ANSI CAST semantics); it prints both as CAST.
    return [("Cast" if type(n) is exp.TryCast else type(n).__name__, n.arg_key) for n in tree.walk()]


# ---- queries that pass ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "parameters"),
    [(Q1, set()), (Q3, {"segment", "day"}), (Q6, set()), (Q_CTE, {"minprice"})],
    ids=["q1", "q3", "q6", "cte"],
)
def test_tpch_shaped_queries_pass_and_name_their_parameters(sql: str, parameters: set[str]) -> None:
    """TPC-H Q1/Q3/Q6 shapes and a CTE query (joins, window, CASE, IN/EXISTS subqueries) pass the gate;
    the same query is refused when one of its relations is not declared."""
    assert _gate(sql).parameter_names == parameters
    _refused(sql, "reads 'lineitem'", "not a declared source", relations=("orders", "customer"))


def test_every_sampled_function_passes_and_the_samples_cover_the_allow_lists() -> None:
    """Every function sample passes the gate, and together they use every allow-listed typed class and
    every allow-listed name, so the Spark test below runs each of them once."""
    classes: set[type[exp.Expr]] = set()
    names: set[str] = set()
    for kind in ("scalar", "aggregate", "window", "generator"):
        step = _gate(_sample_query(kind, [s for k, s in FUNCTION_SAMPLES if k == kind]))
        classes |= {type(node) for node in step.tree.walk()}
        names |= {node.name.lower() for node in step.tree.find_all(exp.Anonymous)}
    assert classes >= spark_gate._FUNCTIONS, sorted(c.__name__ for c in spark_gate._FUNCTIONS - classes)
    assert names >= spark_gate._ANONYMOUS_FUNCTIONS, sorted(spark_gate._ANONYMOUS_FUNCTIONS - names)


# ---- functions ------------------------------------------------------------------------------------

REFLECT = "reflect('java.lang.System', 'getProperty', 'user.home')"


@pytest.mark.parametrize(
    ("sql", "name"),
    [
        (f"select {REFLECT}", "reflect"),
        ("select REFLECT('java.lang.System', 'getProperty', 'user.home')", "REFLECT"),
        ("select `reflect`('java.lang.System', 'getProperty', 'user.home')", "reflect"),
        ("select try_reflect('java.lang.System', 'getProperty', 'user.home')", "try_reflect"),
        ("select * from (select java_method('java.lang.System', 'getenv', 'HOME'))", "java_method"),
        (f"with c as (select {REFLECT} as v) select * from c", "reflect"),
        ("select * from t where a in (select java_method('java.lang.System', 'getenv', 'HOME'))", "java_method"),
        (f"select sum(a) over (partition by {REFLECT}) from t", "reflect"),
        (f"select row_number() over (order by {REFLECT}) from t", "reflect"),
        ("select transform(array(1), x -> reflect('java.lang.String', 'valueOf', x))", "reflect"),
        ("select ｒｅｆｌｅｃｔ('java.lang.System', 'getProperty', 'user.home')", "ｒｅｆｌｅｃｔ"),
        ("select identifier('a') from t", "identifier"),
        ("select assert_true(false)", "assert_true"),
        ("select url_decode(s) from t", "url_decode"),
    ],
)
def test_functions_outside_the_allow_list_are_refused_wherever_they_hide(sql: str, name: str) -> None:
    """reflect/java_method and other unlisted functions are refused in the select list, FROM subqueries,
    CTEs, WHERE subqueries, window specs and lambdas, in any case or quoting; listed ones pass."""
    _refused(sql, f"function {name} is not allowed on the Spark engine")
    _gate("select upper(s), pmod(a, 3), `pmod`(a, 3), transform(array(1), x -> x + 1) from t")


def test_qualified_function_names_are_refused() -> None:
    """db.function(...) could resolve to a persistent UDF: refused; struct field access (s.f) passes."""
    _refused("select default.upper(s) from t", "qualified function names")
    _gate("select t.s.f, struct(1 as a).a from t")


@pytest.mark.parametrize(
    ("sql", "name"),
    [
        ("select current_date()", "current_date"),
        ("select current_timestamp", "current_timestamp"),
        ("select now()", "now"),
        ("select rand()", "rand"),
        ("select random()", "rand"),
        ("select randn()", "randn"),
        ("select uuid()", "uuid"),
        ("select shuffle(array(1, 2))", "shuffle"),
        ("select input_file_name()", "input_file_name"),
        ("select monotonically_increasing_id()", "monotonically_increasing_id"),
        ("select spark_partition_id()", "spark_partition_id"),
        ("select unix_timestamp()", "current_timestamp"),
        ("select current_user()", "current_user"),
        ("select version()", "version"),
        ("select collect_list(a) from t", "collect_list"),
        ("select first(a) from t", "first"),
        ("select percentile_approx(a, 0.5) from t", "percentile_approx"),
    ],
)
def test_functions_that_are_not_deterministic_are_refused(sql: str, name: str) -> None:
    """Clock, session, random and row-order functions are refused with the reason (steps must be
    deterministic so digests reproduce); their deterministic neighbours pass."""
    _refused(sql, f"function {name} is not allowed", "deterministic")
    _gate("select array_sort(collect_list(a)), unix_timestamp(s), first_value(a) over (order by b) from t")


@pytest.mark.parametrize(
    "sql", ["select user from t", "select current_time from t", "select a from t where user = 'x'"]
)
def test_bare_session_words_must_be_qualified(sql: str) -> None:
    """Spark resolves a bare user/current_time/... to the session user or the clock when no column has
    that name: refused unqualified, allowed as t.user."""
    _refused(sql, "can mean a session or clock value", "qualify the column")
    _gate("select t.user, t.current_date, t.current_time from t")


# ---- relations ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "quoted"),
    [
        ("select * from text.`/etc/hostname`", "text./etc/hostname"),
        ("select * from `text`.`/etc/hostname`", "text./etc/hostname"),
        ("select * from `text./etc/hostname`", "text./etc/hostname"),
        ("select * from parquet.`file:///etc`", "parquet.file:///etc"),
        ("select * from `parquet`.`/tmp/x`", "parquet./tmp/x"),
        ("select * from json.`/etc/passwd`", "json./etc/passwd"),
        ("select * from csv.`/etc/passwd`", "csv./etc/passwd"),
        ("select * from binaryFile.`/`", "binaryFile./"),
        ("select * from orc.`/`", "orc./"),
        ("select * from delta.`/`", "delta./"),
        ("select * from default.t", "default.t"),
        ("select * from spark_catalog.default.t", "spark_catalog.default.t"),
        ("select * from secrets", "secrets"),
        ("select * from t join (select * from text.`/etc/hostname`) h on true", "text./etc/hostname"),
        ("select * from (with c as (select 1 as a) select * from c) x, c", "c"),
        ("with a as (select * from b), b as (select 1 as x) select * from a", "b"),
    ],
)
def test_relations_must_be_declared_names_or_ctes_in_scope(sql: str, quoted: str) -> None:
    """File-path relations (text./csv./parquet./json./orc./delta./binaryFile.), qualified names,
    undeclared names and CTEs used out of scope are refused, quoting only the name; declared names
    (case-insensitive, quoted or not) and CTEs in scope pass."""
    _refused(sql, f"reads {quoted!r}", "not a declared source or an earlier step")
    _gate("select * from LineItem join `orders` on true")
    _gate("with b as (select 1 as x), a as (select * from b) select * from a join t on true")


def test_a_backquoted_path_matches_only_a_declared_name_exactly() -> None:
    """A backquoted name with a dot is one name, not a file read: it passes only if declared as is."""
    _refused("select * from `text./etc/x`", "reads 'text./etc/x'")
    _gate("select * from `text./etc/x`", relations=("text./etc/x",))


@pytest.mark.parametrize(
    ("sql", "rule"),
    [
        ("select * from read_files('/etc')", "table function read_files"),
        ("select * from json_tuple('{}', 'a')", "table function json_tuple"),
        ("select * from IDENTIFIER('t')", "table function IDENTIFIER"),
        ("select * from explode(array(1))", "table function explode"),
        ("select id from range(3) tablesample (1 rows)", "TABLESAMPLE"),
    ],
)
def test_table_functions_other_than_range_are_refused(sql: str, rule: str) -> None:
    """Only range(...) may stand in FROM; read_files, IDENTIFIER(...) and the rest are refused."""
    _refused(sql, rule)
    _gate("select r.id from range(0, 10, 2) as r")


# ---- statements -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        ("ADD JAR /tmp/x.jar", "Command"),
        ("SET spark.sql.runSQLOnFiles=true", "Set"),
        ("CREATE TEMPORARY VIEW v AS SELECT 1", "Create"),
        ("CREATE TEMPORARY FUNCTION f AS 'com.example.F'", "Create"),
        ("CACHE TABLE t", "Cache"),
        ("UNCACHE TABLE t", "Uncache"),
        ("INSERT OVERWRITE DIRECTORY '/tmp/x' SELECT 1", "Insert"),
        ("EXECUTE IMMEDIATE 'select 1'", "Command"),
        ("DECLARE VARIABLE v INT DEFAULT 1", "Declare"),
        ("SET VAR v = 2", "Set"),
        ("LOAD DATA LOCAL INPATH '/etc/passwd' INTO TABLE t", "LoadData"),
        ("MSCK REPAIR TABLE t", "Command"),
        ("REFRESH TABLE t", "Refresh"),
        ("USE db", "Use"),
        ("DROP TABLE t", "Drop"),
    ],
)
def test_statements_other_than_queries_are_refused(sql: str, kind: str) -> None:
    """Commands, settings, DDL, DML, session variables and EXECUTE IMMEDIATE are refused by statement
    type; queries of every accepted form pass."""
    _refused(sql, "must be a query", f"of type {kind}")
    _gate("values (1, 2), (3, 4)")
    _gate("(select a from t) union all (select a from u)")
    _gate("select a from t intersect select a from u except select a from t")


@pytest.mark.parametrize(
    ("sql", "found"),
    [
        ("select 1; select 2", 2),
        ("select 1 -- ;\n; drop table t", 2),
        ("select 1 /* */; add jar x", 2),
        ("select 1;\nadd jar /tmp/x.jar", 2),
        ("", 0),
        ("-- nothing", 0),
    ],
)
def test_exactly_one_statement(sql: str, found: int) -> None:
    """A second statement is refused wherever comments try to hide it; a trailing ';' or a ';' inside a
    comment is one statement."""
    _refused(sql, f"must be exactly one query, found {found} statements")
    for one in ("select 1;", "select 1 -- ; drop table t", "select 1 /* ; add jar x */"):
        _gate(one)


@pytest.mark.parametrize(
    "sql",
    [
        "select transform('x') using 'cat /etc/hostname'",
        "select transform(a, b) row format delimited fields terminated by ',' using 'cat' as (x string) from t",
        "from t select transform(a) using 'cat'",
    ],
)
def test_script_transform_is_refused(sql: str) -> None:
    """TRANSFORM … USING runs a program (with or without ROW FORMAT); the transform() lambda passes."""
    _refused(sql, "script TRANSFORM")
    _gate("select transform(array(1, 2), x -> x * 2)")


@pytest.mark.parametrize(
    ("sql", "rule"),
    [
        ("select * from t pivot (sum(a) for b in (1, 2))", "PIVOT"),
        ("select a from t qualify row_number() over (order by a) = 1", "Qualify"),
        ("select a from t cluster by a", "Cluster"),
        ("select a from t distribute by a", "Distribute"),
        ("select a from t sort by a", "Sort"),
        ("with recursive r as (select 1 as n) select * from r", "WITH RECURSIVE"),
        ("select * from t tablesample (10 percent)", "TABLESAMPLE"),
        ("select cast(a as decimal(10, 2)) from t; ", None),
    ],
)
def test_other_syntax_outside_the_allow_list_is_refused(sql: str, rule: str | None) -> None:
    """PIVOT, QUALIFY, CLUSTER/DISTRIBUTE/SORT BY, WITH RECURSIVE and TABLESAMPLE are refused; grouping
    sets, named windows, lateral views, VALUES and typed casts pass."""
    if rule is None:
        _gate(sql)
    else:
        _refused(sql, rule, "not allowed")
    _gate(
        "select a, b, sum(c) over w, grouping(a) from t lateral view explode(arr) e as v "
        "lateral view outer posexplode(arr) p as i, w2 group by grouping sets ((a), (a, b)) "
        "window w as (partition by a order by b rows between unbounded preceding and current row) "
        "order by a nulls last limit 5 offset 1"
    )
    _gate(
        "select cast(a as struct<x: int>), cast(a as array<int>), cast(a as map<string, int>), "
        "a between 1 and 2, a in (1, 2), s like 'a%', s ilike 'a%', s rlike 'a+', a <=> b, "
        "d + interval '1' day, interval 2 hours, x'00' from t, (values (1, 'a')) as v(n, m)"
    )


# ---- parameters, hints, ${ -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "rule"),
    [
        ("select ${day}", "not ${name}"),
        ("select $1", "plain name"),
        ("select ?", "placeholders"),
        ("select :day", "placeholders"),
        ("select * from t where a = ? and b = :b", "placeholders"),
    ],
)
def test_only_dollar_name_parameters(sql: str, rule: str) -> None:
    """$name parameters are collected; ${name}, $1, ? and :name are refused."""
    _refused(sql, rule)
    assert _gate("select * from t where d = $day and n < $n and s = $day").parameter_names == {"day", "n"}


@pytest.mark.parametrize(
    "sql",
    [
        "select '${env:HOME}'",
        "select '\\u0024{system:user.home}'",
        "select 1 as `${spark.app.name}`",
        "select a from t where s = 'x${env:PATH}'",
    ],
)
def test_dollar_brace_never_reaches_spark(sql: str) -> None:
    """Spark substitutes ${env:…}, ${system:…} and settings into the SQL text, even inside literals
    (the Spark test shows it): any '${' in the printed tree is refused; '$' alone passes."""
    _refused(sql, "'${'", "configuration or environment")
    _gate("select '$5 {x}', '{$}' as `a$b`")


def test_hints_and_comments_are_dropped() -> None:
    """Hints (/*+ … */) and comments never reach Spark: the checked tree holds none and the rendered text
    names neither; the same query with a TABLESAMPLE instead of a hint is refused."""
    step = _gate("select /*+ BROADCAST(u), REPARTITION(100000) */ t.a /* secret */ from t join u on t.a = u.a -- x")
    assert not list(step.tree.find_all(exp.Hint))
    text = render(step, {})
    assert "BROADCAST" not in text and "REPARTITION" not in text and "secret" not in text and "/*" not in text
    _refused("select t.a from t tablesample (1 percent) join u on t.a = u.a", "TABLESAMPLE")


# ---- errors and limits ----------------------------------------------------------------------------


def test_a_doubled_quote_inside_a_string_is_refused() -> None:
    """Spark reads 'it''s' as it's but sqlglot as CONCAT('it', 's'): refused rather than silently changed;
    the backslash form and two separate literals pass."""
    _refused("select 'it''s'", "write a quote inside a string as \\'")
    assert render(_gate("select 'it\\'s', 'a' 'b'"), {}) == "SELECT 'it\\'s', CONCAT('a', 'b')"


@pytest.mark.parametrize(("sql", "detail"), [("select from where", "'where'"), ("select 'abc", "Error tokenizing")])
def test_a_parse_error_is_one_short_line(sql: str, detail: str) -> None:
    """A parse error names the step and gives the first line of sqlglot's message, short."""
    message = _refused(sql, "the SQL does not parse as Spark SQL", detail)
    assert "\n" not in message and "<Token" not in message and len(message) < 250
    _gate("select 1 as a")


def test_messages_quote_at_most_the_offending_identifier() -> None:
    """A refusal quotes the offending name, cut to about 80 characters, never the rest of the SQL."""
    message = _refused("select 'SECRET-VALUE', * from text.`/" + "a" * 500 + "`", "reads 'text./aaa")
    assert "…" in message and len(message) < 200 and "SECRET" not in message
    message = _refused("select 'SECRET-VALUE', reflect('a', 'b')", "function reflect")
    assert "SECRET" not in message


def test_limits_on_nesting_and_size() -> None:
    """Nesting deeper than the parser can go and trees over STEP_NODES_MAX nodes are refused with a
    message, not a crash; a query within both limits passes."""
    _refused("select " + "(" * 3000 + "1" + ")" * 3000, "nested too deeply")
    _refused("select " + "+".join(["a"] * 12_000) + " from t", f"more than {spark_gate.STEP_NODES_MAX} syntax nodes")
    _gate("select " + "(" * 30 + "1" + ")" * 30 + ", " + "+".join(["a"] * 500) + " from t")


# ---- rendering ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("type_name", "value", "literal"),
    [
        ("string", "ACME Corp. #1", "'ACME Corp. #1'"),
        ("string", "it's", "CAST(X'69742773' AS STRING)"),
        ("string", "", "''"),
        ("int", 42, "42"),
        ("int", -5, "(-5)"),
        ("float", 0.1, "CAST('0.1' AS DOUBLE)"),
        ("float", 2, "CAST('2.0' AS DOUBLE)"),
        ("float", 5e-324, "CAST('5e-324' AS DOUBLE)"),
        ("bool", False, "FALSE"),
        ("date", "2026-11-02", "CAST('2026-11-02' AS DATE)"),
        ("timestamp", "2026-11-02T08:30:00+00:00", "CAST('2026-11-02 08:30:00+00:00' AS TIMESTAMP_LTZ)"),
        ("timestamp", "2026-11-02T09:30:00+01:00", "CAST('2026-11-02 08:30:00+00:00' AS TIMESTAMP_LTZ)"),
        ("timestamp", "2026-11-02T08:30:00.25", "CAST('2026-11-02 08:30:00.250000' AS TIMESTAMP_NTZ)"),
        ("decimal", "12.3", "CAST('12.3' AS DECIMAL(3, 1))"),
        ("decimal", "0.05", "CAST('0.05' AS DECIMAL(2, 2))"),
        ("decimal", "-1000", "CAST('-1000' AS DECIMAL(4, 0))"),
        ("decimal", "0", "CAST('0' AS DECIMAL(1, 0))"),
    ],
)
def test_parameters_render_as_typed_literals(type_name: str, value: Any, literal: str) -> None:
    """Each declared type renders as an exact literal: plain strings quoted, others as UTF-8 hex; ints
    bare (negative in parentheses); floats by repr; aware timestamps in UTC as TIMESTAMP_LTZ, naive ones
    as TIMESTAMP_NTZ; decimals with their own precision and scale."""
    assert render(_gate("select $v as v"), {"v": (type_name, value)}) == f"SELECT {literal} AS `v`"


@pytest.mark.parametrize(
    ("type_name", "value", "reason"),
    [
        ("float", math.nan, "NaN and infinity"),
        ("float", math.inf, "NaN and infinity"),
        ("int", True, "not a canonical int"),
        ("int", "5", "not a canonical int"),
        ("bool", 1, "not a canonical bool"),
        ("date", "2026-13-01", "does not fit"),
        ("timestamp", "yesterday", "does not fit"),
        ("decimal", "NaN", "NaN and infinity"),
        ("decimal", "0." + "0" * 40 + "1", "more than 38 digits"),
        ("decimal", "twelve", "does not fit"),
        ("string", "\ud800", "not valid Unicode"),
        ("colour", "red", "not a canonical colour"),
    ],
)
def test_values_that_do_not_fit_are_refused(type_name: str, value: Any, reason: str) -> None:
    """A value that is not a canonical value of its type is refused naming the parameter, never the
    value; a missing value is refused too; the canonical form of the same type renders."""
    step = _gate("select $v as v")
    with pytest.raises(InputError) as info:
        render(step, {"v": (type_name, value)})
    assert info.value.message.startswith("step 'x': parameter 'v'") and reason in info.value.message
    with pytest.raises(InputError, match="parameter 'v' has no value"):
        render(step, {"w": ("int", 1)})
    render(step, {"v": ("float", 1.5)})


@pytest.mark.parametrize("sql", [Q1, Q3, Q6, Q_CTE], ids=["q1", "q3", "q6", "cte"])
def test_rendered_sql_parses_back_to_the_checked_shape(sql: str) -> None:
    """The rendered text parses back (sqlglot, Spark dialect) to the checked tree's shape with each
    parameter replaced by its literal, and passes the gate again."""
    step = _gate(sql)
    text = render(step, TPCH_VALUES)
    expected = step.tree.copy()
    for node in list(expected.find_all(exp.Parameter)):
        type_name, value = TPCH_VALUES[node.this.name]
        literal = render(_gate("select $v"), {"v": (type_name, value)}).removeprefix("SELECT ")
        node.replace(sqlglot.parse_one(literal, read="spark"))
    assert _shape(sqlglot.parse_one(text, read="spark")) == _shape(expected)
    assert not _gate(text).parameter_names


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_strings_cannot_break_out_of_their_literal(value: str) -> None:
    """A string parameter with quotes, backslashes, newlines, comment markers, ${…} or NUL renders as one
    literal: the text parses back to one SELECT of one literal holding exactly the value."""
    text = render(_gate("select $v as v"), {"v": ("string", value)})
    assert "${" not in text
    trees = sqlglot.parse(text, read="spark")
    assert len(trees) == 1 and isinstance(trees[0], exp.Select) and len(trees[0].expressions) == 1
    literal = trees[0].expressions[0].this
    kinds = {type(node) for node in literal.walk()}
    if isinstance(literal, exp.Literal):
        assert literal.is_string and literal.this == value
    else:
        assert kinds == {exp.TryCast, exp.HexString, exp.DataType}, kinds
        assert bytes.fromhex(literal.this.this).decode("utf-8") == value


def test_the_four_probes_are_refused_before_spark_sees_them() -> None:
    """reflect, a file-path relation, script TRANSFORM and ADD JAR are refused by the gate alone (no
    Spark); a harmless query of each shape passes."""
    probes = {
        "select reflect('java.lang.System', 'getProperty', 'user.home')": "function reflect",
        "select * from text.`/etc/hostname`": "reads 'text./etc/hostname'",
        "select transform('x') using 'cat /etc/hostname'": "script TRANSFORM",
        "ADD JAR /tmp/x.jar": "must be a query",
    }
    for sql, rule in probes.items():
        _refused(sql, rule)
    for sql in ("select upper('x')", "select * from t", "select transform(array(1), x -> x)", "select 1"):
        _gate(sql)


# ---- real Spark -----------------------------------------------------------------------------------


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
    own = spark.sql(render(_gate("select 'it\\'s \\\\ \"x\"\\n--\\t' as v, '\\u0041\\%' as w"), {})).collect()[0]
    assert (own.v, own.w) == ("it's \\ \"x\"\n--\t", "A\\%")
    substituted = spark.sql("select '${system:user.home}' as v").collect()[0].v
    assert substituted != "${system:user.home}"


@pytest.mark.spark
def test_spark_runs_the_rendered_tpch_queries(spark: Any) -> None:
    """The rendered TPC-H-shaped queries run on Spark over small temp views and return the results
    worked out by hand."""

    def run(sql: str) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in spark.sql(render(_gate(sql), TPCH_VALUES)).collect()]

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
        columns = spark.sql(render(_gate(_sample_query(kind, samples)), {})).columns
        assert len(columns) >= len(samples), kind


def test_a_refused_statement_is_never_quoted_to_a_log_or_stderr(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    canary = "canary-4f1d9e"
    caplog.set_level(logging.DEBUG)
    for sql in (f"ADD JAR /tmp/{canary}.jar", f"SET spark.x = {canary}", f"select 1; add jar {canary}"):
        with pytest.raises(InputError) as refused:
            spark_gate.gate_step("s", sql, ["t"])
        assert canary not in str(refused.value)
    captured = capsys.readouterr()
    assert canary not in captured.out + captured.err
    assert canary not in caplog.text
