"""The Spark SQL gate (execution/spark_gate.py): an allow-list over sqlglot's tree, and rendering with
platform-built literals. Pure sqlglot tests per rule (a case that passes and one that is refused); the
rendered SQL run on a local Spark session is tests/integration/test_spark_gate_session.py."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.execution import spark_gate
from durable_dataflow.dataflow.execution.spark_gate import render
from support.spark_gate_cases import (
    FUNCTION_SAMPLES,
    HOSTILE,
    Q1,
    Q3,
    Q6,
    Q_CTE,
    RELATIONS,
    TPCH_VALUES,
    gate,
    sample_query,
)


def _refused(sql: str, *words: str, relations: tuple[str, ...] = RELATIONS) -> str:
    with pytest.raises(InputError) as info:
        gate(sql, relations)
    message = info.value.message
    assert message.startswith("step 'x'"), message
    for word in words:
        assert word in message, message
    return message


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
    assert gate(sql).parameter_names == parameters
    _refused(sql, "reads 'lineitem'", "not a declared source", relations=("orders", "customer"))


def test_every_sampled_function_passes_and_the_samples_cover_the_allow_lists() -> None:
    """Every function sample passes the gate, and together they use every allow-listed typed class and
    every allow-listed name, so the Spark test below runs each of them once."""
    classes: set[type[exp.Expr]] = set()
    names: set[str] = set()
    for kind in ("scalar", "aggregate", "window", "generator"):
        step = gate(sample_query(kind, [s for k, s in FUNCTION_SAMPLES if k == kind]))
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
    gate("select upper(s), pmod(a, 3), `pmod`(a, 3), transform(array(1), x -> x + 1) from t")


def test_qualified_function_names_are_refused() -> None:
    """db.function(...) could resolve to a persistent UDF: refused; struct field access (s.f) passes."""
    _refused("select default.upper(s) from t", "qualified function names")
    gate("select t.s.f, struct(1 as a).a from t")


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
        ("select max_by(a, b) from t", "max_by"),
        ("select min_by(a, b) from t", "min_by"),
        ("select arg_max(a, b) from t", "max_by"),
    ],
)
def test_functions_that_are_not_deterministic_are_refused(sql: str, name: str) -> None:
    """Clock, session, random and row-order functions are refused with the reason (steps must be
    deterministic so digests reproduce); their deterministic neighbours pass."""
    _refused(sql, f"function {name} is not allowed", "deterministic")
    gate("select array_sort(collect_list(a)), unix_timestamp(s), first_value(a) over (order by b) from t")
    gate("select max(struct(b, a)).a from t")  # max_by's deterministic form: ties broken by a


@pytest.mark.parametrize(
    "sql", ["select user from t", "select current_time from t", "select a from t where user = 'x'"]
)
def test_bare_session_words_must_be_qualified(sql: str) -> None:
    """Spark resolves a bare user/current_time/... to the session user or the clock when no column has
    that name: refused unqualified, allowed as t.user."""
    _refused(sql, "can mean a session or clock value", "qualify the column")
    gate("select t.user, t.current_date, t.current_time from t")


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
    gate("select * from LineItem join `orders` on true")
    gate("with b as (select 1 as x), a as (select * from b) select * from a join t on true")


def test_a_backquoted_path_matches_only_a_declared_name_exactly() -> None:
    """A backquoted name with a dot is one name, not a file read: it passes only if declared as is."""
    _refused("select * from `text./etc/x`", "reads 'text./etc/x'")
    gate("select * from `text./etc/x`", relations=("text./etc/x",))


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
    gate("select r.id from range(0, 10, 2) as r")


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
    gate("values (1, 2), (3, 4)")
    gate("(select a from t) union all (select a from u)")
    gate("select a from t intersect select a from u except select a from t")


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
        gate(one)


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
    gate("select transform(array(1, 2), x -> x * 2)")


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
        gate(sql)
    else:
        _refused(sql, rule, "not allowed")
    gate(
        "select a, b, sum(c) over w, grouping(a) from t lateral view explode(arr) e as v "
        "lateral view outer posexplode(arr) p as i, w2 group by grouping sets ((a), (a, b)) "
        "window w as (partition by a order by b rows between unbounded preceding and current row) "
        "order by a nulls last limit 5 offset 1"
    )
    gate(
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
    assert gate("select * from t where d = $day and n < $n and s = $day").parameter_names == {"day", "n"}


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
    gate("select '$5 {x}', '{$}' as `a$b`")


def test_hints_and_comments_are_dropped() -> None:
    """Hints (/*+ … */) and comments never reach Spark: the checked tree holds none and the rendered text
    names neither; the same query with a TABLESAMPLE instead of a hint is refused."""
    step = gate("select /*+ BROADCAST(u), REPARTITION(100000) */ t.a /* secret */ from t join u on t.a = u.a -- x")
    assert not list(step.tree.find_all(exp.Hint))
    text = render(step, {})
    assert "BROADCAST" not in text and "REPARTITION" not in text and "secret" not in text and "/*" not in text
    _refused("select t.a from t tablesample (1 percent) join u on t.a = u.a", "TABLESAMPLE")


# ---- errors and limits ----------------------------------------------------------------------------


def test_a_doubled_quote_inside_a_string_is_refused() -> None:
    """Spark reads 'it''s' as it's but sqlglot as CONCAT('it', 's'): refused rather than silently changed;
    the backslash form and two separate literals pass."""
    _refused("select 'it''s'", "write a quote inside a string as \\'")
    assert render(gate("select 'it\\'s', 'a' 'b'"), {}) == "SELECT 'it\\'s', CONCAT('a', 'b')"


@pytest.mark.parametrize(("sql", "detail"), [("select from where", "'where'"), ("select 'abc", "Error tokenizing")])
def test_a_parse_error_is_one_short_line(sql: str, detail: str) -> None:
    """A parse error names the step and gives the first line of sqlglot's message, short."""
    message = _refused(sql, "the SQL does not parse as Spark SQL", detail)
    assert "\n" not in message and "<Token" not in message and len(message) < 250
    gate("select 1 as a")


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
    gate("select " + "(" * 30 + "1" + ")" * 30 + ", " + "+".join(["a"] * 500) + " from t")


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
    assert render(gate("select $v as v"), {"v": (type_name, value)}) == f"SELECT {literal} AS `v`"


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
    step = gate("select $v as v")
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
    step = gate(sql)
    text = render(step, TPCH_VALUES)
    expected = step.tree.copy()
    for node in list(expected.find_all(exp.Parameter)):
        type_name, value = TPCH_VALUES[node.this.name]
        literal = render(gate("select $v"), {"v": (type_name, value)}).removeprefix("SELECT ")
        node.replace(sqlglot.parse_one(literal, read="spark"))
    assert _shape(sqlglot.parse_one(text, read="spark")) == _shape(expected)
    assert not gate(text).parameter_names


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_strings_cannot_break_out_of_their_literal(value: str) -> None:
    """A string parameter with quotes, backslashes, newlines, comment markers, ${…} or NUL renders as one
    literal: the text parses back to one SELECT of one literal holding exactly the value."""
    text = render(gate("select $v as v"), {"v": ("string", value)})
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
        gate(sql)


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


@pytest.mark.parametrize(
    "sql",
    [
        "select array_sort(collect_list(a), (l, r) -> 0) from t",
        "select array_sort(collect_set(a), (l, r) -> case when l < r then -1 when l > r then 1 else 0 end) from t",
        "select array_sort(array(1), collect_list(a)) from t",
    ],
)
def test_order_dependent_aggregates_need_the_one_argument_array_sort(sql: str) -> None:
    """collect_list/collect_set pass only as the one argument of array_sort or sort_array: a comparator
    (here one that calls every pair equal) keeps the row order, so the step and the rule are named in
    the refusal; the one-argument forms, and a comparator over a deterministic array, pass."""
    message = _refused(sql, "collect_", "only as the one argument of array_sort", "without a comparator")
    assert "deterministic" in message
    gate("select array_sort(collect_list(a)), sort_array(collect_set(a), false), sort_array(collect_list(a)) from t")
    gate("select array_sort(array(3, 1, 2), (l, r) -> r - l) from t")


@pytest.mark.parametrize(
    ("sql", "aliases"),
    [
        ("select `x--`.`y--` from t lateral view explode(array(1)) `x--` as `y--`", ["`x--`", "`y--`"]),
        ("select `c--` from t lateral view outer posexplode(array(1)) `p q` as `i/*`, `c--`", ["`p q`", "`i/*`"]),
        ("select e.v from t lateral view explode(array(1)) e as v", ["`e` AS `v`"]),
        ("select * from t as `a--`, (select 1 as `b--`) as `s--`(`c--`)", ["`a--`", "`b--`", "`s--`", "`c--`"]),
    ],
)
def test_every_alias_is_rendered_quoted(sql: str, aliases: list[str]) -> None:
    """Table and column aliases, LATERAL VIEW's included, are printed quoted, so `x--` cannot become x
    plus a comment: the rendered text holds each quoted alias and sqlglot reads every identifier back."""
    text = render(gate(sql), {})
    for alias in aliases:
        assert alias in text, text
    names = sorted(node.name for node in sqlglot.parse_one(text, read="spark").find_all(exp.Identifier))
    assert names == sorted(node.name for node in sqlglot.parse_one(sql, read="spark").find_all(exp.Identifier))


def test_a_rendering_that_loses_a_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second line behind the quoting: with sqlglot's own Spark printer (which prints LATERAL VIEW's
    table alias bare), the gate sees that the printed text reads back without `x--` and refuses it."""
    monkeypatch.setattr(spark_gate, "_DIALECT", sqlglot.Dialect.get_or_raise("spark"))
    _refused("select 1 from t lateral view explode(array(1)) `x--` as `y--`", "does not print as Spark SQL")


@pytest.mark.parametrize("window", [
    "row_number() over (partition by a order by b)",
    "ntile(3) over (order by b)",
    "lag(a) over (order by b)",
    "lead(a, 2) over (order by b)",
    "first_value(a) over (order by b)",
    "last_value(a) over (order by b)",
    "nth_value(a, 2) over (order by b)",
    "sum(a) over (order by b rows between 1 preceding and current row)",
])
def test_row_picking_windows_pass_because_the_gate_cannot_see_ties(window: str) -> None:
    """Pins the boundary docs/engines.md states: a window that numbers or picks rows passes the gate,
    which cannot know whether its ORDER BY has ties (then the result depends on row order, and the guide
    says to order by a unique key); the step is still checked and printed from its tree."""
    printed = render(gate(f"select {window} as n from t", RELATIONS), {}).lower()
    assert " over (" in printed and "order by `b`" in printed, printed  # the window reaches Spark whole
