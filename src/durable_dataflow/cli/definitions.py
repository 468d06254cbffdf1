"""``dataflow definitions list|show`` and ``dataflow schema``: the pinned definitions and their format.

A stored body is a submitter's document: ``show`` passes it through ``printable`` before Rich's JSON
highlighting, so its SQL's control or bidirectional characters are shown as escapes.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.highlighter import JSONHighlighter
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common
from durable_dataflow.core.text import printable

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


def register(app: typer.Typer) -> None:
    app.add_typer(definitions_app, name="definitions")
    app.command("schema")(schema_command)
