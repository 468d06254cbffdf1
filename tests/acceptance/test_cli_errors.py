"""Acceptance: bad definitions exit 2 with file and field path and no traceback (unless --debug);
`definitions`, `schema`, `db` and `version` work; no CLI output or database byte ever holds a secret."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_dataflow import migrations
from durable_dataflow.core.db import Database
from support.cli import REVENUE_EXAMPLE, Cli, CliResult, make_cli

CANARY = "canary-pass-93f1"
CANARY_DSN = f"postgresql://u:{CANARY}@127.0.0.1:1/x"
CANARY_DEFINITION = """\
name: canary_crm
version: 1
sources:
  crm:
    kind: postgres
    dsn: {secret: CANARY_DSN}
    query: "select 1::bigint as id"
steps:
  - name: ids
    sql: select id from crm
output:
  schema: {id: int64}
  max_rows: 10
  max_bytes: 1MiB
"""


@pytest.fixture
def sqlite_cli(sqlite_url: str, tmp_path: Path) -> Cli:
    return make_cli(sqlite_url, tmp_path)


def copy_revenue(tmp_path: Path) -> Path:
    folder = tmp_path / "revenue"
    shutil.copytree(REVENUE_EXAMPLE.parent, folder)
    return folder / "dataflow.yaml"


def test_malformed_yaml_exits_2_naming_the_file(sqlite_cli: Cli, tmp_path: Path) -> None:
    """Malformed YAML exits 2 with the file and line in stderr, no traceback and no run recorded."""
    path = copy_revenue(tmp_path)
    path.write_text(path.read_text() + "\nsteps: [unclosed\n")
    result = sqlite_cli("run", str(path), "--param", "day=2026-11-02")
    assert result.code == 2, result.output
    assert result.stderr.startswith("error [invalid_input]:") and str(path) in result.stderr
    assert "malformed YAML" in result.stderr and "line" in result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    assert sqlite_cli("runs", "--json").json() == []


def test_unknown_field_names_its_path_and_debug_shows_traceback(sqlite_cli: Cli, tmp_path: Path) -> None:
    """An unknown field exits 2 naming the file and `sources.orders.colour`; with --debug a traceback is added."""
    path = copy_revenue(tmp_path)
    original = "    path: data/orders.csv\n"
    path.write_text(path.read_text().replace(original, original + "    colour: red\n", 1))
    result = sqlite_cli("run", str(path), "--param", "day=2026-11-02")
    assert result.code == 2, result.output
    assert str(path) in result.stderr and "sources.orders.colour: unknown field" in result.stderr
    assert "Traceback" not in result.stderr

    debug = sqlite_cli("run", str(path), "--param", "day=2026-11-02", debug=True)
    assert debug.code == 2
    assert "Traceback (most recent call last)" in debug.stderr and "InputError" in debug.stderr
    assert "sources.orders.colour: unknown field" in debug.stderr
    assert sqlite_cli("runs", "--json").json() == []


def test_usage_error_and_missing_file(sqlite_cli: Cli, tmp_path: Path) -> None:
    """An unknown option is a usage error (exit 2); a missing definition file exits 2 naming it."""
    usage = sqlite_cli("runs", "--no-such-option")
    assert usage.code == 2 and "No such option" in usage.stderr
    missing = sqlite_cli("run", str(tmp_path / "nope.yaml"))
    assert missing.code == 2 and "nope.yaml" in missing.stderr and "Traceback" not in missing.stderr


def test_a_definition_or_grants_file_that_is_no_regular_file_exits_2(sqlite_cli: Cli, tmp_path: Path) -> None:
    """Proves /dev/zero (size 0, endless: `run` was killed for its memory), a FIFO (the reader blocked
    forever) and a folder given as the definition, or as DATAFLOW_GRANTS, exit 2 at once, naming it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    revenue = copy_revenue(tmp_path / "grants")
    for path in (Path("/dev/zero"), fifo, tmp_path):
        for command in (("run", str(path)), ("submit", str(path)), ("schedules", "apply", str(path))):
            refused = sqlite_cli(*command)
            assert refused.code == 2, refused.output
            assert f"{path}: the definition is not a regular file" in refused.stderr, refused.output
        refused = sqlite_cli("run", str(revenue), "--param", "day=2026-11-02", extra_env={"DATAFLOW_GRANTS": str(path)})
        assert refused.code == 2 and "DATAFLOW_GRANTS: the grants file is not a regular file" in refused.stderr
    assert sqlite_cli("runs", "--json").json() == []


def test_a_param_without_its_name_is_refused_without_repeating_it(sqlite_cli: Cli, tmp_path: Path) -> None:
    """Proves `--param VALUE` (a value pasted without NAME=) exits 2 naming the option's position only:
    the whole raw text was repeated, and it may be a secret pasted into the wrong place."""
    revenue = copy_revenue(tmp_path)
    for bad in ("canary-secret-7d1e", "=canary-secret-7d1e"):
        refused = sqlite_cli("run", str(revenue), "--param", "day=2026-11-02", "--param", bad)
        assert refused.code == 2 and "--param number 2 must have the form NAME=VALUE" in refused.stderr
        assert "canary-secret-7d1e" not in refused.output
    assert sqlite_cli("runs", "--json").json() == []


def test_database_urls_that_cannot_work_are_refused_with_their_reason(tmp_path: Path) -> None:
    """Proves a file that is no database (exit 7); a path through a file, /proc, an unparseable URL,
    an in-memory database or an empty --db (exit 2); and a schema a newer version migrated (exit 2
    for runs, db upgrade and db current: `db current` advised an upgrade) each name the problem;
    none was an internal error."""
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a database\n")
    cases = (
        (f"sqlite:///{text_file}", 7, "file is not a SQLite database"),
        (f"sqlite:///{text_file}/x.db", 2, "cannot be created"),
        ("sqlite:////proc/no-such/x.db", 2, "cannot be created"),
        ("postgresql://u:canary-pw-51c2@[::1/db", 2, "the database URL cannot be parsed"),
        # In memory, the write and read engines each saw their own empty database: runs exited 7.
        ("sqlite:///", 2, "an in-memory SQLite database cannot hold the platform"),
        ("sqlite:///:memory:", 2, "an in-memory SQLite database cannot hold the platform"),
        ("", 2, "--db must not be empty"),  # it silently meant the embedded default
    )
    for url, code, expected in cases:
        refused = make_cli(url, tmp_path)("runs")
        assert refused.code == code and expected in refused.stderr, (url, refused.output)
        assert "canary-pw-51c2" not in refused.output
    future = f"sqlite:///{tmp_path / 'future.db'}"
    cli = make_cli(future, tmp_path)
    assert cli("db", "upgrade").code == 0
    engine = sa.create_engine(future)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_future'"))
    engine.dispose()
    for command in (("runs",), ("db", "upgrade"), ("db", "current")):
        refused = cli(*command)
        assert refused.code == 2 and "at revision '9999_future', which this version does not know" in refused.stderr


def test_definitions_schema_db_and_version(sqlite_cli: Cli, sqlite_url: str) -> None:
    """`definitions list/show` return the pinned definition of a run; `schema` is valid JSON Schema;
    `db current` reports head after `db upgrade`; `version` prints the package version."""
    assert sqlite_cli("definitions", "list", "--json").json() == []
    run = sqlite_cli("run", str(REVENUE_EXAMPLE), "--param", "day=2026-11-02", "--json").json()
    listed = sqlite_cli("definitions", "list", "--json").json()
    assert [(d["name"], d["definition_hash"]) for d in listed] == [("revenue_by_region", run["definition_hash"])]
    by_name = sqlite_cli("definitions", "show", "revenue_by_region", "--json").json()
    by_hash = sqlite_cli("definitions", "show", run["definition_hash"], "--json").json()
    assert by_name == by_hash and by_name["body"]["name"] == "revenue_by_region"
    assert sqlite_cli("definitions", "show", "nope").code == 4
    table = sqlite_cli("definitions", "list")
    assert table.code == 0 and run["definition_hash"] in table.stdout

    schema = sqlite_cli("schema")
    assert schema.code == 0
    document = json.loads(schema.stdout)
    assert {"name", "sources", "steps", "output"} <= set(document["properties"])

    assert sqlite_cli("db", "upgrade").code == 0
    current = sqlite_cli("db", "current")
    assert current.code == 0 and migrations.head_revision() in current.stdout
    version = sqlite_cli("version")
    assert version.code == 0 and version.stdout.startswith("dataflow ")


def _canary_cli(url: str, tmp_path: Path) -> tuple[Cli, Path]:
    folder = tmp_path / "canary"
    folder.mkdir()
    (folder / "dataflow.yaml").write_text(CANARY_DEFINITION)
    cli = make_cli(url, tmp_path)
    return Cli(cli.db_url, cli.cwd, {**cli.env, "CANARY_DSN": CANARY_DSN}), folder / "dataflow.yaml"


def _all_outputs(cli: Cli, definition: Path) -> list[CliResult]:
    failed_run = cli("run", str(definition), "--json")
    assert failed_run.code == 1, failed_run.output
    assert failed_run.json()["status"] == "failed"
    assert "CANARY_DSN" in failed_run.json()["error_message"]  # the secret's NAME is fine to show
    run_id = failed_run.json()["run_id"]
    return [
        failed_run,
        cli("run", str(definition)),
        cli("run", str(definition), debug=True),
        cli("run", str(definition), "--json", debug=True),
        cli("runs"),
        cli("runs", "--json"),
        cli("show", run_id),
        cli("show", run_id, "--json", debug=True),
        cli("verify", run_id, debug=True),
        cli("definitions", "show", "canary_crm", "--json"),
        cli("result", run_id, debug=True),  # no result stored: a not_found error
    ]


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_canary_secret_never_shown_or_stored(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A postgres source whose DSN secret holds a canary password fails to connect; the canary appears in no
    stdout/stderr (also with --debug) and nowhere in the platform database (SQLite file bytes, or every
    PostgreSQL table's rows)."""
    url: str = request.getfixturevalue("sqlite_url" if engine == "sqlite" else "pg_url")
    cli, definition = _canary_cli(url, tmp_path)
    outputs = _all_outputs(cli, definition)
    assert outputs[-1].code == 4  # proves the debug path ran to an error, which must also be clean
    for result in outputs:
        assert CANARY not in result.output
    if engine == "sqlite":
        files = list(tmp_path.glob("dataflow.db*"))
        assert files
        for file in files:
            assert CANARY.encode() not in file.read_bytes(), file
        return
    database = Database(url)
    try:
        with database.read() as conn:
            for metadata in migrations.all_metadata():
                for table in metadata.sorted_tables:
                    rows = conn.execute(sa.select(table)).all()
                    assert CANARY not in repr(rows), table.name
    finally:
        database.dispose()
