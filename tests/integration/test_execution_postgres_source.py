"""A postgres source runs its query read-only on real PostgreSQL, typed, fingerprinted by its result."""

from __future__ import annotations

import datetime as dt
import decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from durable_dataflow.core.errors import ExecutionError
from durable_dataflow.dataflow.arrowdigest import output_digest
from durable_dataflow.dataflow.definitions import Definition
from durable_dataflow.dataflow.execution import ExecutionContext, ExecutionLimits, execute, resolve_sources

SECRET = "CRM_DSN_PG_SOURCE_TEST"


def _libpq_dsn(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


def _definition(query: str) -> Definition:
    return Definition.model_validate({
        "name": "crm", "version": 1,
        "sources": {"customers": {"kind": "postgres", "dsn": {"secret": SECRET}, "query": query}},
        "steps": [{"name": "r", "sql": "select region, sum(credit) as credit, count(*) as n, min(since) as since "
                                        "from customers group by region order by region"}],
        "output": {"schema": {"region": "string", "credit": "decimal(18,2)", "n": "int64", "since": "date"},
                   "max_rows": 10, "max_bytes": "1MiB"},
    })


def test_postgres_source_is_typed_read_only_and_fingerprinted(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves typed rows arrive, the fingerprint is the result's digest, and a writing query is refused."""
    dsn = _libpq_dsn(pg_url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table customers (id bigint primary key, region text, credit numeric(12,2), "
                     "since date, seen timestamptz)")
        conn.execute("insert into customers values (1, 'north', 10.50, '2026-01-02', now()), "
                     "(2, 'north', 1.25, '2025-05-06', null), (3, 'south', null, '2026-03-04', now())")
    monkeypatch.setenv(SECRET, dsn)
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    d = _definition("select id, region, credit, since, seen from customers order by id")
    [source] = resolve_sources(d, ctx)
    assert source.table.schema.field("credit").type == pa.decimal128(12, 2)
    assert source.table.schema.field("seen").type == pa.timestamp("us", tz="UTC")
    assert source.fingerprint == output_digest(source.table)
    result = execute(d, {}, ctx)
    assert result.table.to_pylist() == [
        {"region": "north", "credit": decimal.Decimal("11.75"), "n": 2, "since": dt.date(2025, 5, 6)},
        {"region": "south", "credit": None, "n": 1, "since": dt.date(2026, 3, 4)},
    ]
    writing = _definition("with gone as (delete from customers returning *) select * from gone")
    with pytest.raises(ExecutionError, match="read-only transaction") as caught:
        execute(writing, {}, ctx)
    assert dsn not in caught.value.message
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select count(*) from customers").fetchone() == (3,)
