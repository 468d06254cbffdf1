"""Typed execution: exact results, fingerprints, schema validation, bounds and confined source paths."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import ExecutionError, InputError, LimitExceeded
from durable_dataflow.core.secrets import SecretScope
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.execution.arrowdigest import output_digest
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.sources import (
    ArrowTable,
    ResolvedSource,
    resolve_sources,
    source_fingerprint_digest,
)
from durable_dataflow.dataflow.execution.workspace import DATA_ROOTS_ENV
from support import flows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REVENUE_2026_11_02 = [
    {"region": "east", "revenue": decimal.Decimal("4914.24"), "orders": 14},
    {"region": "north", "revenue": decimal.Decimal("2042.91"), "orders": 9},
    {"region": "south", "revenue": decimal.Decimal("2332.90"), "orders": 12},
    {"region": "west", "revenue": decimal.Decimal("1802.87"), "orders": 6},
]


_definition = flows.one_step


def _inline(rows: list[dict[str, Any]], columns: dict[str, str]) -> dict[str, Any]:
    return {"t": {"kind": "inline", "rows": rows, "schema": columns}}


def _ctx(base: Path, *roots: Path) -> ExecutionContext:
    return ExecutionContext(base_dir=base, allowed_roots=roots or (base,), limits=ExecutionLimits())


def test_revenue_example_gives_exact_numbers_and_stable_digests() -> None:
    """Proves the revenue example yields the hand-checked figures for 2026-11-02 and repeatable digests."""
    loaded = definitions.load_definition(EXAMPLES / "revenue_by_region" / "dataflow.yaml")
    ctx = ExecutionContext.for_definition(loaded)
    first = execute(loaded.definition, {"day": "2026-11-02"}, ctx)
    assert first.table.to_pylist() == REVENUE_2026_11_02
    assert first.row_count == 4
    assert first.table.schema == loaded.definition.output.arrow_schema()
    assert first.output_digest == output_digest(results.decode_ipc(first.ipc_bytes))
    orders_bytes = (EXAMPLES / "revenue_by_region" / "data" / "orders.csv").read_bytes()
    assert first.sources[0] == ("orders", "csv", hashing.sha256_bytes(orders_bytes))
    assert first.source_fingerprint_digest == source_fingerprint_digest(first.sources)
    again = execute(loaded.definition, {"day": "2026-11-02"}, ctx)
    assert (again.output_digest, again.ipc_bytes) == (first.output_digest, first.ipc_bytes)
    other_day = execute(loaded.definition, {"day": "2026-11-03"}, ctx)
    assert other_day.output_digest != first.output_digest
    assert other_day.source_fingerprint_digest == first.source_fingerprint_digest


def test_given_sources_are_used_instead_of_resolving() -> None:
    """Proves execute() runs over the sources it is given (re-resolution is the caller's choice)."""
    loaded = definitions.load_definition(EXAMPLES / "revenue_by_region" / "dataflow.yaml")
    ctx = ExecutionContext.for_definition(loaded)
    resolved = resolve_sources(loaded.definition, ctx)
    no_orders = pacsv.read_csv(EXAMPLES / "revenue_by_region" / "data" / "orders.csv").slice(0, 0)
    fewer = [s if s.name != "orders" else ResolvedSource(s.name, s.kind, ArrowTable(no_orders), "sha256:empty")
             for s in resolved]
    empty = execute(loaded.definition, {"day": "2026-11-02"}, ctx, sources=fewer)
    assert empty.row_count == 0
    assert ("orders", "csv", "sha256:empty") in empty.sources


def test_result_columns_must_match_the_declared_names_and_order(tmp_path: Path) -> None:
    """Proves a result with other column order or names is an ExecutionError naming the declared columns
    (never the undeclared ones: a `select *` over a CSV would otherwise quote its header line)."""
    d = _definition(_inline([{"a": 1, "b": 2}], {"a": "int64", "b": "int64"}), "select b, a from t",
                    {"a": "int64", "b": "int64"})
    with pytest.raises(ExecutionError, match=r"in another order: output.schema declares \['a', 'b'\]"):
        execute(d, {}, _ctx(tmp_path))
    renamed = _definition(_inline([{"a": 1, "secret_header": 2}], {"a": "int64", "secret_header": "int64"}),
                          "select a, secret_header from t", {"a": "int64", "b": "int64"})
    with pytest.raises(ExecutionError, match=r"lacks the declared columns \['b'\] and has 1 undeclared") as caught:
        execute(renamed, {}, _ctx(tmp_path))
    assert "secret_header" not in caught.value.message


def test_result_type_that_cannot_be_cast_names_column_and_both_types(tmp_path: Path) -> None:
    """Proves a value that does not fit the declared type is refused, naming the column and both types."""
    d = _definition(_inline([{"a": 300}], {"a": "int64"}), "select a from t", {"a": "int8"})
    with pytest.raises(ExecutionError, match="column 'a' is int64 and cannot be cast to the declared int8"):
        execute(d, {}, _ctx(tmp_path))
    text = _definition(_inline([{"a": 1}], {"a": "int64"}), "select 'x' || a as a from t", {"a": "date"})
    with pytest.raises(ExecutionError, match="column 'a' is string and cannot be cast to the declared date32"):
        execute(text, {}, _ctx(tmp_path))


def test_float_to_decimal_is_refused_and_sql_casts_pass(tmp_path: Path) -> None:
    """Proves a float column declared decimal is refused (silent rounding) while a SQL cast is accepted."""
    rows = [{"x": 1.25}]
    d = _definition(_inline(rows, {"x": "float64"}), "select x from t", {"x": "decimal(12,1)"})
    with pytest.raises(ExecutionError, match="column 'x' is double but the schema declares decimal128"):
        execute(d, {}, _ctx(tmp_path))
    ok = _definition(_inline(rows, {"x": "float64"}), "select x::DECIMAL(12,2) as x from t", {"x": "decimal(12,2)"})
    assert execute(ok, {}, _ctx(tmp_path)).table.column("x").to_pylist() == [decimal.Decimal("1.25")]


def test_max_rows_and_max_bytes_are_enforced(tmp_path: Path) -> None:
    """Proves a result above max_rows or above max_bytes (as IPC) raises LimitExceeded naming the bound."""
    rows = [{"n": i} for i in range(5)]
    too_many = _definition(_inline(rows, {"n": "int64"}), "select n from t", {"n": "int64"}, max_rows=4)
    with pytest.raises(LimitExceeded, match=r"the result has more than output.max_rows = 4 rows"):
        execute(too_many, {}, _ctx(tmp_path))
    big = _definition(_inline(rows, {"n": "int64"}), "select repeat('x', 1000) as s from range(100)",
                      {"s": "string"}, max_bytes="10KiB")
    with pytest.raises(LimitExceeded, match=r"more than output.max_bytes = 10KiB"):
        execute(big, {}, _ctx(tmp_path))


def _csv_definition(path: str) -> Definition:
    return _definition({"t": {"kind": "csv", "path": path}}, "select count(*) as n from t", {"n": "int64"})


def test_source_paths_cannot_escape_the_allowed_roots(tmp_path: Path) -> None:
    """Proves '../', an absolute path and a symlink out of the root are refused, naming the source but
    not the path (a message never quotes a submitted value, docs/security.md)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.csv").write_text("n\n1\n")
    (root / "link.csv").symlink_to(outside / "secret.csv")
    (root / "linkdir").symlink_to(outside)
    for path in ("../outside/secret.csv", str(outside / "secret.csv"), "link.csv", "linkdir/secret.csv",
                 "/etc/passwd"):
        with pytest.raises(InputError, match="source 't': the path resolves outside the run's data roots") as refused:
            execute(_csv_definition(path), {}, _ctx(root))
        assert path not in refused.value.message and str(outside) not in refused.value.message
    with pytest.raises(InputError, match="source 't': the path does not exist") as missing:
        execute(_csv_definition("missing.csv"), {}, _ctx(root))
    assert "missing.csv" not in missing.value.message


def test_data_roots_env_admits_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves DATAFLOW_DATA_ROOTS extends the roots of ExecutionContext.for_definition."""
    flow_dir, shared = tmp_path / "flow", tmp_path / "shared"
    flow_dir.mkdir()
    shared.mkdir()
    (shared / "n.csv").write_text("n\n1\n2\n")
    (flow_dir / "dataflow.yaml").write_text(
        "name: f\nversion: 1\nsources: {t: {kind: csv, path: ../shared/n.csv}}\n"
        "steps: [{name: r, sql: 'select count(*) as n from t'}]\n"
        "output: {schema: {n: int64}, max_rows: 5, max_bytes: 1024}\n"
    )
    loaded = definitions.load_definition(flow_dir / "dataflow.yaml")
    with pytest.raises(InputError, match="outside the run's data roots"):
        execute(loaded.definition, {}, ExecutionContext.for_definition(loaded))
    monkeypatch.setenv(DATA_ROOTS_ENV, os.pathsep.join(["", str(shared)]))
    result = execute(loaded.definition, {}, ExecutionContext.for_definition(loaded))
    assert result.table.to_pylist() == [{"n": 2}]


def test_csv_schema_names_headerless_columns_and_must_match(tmp_path: Path) -> None:
    """Proves a headerless CSV takes its column names from the schema, and a declared column must exist."""
    (tmp_path / "plain.csv").write_text("1,2026-11-02\n2,2026-11-03\n")
    (tmp_path / "headed.csv").write_text("n,day\n1,2026-11-02\n")
    headerless = _definition({"t": {"kind": "csv", "path": "plain.csv", "header": False,
                                    "schema": {"n": "int64", "day": "date"}}},
                             "select max(day) as day from t", {"day": "date"})
    assert execute(headerless, {}, _ctx(tmp_path)).table.column("day").to_pylist() == [dt.date(2026, 11, 3)]
    wrong = _definition({"t": {"kind": "csv", "path": "headed.csv", "schema": {"amount": "decimal(10,2)"}}},
                        "select 1 as n", {"n": "int64"})
    with pytest.raises(ExecutionError, match="has no column 'amount' that its schema declares"):
        execute(wrong, {}, _ctx(tmp_path))


def test_source_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    """Proves a file above source_bytes_max is refused before it is parsed."""
    (tmp_path / "big.csv").write_text("n\n" + "1\n" * 1000)
    ctx = ExecutionContext(tmp_path, (tmp_path,), ExecutionLimits(source_bytes_max=100))
    with pytest.raises(LimitExceeded, match="larger than the source limit of 100 bytes"):
        execute(_csv_definition("big.csv"), {}, ctx)


def test_parquet_folder_fingerprint_covers_names_and_contents(tmp_path: Path) -> None:
    """Proves a parquet folder reads all files and its fingerprint changes when one file changes."""
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(pa.table({"n": [1, 2]}), folder / "a.parquet")
    pq.write_table(pa.table({"n": [3]}), folder / "b.parquet")
    d = _definition({"t": {"kind": "parquet", "path": "parts"}}, "select sum(n) as n from t", {"n": "int64"})
    first = execute(d, {}, _ctx(tmp_path))
    assert first.table.to_pylist() == [{"n": 6}]
    pq.write_table(pa.table({"n": [4]}), folder / "b.parquet")
    second = execute(d, {}, _ctx(tmp_path))
    assert second.table.to_pylist() == [{"n": 7}]
    assert second.sources[0][2] != first.sources[0][2]
    (folder / "c.parquet").symlink_to(tmp_path.parent / "elsewhere.parquet")
    shutil.copy(folder / "a.parquet", tmp_path.parent / "elsewhere.parquet")
    with pytest.raises(InputError, match="outside the run's data roots"):
        execute(d, {}, _ctx(tmp_path))


def test_delta_source_records_its_version(tmp_path: Path) -> None:
    """Proves a delta source reads the pinned version and its fingerprint names that version."""
    deltalake = pytest.importorskip("deltalake")
    deltalake.write_deltalake(str(tmp_path / "tbl"), pa.table({"n": [1, 2]}))
    deltalake.write_deltalake(str(tmp_path / "tbl"), pa.table({"n": [10]}), mode="append")
    pinned = _definition({"t": {"kind": "delta", "path": "tbl", "version": 0}}, "select sum(n) as n from t",
                         {"n": "int64"})
    latest = _definition({"t": {"kind": "delta", "path": "tbl"}}, "select sum(n) as n from t", {"n": "int64"})
    assert execute(pinned, {}, _ctx(tmp_path)).table.to_pylist() == [{"n": 3}]
    result = execute(latest, {}, _ctx(tmp_path))
    assert result.table.to_pylist() == [{"n": 13}]
    uri = (tmp_path / "tbl").resolve().as_uri()
    table_id = deltalake.DeltaTable(str(tmp_path / "tbl")).metadata().id
    assert result.sources[0][2] == hashing.digest({"uri": uri, "table_id": table_id, "version": 1})


def test_inline_source_types_dates_and_decimals(tmp_path: Path) -> None:
    """Proves inline rows become typed columns and parameters bind as typed values in SQL."""
    columns = {"day": "date", "amount": "decimal(10,2)"}
    rows = [{"day": "2026-11-02", "amount": "1.10"}, {"day": "2026-11-03", "amount": "2.20"},
            {"day": "2026-11-02", "amount": "3.30"}]
    d = Definition.model_validate({
        "name": "f", "version": 1, "parameters": {"day": {"type": "date"}, "floor": {"type": "decimal"}},
        "sources": _inline(rows, columns),
        "steps": [{"name": "r", "sql": "select sum(amount) as total from t where day = $day and amount > $floor"}],
        "output": {"schema": {"total": "decimal(12,2)"}, "max_rows": 1, "max_bytes": 4096},
    })
    result = execute(d, {"day": "2026-11-02", "floor": "1"}, _ctx(tmp_path))
    assert result.table.to_pylist() == [{"total": decimal.Decimal("4.40")}]
    # An inline source is fingerprinted by the Arrow digest of its typed table (schema and values).
    typed = pa.table({"day": [dt.date(2026, 11, 2), dt.date(2026, 11, 3), dt.date(2026, 11, 2)],
                      "amount": pa.array([decimal.Decimal(r["amount"]) for r in rows], pa.decimal128(10, 2))})
    assert result.sources[0][2] == output_digest(typed)


def test_postgres_source_errors_never_show_the_dsn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves an unset secret is refused naming the source, and a failed connection's error shows no DSN."""
    d = _definition({"crm": {"kind": "postgres", "dsn": {"secret": "CRM_DSN_TEST"}, "query": "select 1 as n"}},
                    "select n from crm", {"n": "int64"})
    monkeypatch.delenv("CRM_DSN_TEST", raising=False)
    monkeypatch.delenv("DATAFLOW_SECRETS_DIR", raising=False)
    with pytest.raises(InputError, match="source 'crm': a referenced secret is not set"):
        execute(d, {}, _ctx(tmp_path))
    dsn = "postgresql://crm_user:canary-pw-7f3a@127.0.0.1:1/crm_db?connect_timeout=2"
    monkeypatch.setenv("CRM_DSN_TEST", dsn)
    expected = "cannot connect to PostgreSQL with the DSN in secret 'CRM_DSN_TEST'"
    with pytest.raises(ExecutionError, match=expected) as caught:
        execute(d, {}, _ctx(tmp_path))
    assert "canary-pw-7f3a" not in caught.value.message and dsn not in caught.value.message
    assert "canary-pw-7f3a" not in repr(caught.value.__cause__) and caught.value.__suppress_context__


def test_a_postgres_source_resolves_its_dsn_in_the_runs_secret_scope(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the DSN is resolved in the execution's secret scope, not from the process environment: a
    tenant scope without a grant refuses a variable that is set (a worker's environment grants nothing)."""
    d = _definition({"crm": {"kind": "postgres", "dsn": {"secret": "CRM_DSN_SCOPED"}, "query": "select 1 as n"}},
                    "select n from crm", {"n": "int64"})
    monkeypatch.setenv("CRM_DSN_SCOPED", "postgresql://u:canary-scope-pw@127.0.0.1:1/db")
    tenant = dataclasses.replace(_ctx(tmp_path), secrets=SecretScope(tenant="acme"))
    with pytest.raises(InputError, match="source 'crm': a referenced secret is not granted") as refused:
        execute(d, {}, tenant)
    assert "canary-scope-pw" not in refused.value.message
