"""The TPC-H queries of bench_tpch: Q1, Q3, Q5, Q6, Q10 and Q18 as Durable Dataflow definitions.

The SQL is the standard text (TPC-H 3.0.1, section 2.4) with the standard substitution parameters
(the "validation" values of each query's section 2.4.x.3). Each result is bounded and totally
ordered so that the platform's result and bare DuckDB's can be compared row for row: Q1 and Q5 get
a ``LIMIT``, and Q3, Q5, Q10 and Q18 get a unique key as the last ``ORDER BY`` term (the standard
ordering may tie). Q6 is one row.

Declared output types are exactly what DuckDB produces from tpchgen-cli's Parquet files (money
columns are ``decimal(15,2)``): ``sum`` of a decimal is ``decimal(38,s)``, a product of two
decimals adds their scales, ``avg`` is ``float64``, ``count(*)`` is ``int64``. bench_tpch checks
that bare DuckDB's result has exactly these types, so a cast in the platform can hide nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULT_ROWS_MAX = 1_000  # output.max_rows of every query (the largest result is Q18's 100 rows)
RESULT_BYTES_MAX = "16MiB"  # output.max_bytes of every query


@dataclass(frozen=True)
class Query:
    """One TPC-H query: the tables it reads, its SQL and its declared output schema (in order)."""

    name: str
    tables: tuple[str, ...]
    sql: str
    schema: tuple[tuple[str, str], ...]


Q1 = Query(
    "q1",
    ("lineitem",),
    """
select l_returnflag, l_linestatus,
       sum(l_quantity) as sum_qty,
       sum(l_extendedprice) as sum_base_price,
       sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
       sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
       avg(l_quantity) as avg_qty,
       avg(l_extendedprice) as avg_price,
       avg(l_discount) as avg_disc,
       count(*) as count_order
from lineitem
where l_shipdate <= date '1998-12-01' - interval '90' day
group by l_returnflag, l_linestatus
order by l_returnflag, l_linestatus
limit 100
""",
    (
        ("l_returnflag", "string"),
        ("l_linestatus", "string"),
        ("sum_qty", "decimal(38,2)"),
        ("sum_base_price", "decimal(38,2)"),
        ("sum_disc_price", "decimal(38,4)"),
        ("sum_charge", "decimal(38,6)"),
        ("avg_qty", "float64"),
        ("avg_price", "float64"),
        ("avg_disc", "float64"),
        ("count_order", "int64"),
    ),
)

Q3 = Query(
    "q3",
    ("customer", "orders", "lineitem"),
    """
select l_orderkey,
       sum(l_extendedprice * (1 - l_discount)) as revenue,
       o_orderdate, o_shippriority
from customer, orders, lineitem
where c_mktsegment = 'BUILDING'
  and c_custkey = o_custkey
  and l_orderkey = o_orderkey
  and o_orderdate < date '1995-03-15'
  and l_shipdate > date '1995-03-15'
group by l_orderkey, o_orderdate, o_shippriority
order by revenue desc, o_orderdate, l_orderkey
limit 10
""",
    (("l_orderkey", "int64"), ("revenue", "decimal(38,4)"), ("o_orderdate", "date"), ("o_shippriority", "int32")),
)

Q5 = Query(
    "q5",
    ("customer", "orders", "lineitem", "supplier", "nation", "region"),
    """
select n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
from customer, orders, lineitem, supplier, nation, region
where c_custkey = o_custkey
  and l_orderkey = o_orderkey
  and l_suppkey = s_suppkey
  and c_nationkey = s_nationkey
  and s_nationkey = n_nationkey
  and n_regionkey = r_regionkey
  and r_name = 'ASIA'
  and o_orderdate >= date '1994-01-01'
  and o_orderdate < date '1994-01-01' + interval '1' year
group by n_name
order by revenue desc, n_name
limit 100
""",
    (("n_name", "string"), ("revenue", "decimal(38,4)")),
)

Q6 = Query(
    "q6",
    ("lineitem",),
    """
select sum(l_extendedprice * l_discount) as revenue
from lineitem
where l_shipdate >= date '1994-01-01'
  and l_shipdate < date '1994-01-01' + interval '1' year
  and l_discount between 0.06 - 0.01 and 0.06 + 0.01
  and l_quantity < 24
""",
    (("revenue", "decimal(38,4)"),),
)

Q10 = Query(
    "q10",
    ("customer", "orders", "lineitem", "nation"),
    """
select c_custkey, c_name,
       sum(l_extendedprice * (1 - l_discount)) as revenue,
       c_acctbal, n_name, c_address, c_phone, c_comment
from customer, orders, lineitem, nation
where c_custkey = o_custkey
  and l_orderkey = o_orderkey
  and o_orderdate >= date '1993-10-01'
  and o_orderdate < date '1993-10-01' + interval '3' month
  and l_returnflag = 'R'
  and c_nationkey = n_nationkey
group by c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
order by revenue desc, c_custkey
limit 20
""",
    (
        ("c_custkey", "int64"),
        ("c_name", "string"),
        ("revenue", "decimal(38,4)"),
        ("c_acctbal", "decimal(15,2)"),
        ("n_name", "string"),
        ("c_address", "string"),
        ("c_phone", "string"),
        ("c_comment", "string"),
    ),
)

Q18 = Query(
    "q18",
    ("customer", "orders", "lineitem"),
    """
select c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice, sum(l_quantity) as sum_qty
from customer, orders, lineitem
where o_orderkey in (select l_orderkey from lineitem group by l_orderkey having sum(l_quantity) > 300)
  and c_custkey = o_custkey
  and o_orderkey = l_orderkey
group by c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice
order by o_totalprice desc, o_orderdate, o_orderkey
limit 100
""",
    (
        ("c_name", "string"),
        ("c_custkey", "int64"),
        ("o_orderkey", "int64"),
        ("o_orderdate", "date"),
        ("o_totalprice", "decimal(15,2)"),
        ("sum_qty", "decimal(38,2)"),
    ),
)

QUERIES = (Q1, Q3, Q5, Q6, Q10, Q18)
FORWARD_QUERY = Q1  # the one query also run in forward mode, publishing to a Delta table


def definition(query: Query, data_dir: Path, target: dict[str, Any] | None = None) -> dict[str, Any]:
    """The query as a definition document: one Parquet source per table it reads (absolute paths
    inside ``data_dir``, which the run must have as an allowed root), one step, the declared output."""
    document: dict[str, Any] = {
        "name": f"tpch_{query.name}",
        "version": 1,
        "description": f"TPC-H {query.name.upper()} (bench_tpch)",
        "sources": {table: {"kind": "parquet", "path": str(data_dir / f"{table}.parquet")} for table in query.tables},
        "steps": [{"name": query.name, "sql": query.sql.strip()}],
        "output": {
            "schema": [list(column) for column in query.schema],
            "max_rows": RESULT_ROWS_MAX,
            "max_bytes": RESULT_BYTES_MAX,
        },
    }
    if target is not None:
        document["target"] = target
    return document


def delta_target(location: str) -> dict[str, Any]:
    """A forward-recovery target: append to a Delta table at ``location`` (relative to base_dir)."""
    return {
        "type": "datasources.publication",
        "provider": "delta",
        "datasource": "bench.q1",
        "location": location,
        "mode": "append",
    }
