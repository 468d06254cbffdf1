"""``dataflow partitions DATASOURCE``: one line per partition value of a tenant's partitioned datasource
(docs/cli.md, docs/operations.md "Partition status").

Each line shows the partition's current publication (run, key, definition hash, output digest, rows,
published at) and the runs of it that are queued, running, unresolved or failed after it; the days of a
date range that have no run are listed missing. It reads ``dataflow.protocol.partitions``, as the API and the
page do. Whoever holds the database URL is the platform operator, so the command needs no token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common
from durable_dataflow.core.names import check_tenant
from durable_dataflow.core.text import printable

if TYPE_CHECKING:
    from durable_dataflow.dataflow.protocol.partitions import PartitionStatus

# The characters of a definition hash or output digest shown in the table (the JSON form has them whole).
DIGEST_CHARS_SHOWN = 12
_STATE_STYLE = {"published": "green", "missing": "red", "queued": "cyan", "running": "cyan",
                "unresolved": "bold yellow", "failed": "red"}  # fmt: skip


def partitions_command(
    ctx: typer.Context,
    datasource: Annotated[str, typer.Argument(help="The datasource name, as the targets give it.")],
    first: Annotated[
        str | None, typer.Option("--from", metavar="VALUE", help="The first partition value (in the column's type).")
    ] = None,
    last: Annotated[
        str | None, typer.Option("--to", metavar="VALUE", help="The last partition value (included).")
    ] = None,
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant whose partitions (local runs: default).")] = (
        "default"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the partitions as JSON.")] = False,
) -> None:
    """One line per partition value: its current publication and the runs after it (queued, running,
    unresolved, failed); a date range's days without a run are missing. Exit 3 when a run is unresolved,
    4 when the tenant has no partitioned run of the datasource."""
    from durable_dataflow.dataflow.protocol import partitions

    whose = check_tenant(tenant)
    with common.open_platform(ctx) as platform, platform.db.read() as conn:
        found = partitions.status(conn, platform.db, whose, datasource, first, last)
    unresolved = [p.view for part in found.partitions for p in part.pending if p.view.unresolved]
    if as_json:
        common.emit_json(found.as_json())
    else:
        console = common.stdout_console()
        console.print(_table(found.partitions))
        published = sum(1 for p in found.partitions if p.current is not None)
        console.print(f"{len(found.partitions)} partition(s): {published} published, "
                      f"{len(found.partitions) - published} missing, {len(unresolved)} unresolved run(s)")  # fmt: skip
        for view in unresolved:
            common.print_warning_block(console, view, ctx)
    if unresolved:
        raise typer.Exit(common.EXIT_UNRESOLVED)


def _table(items: tuple[PartitionStatus, ...]) -> Table:
    table = Table("PARTITION", "STATE", "RUN", "KEY", "DEFINITION", "OUTPUT DIGEST", "ROWS", "PUBLISHED AT", "AFTER")
    for part in items:
        current = part.current
        after = Text()
        for number, pending in enumerate(part.pending):
            after.append(", " if number else "")
            after.append(f"{pending.state} {common.short_id(pending.view.run.run_id)}", _STATE_STYLE[pending.state])
        if current is None:
            cells = ["-"] * 6
        else:
            run = current.run
            cells = [common.short_id(run.run_id), printable(run.idempotency_key, multiline=False),
                     _short(run.definition_hash), _short(run.output_digest), str(run.row_count),
                     common.time_text(run.updated_at_us)]  # fmt: skip
        state = Text(str(part.state), style=_STATE_STYLE[part.state])
        table.add_row(Text(printable(part.label, multiline=False)), state, *(Text(c) for c in cells), after)
    return table


def _short(digest: str | None) -> str:
    return digest.removeprefix("sha256:")[:DIGEST_CHARS_SHOWN] if digest else "-"


def register(app: typer.Typer) -> None:
    app.command("partitions")(partitions_command)
