"""The ``dataflow`` command line (Typer + Rich): a thin shell over the platform services.

Global options come before the command: ``--db URL`` (else DATAFLOW_DB, else the embedded
default), ``--debug`` (tracebacks) and ``--lease-ttl SECONDS`` (else DATAFLOW_LEASE_TTL).
Command groups live in modules with ``register(app)``. Modules owned by other parts (workers,
server) plug in the same way when they are installed; see ``PLUGIN_MODULES``. Reference:
docs/cli.md.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated

import typer

from durable_dataflow.cli import common, db, definitions, runs, show
from durable_dataflow.core.errors import DataflowError

app = typer.Typer(
    name="dataflow",
    help="Durable Dataflow: data pipelines with recovery you can prove.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Command modules written by other parts; each exposes register(app). Absent ones are skipped.
PLUGIN_MODULES = (
    "durable_dataflow.cli.worker_cmd",
    "durable_dataflow.cli.server_cmd",
)


@app.callback()
def _global_options(
    ctx: typer.Context,
    db_url: Annotated[
        str | None,
        typer.Option("--db", metavar="URL", help="Database URL (else $DATAFLOW_DB, else the embedded default)."),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    lease_ttl_s: Annotated[
        float | None,
        typer.Option("--lease-ttl", metavar="SECONDS", help="Lease TTL (else $DATAFLOW_LEASE_TTL, else 30)."),
    ] = None,
) -> None:
    state = common.state_of(ctx)
    state.db_url = db_url
    state.debug = debug
    state.lease_ttl_s = lease_ttl_s


def _register_all() -> None:
    for module in (runs, show, definitions, db):
        module.register(app)
    for name in PLUGIN_MODULES:
        try:
            plugin = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:  # the plugin exists but one of ITS imports is missing: a real error
                raise
            continue
        plugin.register(app)


_register_all()


def main(argv: list[str] | None = None) -> int:
    """The console script: run the app and turn every outcome into an exit status."""
    state = common.CliState()
    try:
        result = app(args=argv, prog_name="dataflow", standalone_mode=False, obj=state)
    except typer.Exit as error:
        return int(error.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("interrupted\n")
        return common.EXIT_INTERRUPTED
    except BrokenPipeError:
        return common.EXIT_OK  # the reader went away (e.g. `| head`); nothing left to say
    except Exception as error:
        if _is_usage_error(error):
            error.show()  # type: ignore[attr-defined]  # click's usage message, e.g. "No such option"
            return int(error.exit_code)  # type: ignore[attr-defined]
        return common.report_error(error, state.debug)
    return result if isinstance(result, int) else common.EXIT_OK


def _is_usage_error(error: Exception) -> bool:
    # Typer raises click's ClickException family (vendored in newer Typer releases, so matched by
    # shape rather than class): it knows how to show itself and carries its exit status (2).
    return (
        not isinstance(error, DataflowError)
        and callable(getattr(error, "show", None))
        and isinstance(getattr(error, "exit_code", None), int)
    )
