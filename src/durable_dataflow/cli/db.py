"""``dataflow db upgrade|current|recount`` and ``dataflow version``.

``version`` answers without the database or its libraries: the migrations and the storage engine are
imported by the ``db`` commands that use them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.text import Text

from durable_dataflow import __version__
from durable_dataflow.cli import common
from durable_dataflow.core.errors import InputError

if TYPE_CHECKING:
    from durable_dataflow.core.db import Database

db_app = typer.Typer(help="The platform database's schema migrations.", no_args_is_help=True)


def _database(ctx: typer.Context) -> Database:
    from durable_dataflow.core.db import Database

    # A bare Database, not a Platform: opening a Platform migrates, and `db current` must not.
    return Database(common.state_of(ctx).db_url)


@db_app.command("upgrade")
def upgrade_command(ctx: typer.Context) -> None:
    """Apply every pending migration (safe to run from several processes at once)."""
    from durable_dataflow import migrations

    database = _database(ctx)
    try:
        with common.spinner("migrating"):
            migrations.upgrade(database)
        revision = migrations.current_revision(database)
    finally:
        database.dispose()
    common.stdout_console().print(Text(f"{database.info.url_redacted}: at revision {revision} (head)"))


@db_app.command("current")
def current_command(ctx: typer.Context) -> None:
    """The database's schema revision and the newest one this version knows; exit 1 when behind."""
    from durable_dataflow import migrations

    database = _database(ctx)
    try:
        current = migrations.current_revision(database)
    finally:
        database.dispose()
    head = migrations.head_revision()
    console = common.stdout_console()
    if current is not None and not migrations.is_known(current):
        raise InputError(migrations.newer_schema(current))
    if current == head:
        console.print(Text(f"{database.info.url_redacted}: at revision {current} (head)"))
        return
    console.print(
        Text(f"{database.info.url_redacted}: at revision {current or 'none'}, head is {head}: "
             "run `dataflow db upgrade`")
    )
    raise typer.Exit(common.EXIT_ERROR)


@db_app.command("recount")
def recount_command(ctx: typer.Context) -> None:
    """Count each tenant's stored result bytes again from the results themselves (the result_bytes
    quota's counter): after stored results were deleted by hand, or stored by a process older than
    migration 0017. Workers and servers may go on storing results meanwhile."""
    from durable_dataflow.dataflow.execution import results
    from durable_dataflow.dataflow.protocol import runs

    database = _database(ctx)
    try:
        with common.spinner("recounting"), database.begin() as conn:
            tenants = results.recount_stored(conn, runs.tenant_of)
    finally:
        database.dispose()
    common.stdout_console().print(
        Text(f"{database.info.url_redacted}: stored result bytes recounted for {tenants} tenant(s)")
    )


def version_command() -> None:
    """Print the installed version."""
    common.stdout_console().print(f"dataflow {__version__}")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.command("version")(version_command)
