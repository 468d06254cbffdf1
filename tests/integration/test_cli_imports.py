"""What the read-only commands import (issue 15, item 5): a CLI that answers at once.

Start-up is almost all importing, so `dataflow runs`, `show`, `verify` and `version` must not load
the engine (DuckDB), the server (FastAPI, Uvicorn, Jinja2), the migrations (Alembic, when the schema
is current), the providers (deltalake, psycopg) or the query rewriter (sqlglot). Each command runs in
a fresh interpreter, through ``durable_dataflow.cli.main`` as the console script does, and the test
reads ``sys.modules`` when it has answered: a test of *what* is imported, never of how long it takes
(benchmarks/bench_cli_startup.py measures that). `version` opens no database, so it loads neither
the storage library (SQLAlchemy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "revenue_by_region" / "dataflow.yaml"
# Top-level packages no read-only command may import.
# pandas too: pyarrow loads it (where installed) on its first Python-value conversion.
FORBIDDEN = ("duckdb", "fastapi", "uvicorn", "starlette", "jinja2", "alembic", "deltalake", "psycopg", "sqlglot",
             "pandas", "openlineage")
# Also left out of `runs`, `show` and `version`: only verifying stored result bytes needs pyarrow.
FORBIDDEN_WITHOUT_RESULT_BYTES = ("pyarrow", "yaml", "structlog")
# Also left out of `version`, which reads no database (pydantic is not: Typer itself imports it).
FORBIDDEN_WITHOUT_DATABASE = (*FORBIDDEN_WITHOUT_RESULT_BYTES, "sqlalchemy")
# Runs the CLI in-process and prints the imported top-level packages; the command's own output is
# dropped (stdout is not the JSON line the test parses).
PROBE = """
import io, json, sys
from contextlib import redirect_stdout
from durable_dataflow.cli import main
with redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted({name.split(".")[0] for name in sys.modules})}))
"""


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def _imported(*args: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], env=_environment(), cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["code"] == 0, (args, done.stderr)
    return set(found["modules"])


@pytest.fixture(scope="module")
def platform_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A SQLite platform database at the current schema with one succeeded run: (URL, run id)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('cli-imports') / 'platform.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "durable_dataflow.cli", "--db", url, "run", str(EXAMPLE), "--param", "day=2026-11-02",
         "--json"],
        env=_environment(), cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return url, json.loads(done.stdout)["run_id"]


@pytest.mark.parametrize(
    ("command", "also_forbidden"),
    [
        (("runs", "--limit", "1"), FORBIDDEN_WITHOUT_RESULT_BYTES),
        (("runs", "--json"), FORBIDDEN_WITHOUT_RESULT_BYTES),
        (("show", "RUN"), FORBIDDEN_WITHOUT_RESULT_BYTES),
        (("show", "RUN", "--json"), FORBIDDEN_WITHOUT_RESULT_BYTES),
        (("verify", "RUN"), ()),
        (("version",), FORBIDDEN_WITHOUT_DATABASE),
    ],
    ids=["runs", "runs-json", "show", "show-json", "verify", "version"],
)
def test_read_only_commands_import_no_engine_server_migrations_or_providers(
    platform_db: tuple[str, str], command: tuple[str, ...], also_forbidden: tuple[str, ...]
) -> None:
    url, run_id = platform_db
    imported = _imported("--db", url, *(run_id if arg == "RUN" else arg for arg in command))
    assert "typer" in imported  # the probe saw the command line's imports
    assert ("sqlalchemy" in imported) == (command[0] != "version")  # and the platform's, where it reads
    leaked = sorted(imported.intersection(FORBIDDEN + also_forbidden))
    assert leaked == [], f"`dataflow {' '.join(command)}` imported {leaked}"


def test_the_probe_sees_heavy_imports(platform_db: tuple[str, str]) -> None:
    """The check can fail: `schema` builds the definition models (pyarrow, PyYAML) and `run` loads
    the engine, and the same probe reports them."""
    url, _ = platform_db
    assert {"pyarrow", "yaml", "pydantic"} <= _imported("--db", url, "schema")
    assert "duckdb" in _imported("--db", url, "run", str(EXAMPLE), "--param", "day=2026-11-02")


def test_importing_the_cli_registers_every_command() -> None:
    """``from durable_dataflow.cli import app`` (tests, scripts) gets the plugins' commands too;
    only ``main`` leaves them out when the command line names a core command."""
    probe = (
        "import sys, typer.main\n"
        "from durable_dataflow.cli import app\n"
        "names = set(typer.main.get_command(app).commands)\n"
        "print(sorted(names))\n"
        "assert {'runs', 'show', 'verify', 'version', 'worker', 'submit', 'serve'} <= names, names\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=_environment(), cwd=ROOT, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_core_module_table_names_what_each_module_registers() -> None:
    """``main`` imports a core module by the command named (``CORE_MODULES``): the table must list
    exactly the commands and groups each module registers, or a command would be imported in vain."""
    import importlib

    import typer

    from durable_dataflow import cli

    for name, commands in cli.CORE_MODULES.items():
        app = typer.Typer()
        importlib.import_module(name).register(app)
        registered = [info.name for info in app.registered_commands] + [info.name for info in app.registered_groups]
        assert sorted(registered) == sorted(commands), name  # type: ignore[type-var]


def test_the_help_lists_every_command_in_one_order_after_main_ran_one() -> None:
    """``main`` registers only the module of the command it runs; ``app`` afterwards (in the same
    process) still lists every command, core first, in the listed order."""
    probe = (
        "import io, contextlib, typer.main\n"
        "import durable_dataflow.cli as cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert cli.main(['version']) == 0\n"
        "print(list(typer.main.get_command(cli.app).commands))\n"
    )
    fresh = (
        "import typer.main\nfrom durable_dataflow.cli import app\n"
        "print(list(typer.main.get_command(app).commands))\n"
    )
    listed = []
    for code in (probe, fresh):
        done = subprocess.run(
            [sys.executable, "-c", code], env=_environment(), cwd=ROOT, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        listed.append(done.stdout.strip())
    assert listed[0] == listed[1]
    assert listed[0].startswith("['run', 'runs'"), listed[0]


def test_the_top_level_help_comes_from_the_summaries_alone_and_equals_the_full_help() -> None:
    """`dataflow --help` (and `dataflow` alone) is answered from ``cli.summaries`` without importing any command
    module (no SQLAlchemy, pyarrow or HTTP client: start-up under 0.3 s), and prints exactly what the fully registered
    app prints; every command and group has a summary and every summary names one, so a new command
    without a summary fails here."""
    fast = (
        "import io, contextlib, json, sys\nimport durable_dataflow.cli as cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n    code = cli.main(['--help'])\n"
        "print(json.dumps({'code': code, 'help': out.getvalue(), 'modules': sorted(sys.modules)}))\n"
    )
    full = (
        "import io, contextlib, json, typer.main\nfrom durable_dataflow.cli import app, summaries\n"
        "out = io.StringIO()\ncommand = typer.main.get_command(app)\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n        app(args=['--help'], prog_name='dataflow', standalone_mode=False)\n"
        "    except SystemExit:\n        pass\n"
        "print(json.dumps({'help': out.getvalue(), 'commands': list(command.commands),"
        " 'summarized': [*summaries.COMMANDS, *summaries.GROUPS]}))\n"
    )
    env = {**_environment(), "COLUMNS": "110", "TERM": "dumb"}
    answers = []
    for code in (fast, full):
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        answers.append(json.loads(done.stdout.splitlines()[-1]))
    quick, whole = answers
    assert quick["code"] == 0
    assert sorted(whole["commands"]) == sorted(whole["summarized"]), "a command without a summary, or the reverse"
    assert quick["help"] == whole["help"] and "datasources" in quick["help"]
    from durable_dataflow import cli

    command_modules = {*cli.CORE_MODULES, *cli.PLUGIN_MODULES}
    heavy = [m for m in quick["modules"] if m.split(".")[0] in ("sqlalchemy", "pyarrow", "duckdb", "yaml")
             or m in command_modules or m in ("urllib.request", "http.client")]  # fmt: skip
    assert heavy == [], heavy
