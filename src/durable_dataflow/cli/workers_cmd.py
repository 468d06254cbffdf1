"""``dataflow workers``: one line per worker process and `dataflow serve` sweeper of the platform database,
alive, dead or stopped (docs/cli.md, docs/operations.md "Workers").

It reads ``dataflow.protocol.fleet``, as ``GET /v1/workers`` and the Ops page do. Whoever holds the database
URL is the platform operator, so the command needs no token; under ``--api`` it reads ``GET /v1/workers`` with
a platform_operator token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common, remote
from durable_dataflow.core.text import printable

if TYPE_CHECKING:
    from durable_dataflow.dataflow.protocol.fleet import WorkerView

_STATE_STYLE = {"alive": "green", "dead": "bold red", "stopped": "dim"}


def workers_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the workers as one JSON document.")] = False,
) -> None:
    """One line per worker and serve sweeper: alive, dead (no beat within its TTL, or on PostgreSQL its
    session gone) or stopped, with its host, pid, version, start, last beat and attempts in flight."""
    from durable_dataflow.dataflow.protocol import fleet

    api = common.state_of(ctx).remote
    if api is not None:  # GET /v1/workers: a platform_operator token (a tenant's is refused, exit 1)
        document = api.call("GET", "/v1/workers")
        try:
            found = [fleet.view_from_json(row) for row in document["workers"]]
        except (KeyError, TypeError, ValueError):
            raise remote.not_the_api() from None
    else:
        with common.open_platform(ctx) as platform:
            found = fleet.list_workers(platform.db)
        document = fleet.document(found)
    if as_json:
        common.emit_json(document)
        return
    console = common.stdout_console()
    console.print(_table(found))
    console.print(f"{len(found)} process(es): {document['alive']} alive, {document['dead']} dead, "
                  f"{document['stopped']} stopped")  # fmt: skip


def _table(found: list[WorkerView]) -> Table:
    table = Table("HOLDER", "ROLE", "STATE", "HOST", "PID", "VERSION", "STARTED", "LAST BEAT", "IN FLIGHT")
    for w in found:
        table.add_row(
            Text(printable(w.holder, multiline=False)), w.role, Text(str(w.state), style=_STATE_STYLE[str(w.state)]),
            Text(printable(w.host, multiline=False)), str(w.pid), Text(printable(w.version, multiline=False)),
            common.time_text(w.started_at_us), f"{w.last_beat_age_s:.1f} s ago", f"{w.inflight}/{w.concurrency}",
        )  # fmt: skip
    return table


def register(app: typer.Typer) -> None:
    app.command("workers")(workers_command)
