"""A postgres source runs its query read-only on real PostgreSQL, typed, fingerprinted by its result."""

from __future__ import annotations

import datetime as dt
import decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from durable_dataflow.core.errors import ExecutionError, LimitExceeded
from durable_dataflow.dataflow.arrowdigest import output_digest
from durable_dataflow.dataflow.definitions import Definition
from durable_dataflow.dataflow.execution import ExecutionContext, ExecutionLimits, execute, resolve_sources
from durable_dataflow.dataflow.postgres_source import POSTGRES_FETCH_BATCH_ROWS, PostgresStream

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
    assert isinstance(source.binding, PostgresStream)
    schema, batches = source.binding.batches()
    table = pa.Table.from_batches(list(batches), schema)
    assert table.schema.field("credit").type == pa.decimal128(12, 2)
    assert table.schema.field("seen").type == pa.timestamp("us", tz="UTC")
    assert source.fingerprint == output_digest(table)
    result = execute(d, {}, ctx)
    assert result.sources[0][2] == output_digest(table)
    assert result.table.to_pylist() == [
        {"region": "north", "credit": decimal.Decimal("11.75"), "n": 2, "since": dt.date(2025, 5, 6)},
        {"region": "south", "credit": None, "n": 1, "since": dt.date(2026, 3, 4)},
    ]
    writing = _definition("with gone as (delete from customers returning *) select * from gone")
    # A server-side cursor wraps the query: a data-modifying WITH is refused before it runs.
    with pytest.raises(ExecutionError, match="must not contain data-modifying statements") as caught:
        execute(writing, {}, ctx)
    assert dsn not in caught.value.message
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select count(*) from customers").fetchone() == (3,)


def test_postgres_source_streams_in_batches_and_is_bounded_by_the_source_limit(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a query result larger than one fetch batch streams whole (its fingerprint equals the digest of
    all rows), a numeric without declared precision keeps the first batch's type, and the source byte
    limit stops the stream with limit_exceeded."""
    dsn = _libpq_dsn(pg_url)
    rows = 3 * POSTGRES_FETCH_BATCH_ROWS + 7
    monkeypatch.setenv(SECRET, dsn)
    query = f"select g as id, (g % 5)::text as region, g::numeric / 4 as q from generate_series(1, {rows}) g"
    d = Definition.model_validate({
        "name": "crm", "version": 1,
        "sources": {"customers": {"kind": "postgres", "dsn": {"secret": SECRET}, "query": query}},
        "steps": [{"name": "r", "sql": "select count(*) as n, sum(id) as s from customers"}],
        "output": {"schema": {"n": "int64", "s": "decimal(38,0)"}, "max_rows": 1, "max_bytes": "1MiB"},
    })
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits())
    result = execute(d, {}, ctx)
    assert result.table.to_pylist() == [{"n": rows, "s": decimal.Decimal(rows * (rows + 1) // 2)}]
    [again] = resolve_sources(d, ctx)
    assert isinstance(again.binding, PostgresStream)
    schema, batches = again.binding.batches()
    assert result.sources[0][2] == output_digest(pa.Table.from_batches(list(batches), schema))
    small = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(source_bytes_max=100_000))
    with pytest.raises(LimitExceeded, match="streamed more than the source limit of 100000 bytes"):
        execute(d, {}, small)
