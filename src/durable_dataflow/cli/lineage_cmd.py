"""``dataflow lineage status|flush``: the lineage outbox's backlog, and its delivery to the OpenLineage receiver
(docs/lineage.md).

Both read the platform database directly (they are the platform operator's, as ``workers`` is), so neither
runs under ``--api``. ``openlineage-python`` (the ``lineage`` extra) is imported only by ``flush``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from durable_dataflow.cli import common
from durable_dataflow.core.errors import InputError
from durable_dataflow.lineage import settings

# `flush` exits with this when events remain pending (the receiver failed): run it again later.
EXIT_PENDING = 3
NOT_CONFIGURED = (
    "lineage is not configured: set OPENLINEAGE_URL, OPENLINEAGE__TRANSPORT__* or an openlineage.yml "
    "(docs/lineage.md)"
)

lineage_app = typer.Typer(help="The lineage outbox: its backlog, and its delivery as OpenLineage events.",
                          no_args_is_help=True)  # fmt: skip


def _refuse_remote(ctx: typer.Context) -> None:
    if common.state_of(ctx).remote is not None:
        raise InputError("dataflow lineage reads the platform database: give --db, not --api")


@lineage_app.command("status")
def status_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as one JSON document.")] = False,
) -> None:
    """Whether lineage is configured, and how many ledger entries wait for delivery."""
    from durable_dataflow.core import ledger

    _refuse_remote(ctx)
    with common.open_platform(ctx) as platform, platform.db.read() as conn:
        pending = ledger.outbox_count(conn)
        configured = platform.lineage_configured
    document = {"configured": configured, "pending": pending, "namespace": settings.namespace()}
    if as_json:
        common.emit_json(document)
        return
    state = "configured" if configured else "not configured"
    typer.echo(f"lineage {state} (namespace {document['namespace']}): {pending} entr(ies) pending delivery")


@lineage_app.command("flush")
def flush_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as one JSON document.")] = False,
) -> None:
    """Deliver pending events until none is left (exit 0) or the receiver fails (exit 3: some remain)."""
    _refuse_remote(ctx)
    if not settings.configured():
        raise InputError(NOT_CONFIGURED)
    try:
        from openlineage.client import OpenLineageClient

        from durable_dataflow.lineage import delivery
    except ImportError as error:
        from durable_dataflow.datasources.contract import MissingCapability

        raise MissingCapability(
            "lineage needs openlineage-python: pip install 'durable-dataflow[lineage]'"
        ) from error
    from durable_dataflow.cli import worker_cmd

    worker_cmd.configure_logging()  # lineage.undelivered as a JSON line on stderr: stdout is the outcome
    with common.open_platform(ctx) as platform:
        client = OpenLineageClient()
        try:
            outcome = delivery.flush(platform.db, client, namespace=settings.namespace())
        finally:
            client.close()
        pending = delivery.pending_count(platform.db)
    document = {
        "delivered": outcome.delivered, "skipped": outcome.skipped, "failed": outcome.failed,
        "error_type": outcome.error_type, "pending": pending,
    }  # fmt: skip
    if as_json:
        common.emit_json(document)
    else:
        failure = f"; the receiver failed ({outcome.error_type})" if outcome.failed else ""
        typer.echo(f"delivered {outcome.delivered} event(s), {outcome.skipped} entr(ies) without an event, "
                   f"{pending} pending{failure}")  # fmt: skip
    if pending:
        raise typer.Exit(EXIT_PENDING)


def register(app: typer.Typer) -> None:
    app.add_typer(lineage_app, name="lineage")
