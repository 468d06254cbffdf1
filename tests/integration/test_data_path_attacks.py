"""The data path under attack: a hostile tenant (or a careless user) tries to read undeclared files,
escape the sandbox through table functions, symlinks, Delta logs and races, exhaust resources, abuse the
PostgreSQL source and make error messages leak what it could not read. Every planted file holds CANARY,
which must never appear in a result or an error message that the attacker was not entitled to."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import unicodedata
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.core.errors import DataflowError, ExecutionError, InputError, LimitExceeded
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.execution import sandbox
from durable_dataflow.dataflow.execution.compute import execute
from durable_dataflow.dataflow.execution.context import ExecutionContext
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.resultstream import ResultCollector
from durable_dataflow.dataflow.execution.sources import resolve_sources
from durable_dataflow.dataflow.protocol.runs import RunStatus
from durable_dataflow.platform import Platform
from support import flows
from support.cli import make_cli

CANARY = "canary-5f3e-not-for-this-tenant"
PG_SECRET = "ATTACK_PG_DSN"
PG_PASSWORD = "HUNTER2-canary-pw"


_definition = functools.partial(flows.one_step, name="attack", max_rows=100_000)


def _ctx(base: Path, **limits: Any) -> ExecutionContext:
    return ExecutionContext(base_dir=base, allowed_roots=(base,), limits=ExecutionLimits(**limits))


def _refused(d: Definition, ctx: ExecutionContext) -> DataflowError:
    """The error an execution ends with; it must never show the canary."""
    with pytest.raises(DataflowError) as caught:
        execute(d, {}, ctx)
    assert CANARY not in caught.value.message
    return caught.value


DECLARED = {"decl": {"kind": "csv", "path": "decl.csv"}}
NFC_NAME = unicodedata.normalize("NFC", "caf\u00e9.csv")
NFD_NAME = unicodedata.normalize("NFD", "caf\u00e9.csv")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A data root with one declared CSV and, beside it, undeclared files that all hold the canary."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "decl.csv").write_text("n\n1\n2\n")
    (data / "decl.csvx").write_text(f"s\n{CANARY}\n")  # the declared path is a prefix of this one
    (data / "other.csv").write_text(f"s\n{CANARY}\n")
    (data / "other.json").write_text(json.dumps({"s": CANARY}) + "\n")
    pq.write_table(pa.table({"s": [CANARY]}), data / "other.parquet")
    (data / NFC_NAME).write_text("s\nmine\n")
    (data / NFD_NAME).write_text(f"s\n{CANARY}\n")  # the same name in another Unicode normal form
    (tmp_path / "outside.csv").write_text(f"s\n{CANARY}\n")
    return data


# ---- undeclared files through other table functions and path spellings ---------------------------


@pytest.mark.parametrize("sql", [
    "select s from read_json('{data}/other.json')",
    "select s from read_json_auto('{data}/other.json')",
    "select s from read_ndjson('{data}/other.json')",
    "select json::varchar as s from read_json_objects('{data}/other.json')",
    "select content::varchar as s from read_blob('{data}/other.csv')",
    "select path_in_schema as s from parquet_metadata('{data}/other.parquet')",
    "select name as s from parquet_schema('{data}/other.parquet')",
    "select file_name as s from parquet_file_metadata('{data}/other.parquet')",
    "select key::varchar as s from parquet_kv_metadata('{data}/other.parquet')",
    "select columns::varchar as s from sniff_csv('{data}/other.csv')",
    "select s from read_csv('{data}/other.csv', filename = true)",
    "select s from '{data}/other.csv'",
    "from '{data}/other.parquet'",
    "select s from query('select * from read_csv(''{data}/other.csv'')')",
    "select s from query_table('{data}/other.csv')",
    "select s::varchar as s from read_duckdb('{data}/other.csv')",
    "select s from read_csv('{data}//other.csv')",
    "select s from read_csv('{data}/./other.csv')",
    "select s from read_csv('{data}/other.csv/')",
    "select s from read_csv('{data}/decl.csvx')",
    "select s from read_csv('{data}/decl.csv/../other.csv')",
    "select s from read_csv('{data}/" + NFD_NAME + "')",
    "select s from read_csv('other.csv')",
    "select content as s from read_text('~/.bashrc')",
    "select file as s from glob('{data}/o*')",
    "select column_name as s from (describe select * from read_csv('{data}/other.csv'))",
    "select column_name as s from (summarize select * from read_csv('{data}/other.csv'))",
    "select extension_name as s from duckdb_extensions()",
])
def test_no_table_function_or_path_spelling_reaches_an_undeclared_file(folder: Path, sql: str) -> None:
    """Proves allowed_paths holds against every other file-reading table function (JSON, blob, Parquet
    metadata, sniffing, replacement scans, query()/query_table()), path spellings (//, /./, trailing
    slash, a path the declared one is a prefix of, another Unicode form, relative, ~) and DuckDB's home
    directory (extensions): each is refused as invalid_input without showing the canary."""
    d = _definition({**DECLARED, "mine": {"kind": "csv", "path": NFC_NAME}}, sql.format(data=folder), {"s": "string"})
    error = _refused(d, _ctx(folder))
    assert isinstance(error, InputError), error.message


@pytest.mark.parametrize("sql", [
    "select coalesce(max(name), 'none') as s from duckdb_secrets()",
    "select coalesce(max(name), 'none') as s from which_secret('s3://bucket/key', 's3')",
])
def test_duckdbs_secret_manager_is_out_of_a_steps_reach(folder: Path, sql: str) -> None:
    """Proves a step cannot ask DuckDB's secret manager anything: duckdb_secrets() and which_secret()
    are refused as invalid_input, naming the function (issue 29, finding 6), and the refusal names no
    home folder. (Persistent secrets are off as well, so the manager holds nothing to show.)"""
    d = _definition({**DECLARED, "mine": {"kind": "csv", "path": NFC_NAME}}, sql, {"s": "string"})
    error = _refused(d, _ctx(folder))
    assert isinstance(error, InputError), error.message
    assert "shows the server's configuration" in error.message and str(Path.home()) not in error.message


@pytest.mark.parametrize("sql", [
    "select * from enable_logging(storage = 'file', storage_path = '{out}/log')",
    "select * from enable_profiling(format = 'json', save_location = '{out}/profile.json')",
    "select * from disable_logging()",
    "select * from add_grammar_extension('x')",
    "select * from query('copy (select 1) to ''{out}/copy.csv''')",
    "select * from query('attach ''{out}/attached.duckdb'' as a')",
    "select * from json_execute_serialized_sql(json_serialize_sql('copy (select 1) to ''{out}/copy.csv'''))",
    "select * from (copy (select 1) to '{out}/copy.csv')",
    "with c as (pragma enable_profiling) select 1",
    "with c as (call pragma_version()) select 1",
])
def test_a_select_cannot_change_settings_or_write_files_through_table_functions(
    folder: Path, tmp_path: Path, sql: str
) -> None:
    """Proves the locked configuration refuses settings changed from inside a SELECT (logging or profiling
    to a file, grammar extensions) and that COPY/ATTACH/PRAGMA/CALL smuggled into query(), a serialized
    statement or a CTE are refused; afterwards nothing was written."""
    out = tmp_path / "written"
    out.mkdir()
    d = _definition(DECLARED, sql.format(out=out), {"n": "int64"})
    _refused(d, _ctx(folder))
    assert list(out.iterdir()) == []


def test_another_executions_spill_folder_cannot_be_read(folder: Path, tmp_path: Path) -> None:
    """Proves a step cannot read a spill folder other than its own even when it knows its name (the
    temp dir is listed by current_setting): DuckDB allow-lists only this execution's folder."""
    spill_root = tmp_path / "spill"
    victim = spill_root / f"{sandbox.SPILL_FOLDER_PREFIX}victim"
    victim.mkdir(parents=True)
    (victim / "spill.csv").write_text(f"s\n{CANARY}\n")
    for sql in (
        f"select s from read_csv('{victim}/spill.csv')",
        "select s from read_csv(current_setting('temp_directory') || '/../"
        f"{victim.name}/spill.csv')",
        f"select file as s from glob('{spill_root}/{sandbox.SPILL_FOLDER_PREFIX}*/*')",
    ):
        error = _refused(_definition(DECLARED, sql, {"s": "string"}), _ctx(folder, temp_dir=spill_root))
        assert isinstance(error, InputError), error.message
    assert sandbox.spill_folders_left(spill_root) == [victim.name]


def _read_without_leaking(d: Definition, ctx: ExecutionContext) -> None:
    """Execute d: either it fails or it succeeds; neither the message nor the result shows the canary."""
    try:
        result = execute(d, {}, ctx)
    except DataflowError as error:
        assert CANARY not in error.message
    else:
        assert CANARY not in json.dumps(result.table.to_pylist(), default=str)


def test_the_platform_database_beside_a_source_gives_nothing_away(sqlite_url: str, tmp_path: Path) -> None:
    """Proves a tenant whose data root holds the platform's SQLite file cannot read another tenant's stored
    rows from it: undeclared, read_blob is refused by the sandbox; declared as a CSV (the WAL while the
    platform is open, the main file once checkpointed) it yields nothing of the canary. Note: this holds
    only because DuckDB's CSV reader refuses the binary pages, not by any rule of the platform."""
    ctx = _ctx(tmp_path)
    (tmp_path / "decl.csv").write_text("n\n1\n")
    db_file, wal_file = tmp_path / "dataflow.db", tmp_path / "dataflow.db-wal"

    def attacks(target: Path) -> list[Definition]:
        blob = f"select content::varchar as s from read_blob('{target}')"
        as_csv = {"db": {"kind": "csv", "path": target.name, "header": False, "schema": {"s": "string"}}}
        return [_definition(DECLARED, blob, {"s": "string"}), _definition(as_csv, "select s from db", {"s": "string"})]

    with Platform(sqlite_url) as platform:
        secret_rows = {"kind": "inline", "rows": [{"s": CANARY}], "schema": {"s": "string"}}
        other = flows.definition(name="other_tenant", extra_sources={"vault": secret_rows})
        platform.runs.run_inline(flows.request(other, tmp_path, tenant="globex"))
        if wal_file.exists():
            assert CANARY.encode() in wal_file.read_bytes() + db_file.read_bytes()
            for attack in attacks(wal_file):
                _read_without_leaking(attack, ctx)
        attack = platform.runs.run_inline(flows.request(attacks(db_file)[0], tmp_path, tenant="acme")).run
        assert (attack.status, attack.error_code) == (RunStatus.FAILED, "invalid_input")
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        conn.execute("pragma wal_checkpoint(truncate)")
    assert CANARY.encode() in db_file.read_bytes()
    for attack in attacks(db_file):
        _read_without_leaking(attack, ctx)


def test_a_secrets_folder_inside_a_data_root_cannot_be_read_as_a_source(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves a source cannot name a file of DATAFLOW_SECRETS_DIR (DSNs, the evidence key) even when that
    folder lies inside a data root: a CSV source over secrets/CRM_DSN must be refused, not read."""
    secrets_dir = folder / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "CRM_DSN").write_text(f"postgresql://crm:{CANARY}@db.internal/crm\n")
    monkeypatch.setenv("DATAFLOW_SECRETS_DIR", str(secrets_dir))
    d = _definition({"leak": {"kind": "csv", "path": "secrets/CRM_DSN", "header": False, "schema": {"line": "string"}}},
                    "select line from leak", {"line": "string"})
    try:
        result = execute(d, {}, _ctx(folder))
    except InputError as error:
        assert CANARY not in error.message
    else:
        pytest.fail(f"the secret file was read as a source: {result.table.to_pylist()}")


# ---- what the platform builds around user input: quoting of paths, names, options ----------------


def test_quotes_newlines_and_sql_in_paths_columns_and_delimiters_stay_literal(folder: Path) -> None:
    """Proves the platform-built read_csv call cannot be injected: a file name holding a quote, a newline or
    a whole `'), read_text(...) --` fragment, column names that close the types struct, and a quote as
    the delimiter are all taken literally, and the undeclared file is never read."""
    names = ["it's.csv", "new\nline.csv", "x'), read_text('other.csv') --.csv"]
    for name in names:
        (folder / name).write_text("a\n7\n")
        d = _definition({"t": {"kind": "csv", "path": name}}, "select a::bigint as a from t", {"a": "int64"})
        assert execute(d, {}, _ctx(folder)).table.to_pylist() == [{"a": 7}]
    (folder / "cols.csv").write_text("1'2\n")
    hostile = {"a'); select * from read_csv('other.csv') --": "string", "b'}) --\"": "string"}
    d = _definition({"t": {"kind": "csv", "path": "cols.csv", "header": False, "delimiter": "'", "schema": hostile}},
                    "select * from t", dict.fromkeys(hostile, "string"))
    result = execute(d, {}, _ctx(folder))
    assert result.table.column_names == list(hostile)
    assert result.table.to_pylist() == [dict(zip(hostile, ["1", "2"], strict=True))]


@pytest.mark.parametrize("name", ['a"b', 'x" as select 1; --', "abc\n", "caf\u00e9", ""])
def test_source_and_step_names_that_could_break_identifier_quoting_are_refused(name: str) -> None:
    """Proves names that would close the platform's `CREATE TEMP VIEW "<name>"` / `CREATE TEMP TABLE
    "<name>"` quoting (a double quote, a newline before the end of the pattern) are refused when the
    definition is validated, for sources and for steps."""
    inline = {"kind": "inline", "rows": [{"n": 1}], "schema": {"n": "int64"}}
    base = {"name": "f", "version": 1, "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": 100}}
    with pytest.raises(ValueError):
        Definition.model_validate({**base, "sources": {name: inline}, "steps": [{"name": "r", "sql": "select 1 as n"}]})
    with pytest.raises(ValueError):
        Definition.model_validate({**base, "sources": {"t": inline}, "steps": [{"name": name, "sql": "select 1 as n"}]})


# ---- links -----------------------------------------------------------------------------------------


def test_a_hard_link_to_a_file_outside_is_read_as_a_file_of_the_root(folder: Path, tmp_path: Path) -> None:
    """Documents that confinement is by path: a hard link inside the root is a real file of the root, so a
    folder source reads it (whoever could create the link could already read the file) and fingerprints it."""
    parts = folder / "parts"
    parts.mkdir()
    pq.write_table(pa.table({"s": ["mine"]}), parts / "a.parquet")
    pq.write_table(pa.table({"s": ["linked"]}), tmp_path / "elsewhere.parquet")
    os.link(tmp_path / "elsewhere.parquet", parts / "b.parquet")
    d = _definition({"p": {"kind": "parquet", "path": "parts"}}, "select s from p order by s", {"s": "string"})
    result = execute(d, {}, _ctx(folder))
    assert result.table.to_pylist() == [{"s": "linked"}, {"s": "mine"}]


def test_a_folder_source_never_follows_a_directory_symlink_leading_out(folder: Path, tmp_path: Path) -> None:
    """Proves a symlinked sub-folder of a folder source is refused with a clear error naming it (never
    followed, and never silently skipped so that data goes missing), without reading what it holds."""
    parts = folder / "parts"
    parts.mkdir()
    pq.write_table(pa.table({"s": ["mine"]}), parts / "a.parquet")
    outside = tmp_path / "outside_dir"
    outside.mkdir()
    pq.write_table(pa.table({"s": [CANARY]}), outside / "x.parquet")
    (parts / "linked").symlink_to(outside, target_is_directory=True)
    d = _definition({"p": {"kind": "parquet", "path": "parts"}}, "select s from p", {"s": "string"})
    with pytest.raises(InputError, match="holds a symlinked folder 'linked'") as caught:
        execute(d, {}, _ctx(folder))
    assert CANARY not in caught.value.message


def test_a_parquet_folder_skips_files_under_hidden_and_underscore_folders(folder: Path) -> None:
    """Proves a folder source reads only its data files: files under `_temporary/` (a writer's
    uncommitted output) or `.hidden/` folders are skipped like `_`/`.` files are (pyarrow's rule), so a
    half-written job is not silently counted."""
    parts = folder / "parts"
    (parts / "_temporary" / "0").mkdir(parents=True)
    (parts / ".staging").mkdir()
    pq.write_table(pa.table({"n": [1, 2]}), parts / "part-0.parquet")
    pq.write_table(pa.table({"n": [1000]}), parts / "_temporary" / "0" / "part-1.parquet")
    pq.write_table(pa.table({"n": [1000]}), parts / ".staging" / "part-1.parquet")
    d = _definition({"p": {"kind": "parquet", "path": "parts"}}, "select sum(n) as n from p", {"n": "int64"})
    assert execute(d, {}, _ctx(folder)).table.to_pylist() == [{"n": 3}]


def test_a_folder_with_too_many_files_is_refused_before_any_is_read(folder: Path) -> None:
    """Proves a folder source of more than 10,000 files is refused as invalid_input before any footer is
    read (the files here are empty, so reading one would fail differently)."""
    crowd = folder / "crowd"
    crowd.mkdir()
    for i in range(10_001):
        (crowd / f"{i:05d}.parquet").touch()
    d = _definition({"p": {"kind": "parquet", "path": "crowd"}}, "select 1 as n", {"n": "int32"})
    with pytest.raises(InputError, match="more than 10000 parquet files"):
        execute(d, {}, _ctx(folder))


# ---- Delta logs that point elsewhere -------------------------------------------------------------


def _rewrite_add_paths(table: Path, path: str) -> None:
    """Point every add action of the table's latest commit at path."""
    commit = sorted((table / "_delta_log").glob("*.json"))[-1]
    actions = [json.loads(line) for line in commit.read_text().splitlines() if line.strip()]
    for action in actions:
        if "add" in action:
            action["add"]["path"] = path
    commit.write_text("".join(json.dumps(a) + "\n" for a in actions))


@pytest.mark.parametrize("target", ["absolute", "file_uri", "dotdot", "other_tenant_absolute", "symlink_out"])
def test_a_delta_log_naming_a_file_outside_the_table_is_never_read(
    folder: Path, tmp_path: Path, target: str
) -> None:
    """Proves a tampered _delta_log whose add action names a file outside the table folder (absolute,
    file://, `../`, another tenant's table in the same root, a symlink in the table leading out) fails
    the attempt and the other file's rows never appear, neither in a result nor in the message."""
    deltalake = pytest.importorskip("deltalake")
    deltalake.write_deltalake(str(tmp_path / "outside_table"), pa.table({"s": [CANARY]}))
    deltalake.write_deltalake(str(folder / "tenant_b"), pa.table({"s": [CANARY]}))
    deltalake.write_deltalake(str(folder / "mine"), pa.table({"s": ["mine"]}))
    outside_file = next((tmp_path / "outside_table").glob("*.parquet"))
    other_tenant_file = next((folder / "tenant_b").glob("*.parquet"))
    if target == "symlink_out":
        (folder / "mine" / "evil.parquet").symlink_to(outside_file)
    path = {
        "absolute": str(outside_file),
        "file_uri": outside_file.as_uri(),
        "dotdot": f"../../{outside_file.parent.name}/{outside_file.name}",
        "other_tenant_absolute": str(other_tenant_file),
        "symlink_out": "evil.parquet",
    }[target]
    _rewrite_add_paths(folder / "mine", path)
    d = _definition({"t": {"kind": "delta", "path": "mine"}}, "select s from t", {"s": "string"})
    _refused(d, _ctx(folder))


def test_a_delta_log_symlinked_out_of_the_roots_is_refused_without_echoing_it(folder: Path, tmp_path: Path) -> None:
    """Proves the Delta log itself is confined: a table folder whose _delta_log is a symlink to another
    table's log outside the roots is refused as invalid_input, and nothing of that log (here a partition
    value) appears in the message. Today the outside log is read and its partition value is echoed."""
    deltalake = pytest.importorskip("deltalake")
    theirs = tmp_path / "theirs"
    deltalake.write_deltalake(str(theirs), pa.table({"p": [CANARY], "v": [1]}), partition_by=["p"])
    (folder / "borrowed").mkdir()
    (folder / "borrowed" / "_delta_log").symlink_to(theirs / "_delta_log", target_is_directory=True)
    d = _definition({"t": {"kind": "delta", "path": "borrowed"}}, "select v from t", {"v": "int64"})
    with pytest.raises(InputError, match=r"_delta_log leaves the table's folder") as caught:
        execute(d, {}, _ctx(folder))
    assert CANARY not in caught.value.message


@pytest.mark.parametrize("table_name", ["my table", "caf\u00e9"])
def test_a_delta_table_whose_folder_name_needs_url_escaping_can_be_read(folder: Path, table_name: str) -> None:
    """Proves a careless-but-legal folder name (a space, an accent) works for a Delta source: today the
    percent-encoded file URIs (my%20table/…) are taken as file names and the table 'does not exist'."""
    deltalake = pytest.importorskip("deltalake")
    deltalake.write_deltalake(str(folder / table_name), pa.table({"n": [1, 2]}))
    d = _definition({"t": {"kind": "delta", "path": table_name}}, "select sum(n) as n from t", {"n": "int64"})
    assert execute(d, {}, _ctx(folder)).table.to_pylist() == [{"n": 3}]


# ---- races: a file swapped after resolution ------------------------------------------------------


@pytest.mark.parametrize("swap", ["file_symlink", "folder_symlink"])
def test_a_file_swapped_after_resolution_cannot_leak_through_an_engine_error(
    folder: Path, tmp_path: Path, swap: str
) -> None:
    """Proves a race cannot exfiltrate a file outside the roots: the declared file (or its folder) is
    swapped for a symlink after resolution and the step makes DuckDB fail on the value it reads. The
    attempt must fail as 'changed while the run read it' without the outside value; today DuckDB follows
    the link and the conversion error quotes the outside file, because the stamp check runs only on success."""
    (folder / "sub").mkdir()
    (folder / "sub" / "t.csv").write_text("s\n1\n")
    outside = tmp_path / "swap_target"
    outside.mkdir()
    (outside / "t.csv").write_text(f"s\n{CANARY}\n")
    d = _definition({"t": {"kind": "csv", "path": "sub/t.csv", "schema": {"s": "string"}}},
                    "select s::int as n from t", {"n": "int32"})
    ctx = _ctx(folder)
    resolved = resolve_sources(d, ctx)
    if swap == "file_symlink":
        (folder / "sub" / "t.csv").unlink()
        (folder / "sub" / "t.csv").symlink_to(outside / "t.csv")
    else:
        shutil.rmtree(folder / "sub")
        (folder / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ExecutionError) as caught:
        execute(d, {}, ctx, sources=resolved)
    assert CANARY not in caught.value.message
    assert "changed while the run read it" in caught.value.message


# ---- resource abuse ------------------------------------------------------------------------------


def test_a_csv_with_an_enormous_line_is_a_clear_error_that_does_not_quote_it(folder: Path) -> None:
    """Proves a 5 MB line fails as execution_failed naming DuckDB's line-size limit, without the line."""
    (folder / "long.csv").write_text("a,b\n1,2\n" + CANARY + "x" * 5_000_000 + ",3\n")
    d = _definition({"t": {"kind": "csv", "path": "long.csv"}}, "select count(*) as n from t", {"n": "int64"})
    error = _refused(d, _ctx(folder))
    assert type(error) is ExecutionError and "Maximum line size" in error.message


# VmHWM, not ru_maxrss: across fork and exec Linux carries the parent's peak into the child's ru_maxrss.
MEMORY_PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from durable_dataflow.core.errors import LimitExceeded
    from durable_dataflow.dataflow.definitions.definitions import Definition
    from durable_dataflow.dataflow.execution import isolation
    from durable_dataflow.dataflow.execution.context import ExecutionContext
    from durable_dataflow.dataflow.execution.compute import execute
    from durable_dataflow.dataflow.execution.limits import ExecutionLimits

    def peak_kib(pid):
        return next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmHWM:"))

    d = Definition.model_validate(json.loads(sys.argv[1]))
    base = Path(sys.argv[2])
    pool = isolation.configure(isolation.Isolation.PROCESS)  # as `dataflow worker` and `dataflow serve` do
    try:
        execute(d, {}, ExecutionContext(base, (base,), ExecutionLimits(memory_bytes_max=64 * 1024**2)))
        outcome = "finished"
    except LimitExceeded as error:
        outcome = "limit_exceeded: " + error.message
    executors = [peak_kib(pid) for pid in pool.pids()]
    print(json.dumps({"outcome": outcome, "peak_kib": peak_kib("self"), "executor_peaks_kib": executors}))
""")
BASELINE_PEAK_KIB = 250 * 1024  # imports and an execution of `select 1` peak near 125 MiB


def test_the_memory_limit_bounds_a_single_huge_value(tmp_path: Path) -> None:
    """Proves, in a subprocess isolating its executions as a worker does and measuring peak RSS, that a step
    building one 400 MB string (repeat(), which DuckDB's memory_limit = 64MiB does not count) ends
    limit_exceeded, the executor process peaks near its baseline (RLIMIT_DATA refused the allocation), and
    the calling process never held the value. In process, the step succeeds at ~900 MiB (docs/engines.md)."""
    document = {
        "name": "hog", "version": 1, "sources": {},
        "steps": [{"name": "r", "sql": "select length(repeat('x', 400000000))::bigint as n"}],
        "output": {"schema": {"n": "int64"}, "max_rows": 1, "max_bytes": "1MiB"},
    }
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, json.dumps(document), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert report["outcome"].startswith("limit_exceeded"), report
    assert "memory limit of 64MiB" in report["outcome"], report
    assert report["peak_kib"] < BASELINE_PEAK_KIB + 64 * 1024, report
    assert report["executor_peaks_kib"], report
    assert all(peak < BASELINE_PEAK_KIB + 64 * 1024 for peak in report["executor_peaks_kib"]), report


def test_a_batch_larger_than_max_bytes_is_refused_before_it_is_copied_into_the_result() -> None:
    """Proves the collector refuses a batch that alone exceeds output.max_bytes without first appending it to
    the IPC stream: memory stays max_bytes plus the one batch, as docs/engines.md says (before 931617c the
    64 MiB batch was encoded first and the stream buffer grew to 128 MiB)."""
    schema = pa.schema([pa.field("s", pa.string())])
    batch = pa.record_batch([pa.array(["x" * (64 * 1024**2)])], schema=schema)
    before = pa.total_allocated_bytes()
    collector = ResultCollector(schema, 10, 1024**2, "output.max_bytes = 1MiB")
    with pytest.raises(LimitExceeded, match=r"output\.max_bytes = 1MiB"):
        collector.add(batch)
    assert pa.total_allocated_bytes() - before < 4 * 1024**2


# ---- the PostgreSQL source -------------------------------------------------------------------------


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _pg_definition(query: str, sql: str = "select count(*)::bigint as n from s",
                   columns: dict[str, str] | None = None) -> Definition:
    return _definition({"s": {"kind": "postgres", "dsn": {"secret": PG_SECRET}, "query": query}},
                       sql, columns or {"n": "int64"})


@pytest.fixture
def pg_dsn(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A database with a table t of 3 rows and a function that writes, the DSN in the secret."""
    dsn = _libpq(pg_url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table t (id int)")
        conn.execute("insert into t values (1), (2), (3)")
        conn.execute("create function wr() returns int language sql as 'insert into t values (99) returning id'")
    monkeypatch.setenv(PG_SECRET, dsn)
    return dsn


def _other_backends(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("select count(*) from pg_stat_activity where datname = current_database() "
                           "and pid <> pg_backend_pid()").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("query", [
    "select 1 as a; delete from t",
    "select 1 as a; commit; delete from t",
    "commit; delete from t",
    "select 1 as a; rollback; set transaction read write; create table pwn (x int)",
    "select set_config('transaction_read_only', 'off', true), wr()",
    "select wr()",
])
def test_a_postgres_query_cannot_write_or_leave_its_read_only_transaction(
    pg_dsn: str, tmp_path: Path, query: str
) -> None:
    """Proves the server-side cursor refuses several statements (so COMMIT/ROLLBACK cannot end the READ
    ONLY transaction), read-write mode cannot be turned back on, and a writing function is refused."""
    with pytest.raises(ExecutionError, match="the postgres query failed"):
        execute(_pg_definition(query), {}, _ctx(tmp_path))
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("select count(*) from t").fetchone() == (3,)
        assert conn.execute("select to_regclass('public.pwn')").fetchone() == (None,)


def test_a_cast_error_in_a_later_postgres_batch_fails_cleanly_and_closes_the_connection(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Proves an error raised by PostgreSQL while the third batch is fetched (after rows already streamed
    into DuckDB) ends as execution_failed with a fixed description and the SQLSTATE (never the server's
    text, which quotes the value), and the connection is closed."""
    query = "select (case when g < 25000 then g::text else 'x' end)::int as v from generate_series(1, 30000) g"
    with pytest.raises(ExecutionError) as caught:
        execute(_pg_definition(query), {}, _ctx(tmp_path))
    assert type(caught.value) is ExecutionError
    assert caught.value.message == ("source 's': the postgres query failed: a value has the wrong form for its type "
                                    "(invalid input syntax) (SQLSTATE 22P02)")
    deadline = time.monotonic() + 5
    while _other_backends(pg_dsn) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _other_backends(pg_dsn) == 0


def test_a_slow_postgres_query_is_limit_exceeded_not_an_execution_failure(pg_dsn: str, tmp_path: Path) -> None:
    """Proves the time limit during source binding is reported as the time limit (limit_exceeded, as for
    every other time-out); today PostgreSQL's statement_timeout surfaces as execution_failed."""
    with pytest.raises(LimitExceeded, match="time limit"):
        execute(_pg_definition("select pg_sleep(5)"), {}, _ctx(tmp_path, time_limit_s=1))


def test_a_postgres_query_cannot_lift_its_own_time_limit(pg_dsn: str, tmp_path: Path) -> None:
    """Proves the time limit holds even when the query turns statement_timeout off for the rest of its
    transaction (set_config in the first fetched batch) and then sleeps in the second: the execution must
    stop near its 1 s limit. Today nothing cancels the PostgreSQL fetch and it runs for the whole sleep."""
    query = ("select g, case when g = 1 then set_config('statement_timeout', '0', true) end as c, "
             "case when g = 15000 then pg_sleep(6)::text end as z from generate_series(1, 20000) g")
    started = time.monotonic()
    with pytest.raises(LimitExceeded):
        execute(_pg_definition(query), {}, _ctx(tmp_path, time_limit_s=1))
    assert time.monotonic() - started < 3.5


def test_connection_errors_never_show_the_password(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves connection failures (unknown database, bad sslmode, a bad server option, a database named
    like the password) name the problem without the DSN or its password."""
    host_port = pg_dsn.split("@", 1)[1].split("/", 1)[0]
    for dsn in (
        f"postgresql://postgres:{PG_PASSWORD}@{host_port}/no_such_db",
        f"postgresql://postgres:{PG_PASSWORD}@{host_port}/db?sslmode=bogus",
        f"postgresql://postgres:{PG_PASSWORD}@{host_port}/db?options=-c%20statement_timeout%3Dfoo",
        f"postgresql://postgres:{PG_PASSWORD}@{host_port}/{PG_PASSWORD}",
        f"host=127.0.0.1 password={PG_PASSWORD} dbname",
    ):
        monkeypatch.setenv(PG_SECRET, dsn)
        with pytest.raises(ExecutionError) as caught:
            execute(_pg_definition("select 1 as a"), {}, _ctx(tmp_path))
        assert PG_PASSWORD not in caught.value.message and dsn not in caught.value.message


def test_a_password_with_an_at_sign_is_not_echoed_as_a_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves a careless DSN whose password holds an unescaped '@' does not leak the password's tail: libpq
    reads `tail@host` as the host and today psycopg's "failed to resolve host '...'" (single quotes, not
    masked) shows it."""
    monkeypatch.setenv(PG_SECRET, f"postgresql://crm:first@{CANARY}@127.0.0.1:1/crm")
    with pytest.raises(ExecutionError, match="cannot connect to PostgreSQL") as caught:
        execute(_pg_definition("select 1 as a"), {}, _ctx(tmp_path))
    assert CANARY not in caught.value.message


PG_MEMORY_PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from durable_dataflow.core.errors import DataflowError
    from durable_dataflow.dataflow.definitions.definitions import Definition
    from durable_dataflow.dataflow.execution.context import ExecutionContext
    from durable_dataflow.dataflow.execution.compute import execute
    from durable_dataflow.dataflow.execution.limits import ExecutionLimits
    d = Definition.model_validate(json.loads(sys.argv[1]))
    base = Path(sys.argv[2])
    limits = ExecutionLimits(memory_bytes_max=64 * 1024**2, source_bytes_max=1024**2)
    try:
        execute(d, {}, ExecutionContext(base, (base,), limits))
        outcome = "finished"
    except DataflowError as error:
        outcome = type(error).__name__ + ": " + error.message
    peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"outcome": outcome, "peak_kib": peak_kib}))
""")


def test_wide_postgres_rows_are_stopped_by_the_source_limit_before_they_fill_memory(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Proves, in a subprocess measuring its peak RSS, that a query of 10,000 rows of 20 kB (200 MB) with a
    1 MiB source limit and a 64 MiB memory limit stops with limit_exceeded near those bounds. Today one
    FETCH of 10,000 rows is held whole by libpq, as Python strings and as Arrow before the source limit is
    checked, peaking near 800 MiB: the row count per fetch must follow the row width (or the bytes read)."""
    query = "select repeat('x', 20000) as s from generate_series(1, 10000)"
    document = _pg_definition(query).model_dump(mode="json", by_alias=True)
    done = subprocess.run([sys.executable, "-c", PG_MEMORY_PROBE, json.dumps(document), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, PG_SECRET: pg_dsn})
    report = json.loads(done.stdout)
    assert report["outcome"].startswith("LimitExceeded: source 's' streamed more than the source limit"), report
    assert report["peak_kib"] < BASELINE_PEAK_KIB + 64 * 1024, report


# ---- the same attacks through the CLI and the API ------------------------------------------------


ATTACK_YAML = """\
name: {name}
version: 1
sources:
{sources}
steps:
  - name: r
    sql: {sql}
output:
  schema: {{s: string}}
  max_rows: 10
  max_bytes: 1MiB
"""


def test_cli_run_cannot_read_the_platform_database_or_a_file_beside_its_source(tmp_path: Path) -> None:
    """Proves, through `dataflow run` in a subprocess with the platform's SQLite file in the definition's
    folder (as the default ./.dataflow/dataflow.db is when run from the project folder), that reading the
    database or an undeclared file from SQL, or declaring the database as a CSV, fails the run without
    printing what the file holds."""
    project = tmp_path / "project"
    project.mkdir()
    cli = make_cli(f"sqlite:///{project}/dataflow.db", project)
    (project / "decl.csv").write_text("n\n1\n")
    (project / "other.csv").write_text(f"s\n{CANARY}\n")
    planted = ATTACK_YAML.format(name="planted", sources="  v: {kind: inline, schema: {s: string}, rows: [{s: "
                                 + CANARY + "}]}", sql="select s from v")
    (project / "planted.yaml").write_text(planted)
    assert cli("run", "planted.yaml", "--json").code == 0
    decl = "  d: {kind: csv, path: decl.csv}"
    attacks = {
        "blob.yaml": (decl, f"select content::varchar as s from read_blob('{project}/dataflow.db')"),
        "text.yaml": (decl, "select content as s from read_text('other.csv')"),
        "declared.yaml": ("  db: {kind: csv, path: dataflow.db, header: false, schema: {s: string}}",
                          "select s from db"),
    }
    for file_name, (sources, sql) in attacks.items():
        (project / file_name).write_text(ATTACK_YAML.format(name="attack", sources=sources, sql=json.dumps(sql)))
        result = cli("run", file_name, "--json")
        assert result.code != 0, result.output
        assert CANARY not in result.output
        if file_name == "declared.yaml":  # the database itself is refused before anything is recorded
            assert result.code == 2 and "the platform's own files" in result.stderr, result.output
        else:
            assert result.json()["status"] == "failed"


@pytest.fixture
def api(sqlite_url: str, tmp_path: Path) -> Any:
    """A TestClient on a platform whose API data root is tmp/data, an acme submitter's headers, and
    acme's own folder in it (tmp/data/acme), where its relative source paths resolve."""
    data = tmp_path / "data"
    (data / "acme").mkdir(parents=True)
    platform = Platform(sqlite_url)
    token = tokens.create_token(platform.db, "acme", "submitter", "acme-submitter")[0]
    with TestClient(create_app(platform, data_root=data)) as client:
        yield client, {"Authorization": f"Bearer {token}"}, data / "acme"
    platform.close()


def _api_document(sources: dict[str, Any], sql: str) -> dict[str, Any]:
    return {"name": "api_attack", "version": 1, "sources": sources, "steps": [{"name": "r", "sql": sql}],
            "output": {"schema": {"s": "string"}, "max_rows": 10, "max_bytes": "1MiB"}}


def test_api_submission_cannot_read_a_file_beside_its_source(api: Any) -> None:
    """Proves an API-submitted definition whose step reads an undeclared file of the data root gets a
    failed run with invalid_input, and the response never holds the file's contents."""
    client, headers, data = api
    (data / "decl.csv").write_text("n\n1\n")
    (data / "other.csv").write_text(f"s\n{CANARY}\n")
    for sql in ("select content as s from read_text('" + str(data / "other.csv") + "')",
                "select s from read_csv('" + str(data / "decl.csv") + "/../other.csv')"):
        response = client.post("/v1/runs", json={"definition": _api_document(DECLARED, sql)}, headers=headers)
        assert CANARY not in response.text
        run = response.json()["run"]
        assert (run["status"], run["error_code"]) == ("failed", "invalid_input")


def test_api_submission_cannot_exfiltrate_a_secret_file_through_an_error_message(
    api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves an API tenant cannot read DATAFLOW_SECRETS_DIR when it lies inside the data root: declaring
    secrets/CRM_DSN as a CSV and casting its line to int must not put the DSN into the run's error
    message (today the conversion error quotes it in the API response)."""
    client, headers, data = api
    (data / "secrets").mkdir()
    (data / "secrets" / "CRM_DSN").write_text(f"postgresql://crm:{CANARY}@db.internal/crm\n")
    monkeypatch.setenv("DATAFLOW_SECRETS_DIR", str(data / "secrets"))
    sources = {"leak": {"kind": "csv", "path": "secrets/CRM_DSN", "header": False, "schema": {"line": "string"}}}
    response = client.post("/v1/runs", json={"definition": _api_document(sources, "select line::int::varchar as s "
                                                                         "from leak")}, headers=headers)
    assert CANARY not in response.text


def test_an_api_tenant_cannot_read_another_tenants_publication_in_the_shared_data_root(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Proves tenant isolation holds on the data path: acme publishes rows to the relative sink `acme_sink`
    (resolved inside acme's sink folder), then globex declares that folder as a Parquet source (relative,
    climbing out of its tree, absolute) and casts its values to int; each is refused before recording and
    no answer holds acme's value."""
    data = tmp_path / "data"
    data.mkdir()
    with Platform(sqlite_url) as platform:
        acme = {"Authorization": f"Bearer {tokens.create_token(platform.db, 'acme', 'submitter', 'a')[0]}"}
        globex = {"Authorization": f"Bearer {tokens.create_token(platform.db, 'globex', 'submitter', 'g')[0]}"}
        with TestClient(create_app(platform, data_root=data)) as client:
            publish = _api_document({"v": {"kind": "inline", "rows": [{"s": CANARY}], "schema": {"s": "string"}}},
                                    "select s from v")
            publish["target"] = flows.parquet_target(location="acme_sink")
            published = client.post("/v1/runs", json={"definition": publish}, headers=acme)
            assert published.json()["run"]["status"] == "succeeded", published.text
            for path in ("acme_sink", "../acme/acme_sink", str(data / "acme" / "acme_sink")):
                steal = _api_document({"loot": {"kind": "parquet", "path": path}},
                                      "select s::int::varchar as s from loot")
                stolen = client.post("/v1/runs", json={"definition": steal}, headers=globex)
                assert CANARY not in stolen.text
                assert stolen.status_code == 422 and stolen.json()["error"]["code"] == "invalid_input", stolen.text


def test_an_api_tenant_cannot_publish_outside_the_data_root(sqlite_url: str, tmp_path: Path) -> None:
    """Proves the write side of the confinement: an API-submitted target whose `location` is an absolute
    path outside the data root is refused (invalid_input) and nothing is written there (the parquet provider
    would create _locks/, _manifests/ and data/ wherever the server may write)."""
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "elsewhere" / "sink"
    with Platform(sqlite_url) as platform:
        acme = {"Authorization": f"Bearer {tokens.create_token(platform.db, 'acme', 'submitter', 'a')[0]}"}
        with TestClient(create_app(platform, data_root=data)) as client:
            document = _api_document({"v": {"kind": "inline", "rows": [{"s": "x"}], "schema": {"s": "string"}}},
                                     "select s from v")
            document["target"] = flows.parquet_target(location=str(outside))
            response = client.post("/v1/runs", json={"definition": document}, headers=acme)
    assert not outside.exists(), sorted(str(p) for p in outside.rglob("*"))
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input", response.text
