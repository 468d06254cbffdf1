"""The Spark SQL gate's test cases: TPC-H-shaped queries, hostile strings and one sample per allow-listed
function, shared by the pure gate tests (tests/unit/test_spark_gate.py) and the ones that run the rendered
SQL on a local Spark session (tests/integration/test_spark_gate_session.py)."""

from __future__ import annotations

from typing import Any

from durable_dataflow.dataflow.execution.spark_gate import SparkStep, gate_step

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
            "bool_and(b)", "bool_or(b)", "max(struct(x, i)).i", "skewness(x)", "kurtosis(x)",
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


def gate(sql: str, relations: tuple[str, ...] = RELATIONS) -> SparkStep:
    """The step ``x`` of ``sql`` as the gate passes it, over the relations the cases declare."""
    return gate_step("x", sql, relations)


def sample_query(kind: str, samples: list[str]) -> str:
    """Scalars, aggregates or windows as the columns of one select over f; generators as lateral views."""
    if kind == "generator":
        views = " ".join(f"lateral view {sample} g{number}" for number, sample in enumerate(samples))
        return f"select * from f {views}"
    return "select " + ", ".join(f"{sample} as c{number}" for number, sample in enumerate(samples)) + " from f"
