"""Every command's --help shows plain metavars (FILE, RUN, N, NAME=VALUE), never a Python type (issue 30)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import typer.main
from typer.testing import CliRunner

from durable_dataflow.cli import app

# What Typer printed before: `<bool>`, `<str>`, `<list[str]>`, `<path>`… in the type column.
PYTHON_TYPE = re.compile(r"<(bool|str|int|float|path|file|datetime|list\[[^\]]*\])>")
WIDE_ENV = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}


def _command_paths() -> Iterator[tuple[str, ...]]:
    root = typer.main.get_command(app)
    stack: list[tuple[tuple[str, ...], object]] = [((), root)]
    while stack:
        path, command = stack.pop()
        yield path
        for name, child in getattr(command, "commands", {}).items():
            stack.append(((*path, name), child))


def _help(*path: str) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env=WIDE_ENV)
    assert result.exit_code == 0, result.output
    return result.output


def test_no_help_shows_a_python_type_or_a_braced_argument() -> None:
    """Walks the whole command tree and reads each --help: no `<bool>`-style type, and the usage line
    writes arguments as Click does (FILE, [FILE]), never `{file}`."""
    paths = list(_command_paths())
    assert ("run",) in paths and ("tokens", "create") in paths  # the walk reaches groups and plugins
    for path in paths:
        text = _help(*path)
        assert not PYTHON_TYPE.search(text), (path, PYTHON_TYPE.search(text))
        [usage] = [line for line in text.splitlines() if "Usage:" in line]
        assert "{" not in usage, (path, usage)


def test_arguments_flags_and_values_read_plainly() -> None:
    """`run --help`: the argument is FILE in the usage and its row, --param takes NAME=VALUE, a count N,
    and the --json flag shows no metavar at all."""
    text = _help("run")
    assert "Usage: dataflow run [OPTIONS] FILE" in text
    assert re.search(r"--param\s+-p\s+NAME=VALUE\s", text)
    assert re.search(r"--max-attempts\s+N\s", text)
    assert re.search(r"--json\s+Print the run as JSON", text)
    assert "Usage: dataflow show [OPTIONS] RUN" in _help("show")
