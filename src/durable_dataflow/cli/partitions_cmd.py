"""``dataflow partitions DATASOURCE``: one line per partition value of a tenant's partitioned datasource
(docs/cli.md, docs/operations.md "Partition status").

Each line shows the partition's current publication (run, key, definition hash, output digest, rows,
published at) and the runs of it that are queued, running, unresolved or failed after it; the days of a
date range that have no run are listed missing. It reads ``dataflow.protocol.partitions``, as the API and the
page do. Whoever holds the database URL is the platform operator, so the command needs no token. Under
``--api`` it reads ``GET /v1/datasources/{name}/partitions`` for the token's tenant instead; both print the
same JSON (``DatasourceStatus.as_json``) with the one renderer here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common, remote
from durable_dataflow.core.names import check_tenant
from durable_dataflow.core.text import printable

if TYPE_CHECKING:
    from durable_dataflow.dataflow.protocol.views import RunView

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
    api = common.state_of(ctx).remote
    views: list[RunView] | None = None
    if api is not None:
        remote.refuse_options(ctx, "the token's tenant is read", "tenant")
        query = {name: value for name, value in (("from", first), ("to", last)) if value is not None}
        document = api.call("GET", f"/v1/datasources/{remote.quoted(datasource)}/partitions", query=query)
    else:
        from durable_dataflow.dataflow.protocol import partitions

        whose = check_tenant(tenant)
        with common.open_platform(ctx) as platform, platform.db.read() as conn:
            found = partitions.status(conn, platform.db, whose, datasource, first, last)
        document = found.as_json()
        views = [p.view for part in found.partitions for p in part.pending if p.view.unresolved]
    items: list[dict[str, Any]] = document["partitions"]
    unresolved = [p["run_id"] for part in items for p in part["after"] if p["unresolved"]]
    if as_json:
        common.emit_json(document)
    else:
        console = common.stdout_console()
        console.print(_table(items))
        published = sum(1 for p in items if p["current"] is not None)
        console.print(f"{len(items)} partition(s): {published} published, "
                      f"{len(items) - published} missing, {len(unresolved)} unresolved run(s)")  # fmt: skip
        if views is None and api is not None:  # the warning blocks need each run as the server shows it
            views = remote.run_views(api, unresolved)
        for view in views or []:
            common.print_warning_block(console, view, ctx)
    if unresolved:
        raise typer.Exit(common.EXIT_UNRESOLVED)


def _table(items: list[dict[str, Any]]) -> Table:
    """The partitions of ``DatasourceStatus.as_json``, read here or answered by the API."""
    from durable_dataflow.dataflow.protocol.partitions import PartitionStatus

    table = Table("PARTITION", "STATE", "RUN", "KEY", "DEFINITION", "OUTPUT DIGEST", "ROWS", "PUBLISHED AT", "AFTER")
    for part in items:
        current = part["current"]
        after = Text()
        for number, pending in enumerate(part["after"]):
            after.append(", " if number else "")
            after.append(f"{pending['state']} {common.short_id(pending['run_id'])}", _STATE_STYLE[pending["state"]])
        if current is None:
            cells = ["-"] * 6
        else:
            cells = [common.short_id(current["run_id"]), printable(current["idempotency_key"], multiline=False),
                     _short(current["definition_hash"]), _short(current["output_digest"]), str(current["row_count"]),
                     common.time_text(current["published_at_us"])]  # fmt: skip
        state = Text(part["state"], style=_STATE_STYLE[part["state"]])
        label = PartitionStatus(part["partition"], None, ()).label  # the one-text form of its values
        table.add_row(Text(printable(label, multiline=False)), state, *(Text(c) for c in cells), after)
    return table


def _short(digest: str | None) -> str:
    return digest.removeprefix("sha256:")[:DIGEST_CHARS_SHOWN] if digest else "-"


def register(app: typer.Typer) -> None:
    app.command("partitions")(partitions_command)
