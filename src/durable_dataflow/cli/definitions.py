"""``dataflow definitions list|show``, ``dataflow schema`` and ``dataflow validate``: the pinned
definitions, their format, and a check of a definition file that reads no data and records nothing.

A stored body is a submitter's document: ``show`` passes it through ``printable`` before Rich's JSON
highlighting, so its SQL's control or bidirectional characters are shown as escapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.highlighter import JSONHighlighter
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common, options
from durable_dataflow.core.text import printable

if TYPE_CHECKING:
    from durable_dataflow.dataflow.execution.validate import Report

# The catalogue and the definition models (pydantic, PyYAML, pyarrow) are imported by the commands
# that use them, so that registering these commands costs every other command nothing.

definitions_app = typer.Typer(help="Stored (pinned, content-addressed) definitions.", no_args_is_help=True)


@definitions_app.command("list")
def list_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the definitions as a JSON list.")] = False,
) -> None:
    """Every stored definition: name, version, hash and when it was first registered."""
    from durable_dataflow.dataflow.definitions import catalog

    with common.open_platform(ctx) as platform, platform.db.read() as conn:
        stored = catalog.list_definitions(conn)
    if as_json:
        common.emit_json([{k: v for k, v in d.public().items() if k != "body"} for d in stored])
        return
    console = common.stdout_console()
    if not stored:
        console.print("no definitions stored yet (they are registered by their first run)")
        return
    table = Table()
    for column in ("name", "version", "definition hash", "registered"):
        table.add_column(column, no_wrap=True)
    for d in stored:
        registered = common.time_text(d.registered_at_us)
        table.add_row(Text(printable(d.name)), Text(str(d.version)), Text(d.definition_hash), Text(registered))
    console.print(table)


@definitions_app.command("show")
def show_command(
    ctx: typer.Context,
    name_or_hash: Annotated[str, typer.Argument(metavar="NAME_OR_HASH", help="A name (newest version) or sha256:…")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the stored definition as JSON.")] = False,
) -> None:
    """One stored definition's canonical body, exactly as runs of it execute."""
    from durable_dataflow.dataflow.definitions import catalog

    with common.open_platform(ctx) as platform, platform.db.read() as conn:
        stored = catalog.get_definition(conn, name_or_hash)
    if as_json:
        common.emit_json(stored.public())
        return
    console = common.stdout_console()
    console.print(Text(printable(f"{stored.name} version {stored.version}"), style="bold"))
    console.print(Text(f"hash: {stored.definition_hash}"))
    console.print(Text(f"registered: {common.time_text(stored.registered_at_us)}"))
    body = Text(printable(json.dumps(stored.body, indent=2, ensure_ascii=False)), no_wrap=True)
    console.print(JSONHighlighter()(body))


def schema_command() -> None:
    """Print the JSON Schema of a definition document."""
    from durable_dataflow.dataflow.definitions.definitions import json_schema

    common.emit_json(json_schema())


@common.with_limit_options
def validate_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The definition file (YAML or JSON).")],
    param: options.Params = None,
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant a run would belong to.")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check a definition without reading its data or recording anything; exit 0 when valid, 2 when not.

    Parses it, checks the parameters, reads only the sources' schemas, binds every step over empty
    tables of them, checks the output's columns and types and runs the target's preflight."""
    from durable_dataflow.cli.runs import build_request
    from durable_dataflow.dataflow.definitions.definitions import load_definition
    from durable_dataflow.dataflow.execution import workspace
    from durable_dataflow.dataflow.protocol.validation import validate_definition

    loaded = load_definition(file)
    request = build_request(loaded, param, None, tenant, 1)
    with common.open_platform(ctx) as platform:
        space = workspace.local(request.base_dir)
        report = validate_definition(platform.runs, loaded.definition, request.parameters, space, request.access)
    if as_json:
        common.emit_json(report.as_json())
    else:
        _print_report(report)
    if not report.valid:
        raise typer.Exit(common.EXIT_CODES["invalid_input"])


def _print_report(report: Report) -> None:
    console = common.stdout_console()
    head = f"{report.name} version {report.version} (engine {report.engine})"
    if report.valid:
        console.print(Text(printable(f"valid: {head}"), style="bold green"))
    else:
        console.print(Text(printable(f"invalid: {head}: {len(report.problems)} problem(s)"), style="bold red"))
    for problem in report.problems:
        # What the problem concerns, unless its message already names it.
        named = [f"{k} {v!r}" for k, v in problem.as_json().items() if k != "message" and v is not None]
        where = ", ".join(n for n in named if n not in problem.message)
        console.print(Text(printable(f"  - {where + ': ' if where else ''}{problem.message}")))
    for note in report.notes:
        console.print(Text(printable(f"  note: {note}"), style="yellow"))
    if report.result_columns:
        columns = ", ".join(f"{name} {type_name}" for name, type_name in report.result_columns)
        console.print(Text(printable(f"  result columns: {columns}")))


def register(app: typer.Typer) -> None:
    app.add_typer(definitions_app, name="definitions")
    app.command("schema")(schema_command)
    app.command("validate")(validate_command)
