"""A step cannot read the server's configuration (issue 29, finding 6): the gate refuses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import duckdb_engine
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits


def _definition(sql: str, csv: bool) -> Definition:
    source: dict[str, Any] = (
        {"kind": "csv", "path": "t.csv"} if csv
        else {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}
    )  # fmt: skip
    return Definition.model_validate({
        "name": "peek", "version": 1, "sources": {"t": source},
        "steps": [{"name": "s0", "sql": sql}],
        "output": {"schema": {"s": "string"}, "max_rows": 1000, "max_bytes": "1MiB"},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        ("select string_agg(name || '=' || value, ';') as s from duckdb_settings()", "function duckdb_settings()"),
        ("select current_setting('temp_directory') as s", "function current_setting()"),
        ("select s from t, (select current_setting('allowed_paths')::varchar as s)", "function current_setting()"),
        ("select count(*)::varchar as s from duckdb_secrets()", "function duckdb_secrets()"),
        ("select path as s from duckdb_temporary_files()", "function duckdb_temporary_files()"),
        ("select extension_name as s from duckdb_extensions()", "function duckdb_extensions()"),
        ("select value as s from pg_settings where name = 'temp_directory'", "catalog view pg_settings"),
        ("select value as s from pg_catalog.pg_settings", "catalog view pg_settings"),
        ("select path as s from duckdb_databases", "catalog view duckdb_databases"),
        ("select name as s from which_secret('s3://x', 's3')", "function which_secret()"),
        ("select name as s from pragma_database_list", "catalog view pragma_database_list"),
    ],
)
@pytest.mark.parametrize("csv", [False, True])
def test_a_step_naming_the_servers_configuration_is_refused_before_any_source_is_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sql: str, named: str, csv: bool
) -> None:
    """Proves a step calling duckdb_settings(), current_setting(…), duckdb_secrets() and the other
    configuration functions and views is refused with an InputError naming what it used, before any
    source is bound: binding sources is replaced by a function that fails the test if it is called.
    Today these run and return the server's spill folder and allowed paths in result rows."""
    (tmp_path / "t.csv").write_text("n\n1\n")

    def bound(*_: object) -> None:
        raise AssertionError("a source was bound before the refusal")

    monkeypatch.setattr(duckdb_engine, "_bind_sources", bound)
    ctx = ExecutionContext(base_dir=tmp_path, allowed_roots=(tmp_path,), limits=ExecutionLimits())
    with pytest.raises(InputError, match=f"step 's0' uses the {named}.*shows the server's configuration"):
        execute(_definition(sql, csv), {}, ctx)


def test_ordinary_functions_and_relations_still_pass(tmp_path: Path) -> None:
    """Proves the refusal is narrow: a step using range(), a CTE and ordinary scalar functions runs."""
    sql = ("with r as (select range as k from range(3)) "
           "select string_agg(upper('a') || k, ',' order by k) as s from r, t")
    result = execute(_definition(sql, csv=False), {}, ExecutionContext(base_dir=tmp_path, allowed_roots=(tmp_path,)))
    assert result.table.column("s").to_pylist() == ["A0,A1,A2"]


def test_a_step_text_that_passed_is_not_parsed_again_and_a_refused_one_always_is(tmp_path: Path) -> None:
    """Proves the per-process memory of checked step texts: a text that passed is not sent to DuckDB's
    parser again (the second check is given a closed cursor, which fails any statement), while a refused
    text is refused every time, from a fresh parse (nothing remembers a refusal), and a text that differs
    by one character is parsed on its own."""
    import duckdb

    from durable_dataflow.dataflow.execution import sandbox

    passed = sandbox.GatedStep("s0", "select 41 + 1 as s /* remembered */", frozenset())
    refused = sandbox.GatedStep("s0", "select current_setting('temp_directory') as s /* never kept */", frozenset())
    live = duckdb.connect()
    sandbox.refuse_server_reads(live, passed)
    for _ in range(2):
        with pytest.raises(InputError, match="shows the server's configuration"):
            sandbox.refuse_server_reads(live, refused)
    closed = duckdb.connect()
    closed.close()
    sandbox.refuse_server_reads(closed, passed)  # remembered: no statement on the closed cursor
    with pytest.raises(duckdb.ConnectionException):
        sandbox.refuse_server_reads(closed, sandbox.GatedStep("s0", passed.sql + " ", frozenset()))
    with pytest.raises(duckdb.ConnectionException):
        sandbox.refuse_server_reads(closed, refused)  # a refusal is parsed again
    live.close()
