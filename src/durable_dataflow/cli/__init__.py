"""The ``dataflow`` command line (Typer + Rich): a thin shell over the platform services.

Global options come before the command: ``--db URL`` (else DATAFLOW_DB, else the embedded
default), ``--debug`` (tracebacks) and ``--lease-ttl SECONDS`` (else DATAFLOW_LEASE_TTL); ``--api URL``
(else DATAFLOW_API_URL) with ``--token-file PATH`` (else DATAFLOW_TOKEN) makes the commands of
``remote.REMOTE_COMMANDS`` talk to the HTTP API instead of the database (``cli.remote``).
Command groups live in modules with ``register(app)``. Modules owned by other parts (workers,
server) plug in the same way when they are installed; see ``PLUGIN_MODULES``. Reference:
docs/cli.md.

Start-up is almost all importing, so a command imports only what it uses (issue 15): ``main``
imports the one core command module that provides the command named (``CORE_MODULES``), and every
module (the plugins too, after the core ones) only when the command line names a command no core
module provides, or none (``--help``); ``common`` and ``db`` (``version``) import no database
library. ``app`` itself (``from durable_dataflow.cli import app``, as tests use it) always
carries every command.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

import typer

from durable_dataflow.cli import common, metavars, remote, summaries
from durable_dataflow.core.errors import DataflowError, InputError

metavars.install()  # plain FILE / RUN / N in every help, no Python types

_app = typer.Typer(
    name="dataflow",
    help="Durable Dataflow: data pipelines with recovery you can prove.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# The core command modules, in the order the help lists them, and the commands and groups each one
# registers (tests/integration/test_cli_imports.py checks this against what they register).
CORE_MODULES: Mapping[str, tuple[str, ...]] = {
    "durable_dataflow.cli.runs": ("run", "runs", "reconcile", "cancel"),
    "durable_dataflow.cli.show": ("show", "verify", "result"),
    "durable_dataflow.cli.definitions": ("definitions", "schema", "validate"),
    "durable_dataflow.cli.db": ("db", "version"),
}
_MODULE_OF = {command: module for module, commands in CORE_MODULES.items() for command in commands}
# Command modules written by other parts; each exposes register(app). Absent ones are skipped.
PLUGIN_MODULES = (
    "durable_dataflow.cli.worker_cmd",
    "durable_dataflow.cli.server_cmd",
    "durable_dataflow.cli.schedules_cmd",
    "durable_dataflow.cli.datasources_cmd",
    "durable_dataflow.cli.partitions_cmd",
    "durable_dataflow.cli.workers_cmd",
    "durable_dataflow.cli.lineage_cmd",
)


# The global options of ``_global_options`` that take a value, and its flags: ``_command_name`` skips
# them to find the command. An option missing here makes the command unknown, which only costs time
# (every plugin is imported), never a different answer.
_GLOBAL_VALUE_OPTIONS = ("--db", "--lease-ttl", "--api", "--token-file")
_GLOBAL_FLAGS = ("--debug",)
# Command lines that ask only for the top-level help: answered from ``summaries`` alone.
TOP_LEVEL_HELP: tuple[list[str], ...] = ([], ["--help"])


@_app.callback()
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
    api_url: Annotated[
        str | None,
        typer.Option(
            "--api", metavar="URL", help="Talk to this HTTP API instead of the database (else $DATAFLOW_API_URL)."
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file", metavar="PATH", help="With --api: the file holding the token (else $DATAFLOW_TOKEN)."
        ),
    ] = None,
) -> None:
    state = common.state_of(ctx)
    state.debug = debug  # first: --debug applies to the refusals below as well
    if db_url is not None and not db_url.strip():  # an empty --db silently meant the embedded default
        raise InputError("--db must not be empty: give a database URL, or leave --db out for the default")
    state.db_url = db_url
    state.lease_ttl_s = lease_ttl_s
    _remote_options(ctx, state, api_url, token_file)


def _remote_options(ctx: typer.Context, state: common.CliState, given_url: str | None, token_file: Path | None) -> None:
    """Under ``--api`` (or $DATAFLOW_API_URL): the API and its token, for a command that can use them."""
    api_url = remote.api_url_of(given_url)
    if api_url is None:
        if token_file is not None:
            raise InputError("--token-file applies only with --api URL (or $DATAFLOW_API_URL)")
        return
    if state.db_url is not None:
        raise InputError("--api and --db cannot be combined: a command talks either to the API or to the database")
    command = ctx.invoked_subcommand
    if command not in remote.REMOTE_COMMANDS:
        raise InputError(
            f"dataflow {command} is not available over --api (these are: {', '.join(remote.REMOTE_COMMANDS)}); "
            "run it where the database URL is"
        )
    state.remote = remote.Remote(api_url, remote.read_token(token_file))


_registered: list[str] = []  # the modules whose commands _app carries, in registration order
_ALL_MODULES = (*CORE_MODULES, *PLUGIN_MODULES)


def _register(name: str) -> None:
    """Import one command module and register its commands, once; an absent plugin is skipped."""
    if name in _registered:
        return
    _registered.append(name)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if name in CORE_MODULES or error.name != name:  # a core module, or one of a plugin's imports
            raise
        return
    module.register(_app)


def _register_all() -> None:
    """Every command module, core first, in the listed order (the help lists them so), each command and
    group with its one-line summary (``summaries``)."""
    if _registered == list(_ALL_MODULES):
        return
    _app.registered_commands.clear()
    _app.registered_groups.clear()
    _registered.clear()
    for name in _ALL_MODULES:
        _register(name)
    for command in _app.registered_commands:
        command.short_help = summaries.COMMANDS.get(command.name or "", command.short_help)
    for group in _app.registered_groups:
        group.short_help = summaries.GROUPS.get(group.name or "", group.short_help)


def _register_summaries() -> None:
    """Placeholders carrying only each command's name and summary: enough for the top-level help, which
    then imports no command module (start-up under 0.3 s)."""
    _app.registered_commands.clear()
    _app.registered_groups.clear()
    _registered.clear()
    for name, summary in (*summaries.COMMANDS.items(), *summaries.GROUPS.items()):
        _app.command(name, short_help=summary)(_placeholder)


def _placeholder() -> None:  # never invoked: the fast path only prints the help
    raise InputError("internal: a help placeholder was invoked")  # pragma: no cover


def __getattr__(name: str) -> typer.Typer:
    # ``app`` is the whole command line, plugins included; ``main`` may run with the core alone.
    if name == "app":
        _register_all()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _command_name(args: Sequence[str]) -> str | None:
    """The command the arguments name after the global options, or None (none named, ``--help``,
    an option this does not know)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _GLOBAL_FLAGS:
            i += 1
        elif arg in _GLOBAL_VALUE_OPTIONS:
            i += 2
        elif arg.startswith(tuple(f"{option}=" for option in _GLOBAL_VALUE_OPTIONS)):
            i += 1
        else:
            return None if arg.startswith("-") else arg
    return None


def main(argv: list[str] | None = None) -> int:
    """The console script: run the app and turn every outcome into an exit status."""
    args = sys.argv[1:] if argv is None else argv
    module = _MODULE_OF.get(_command_name(args) or "")
    if list(args) in TOP_LEVEL_HELP:
        _register_summaries()
    elif module is None:
        _register_all()
    else:
        _register(module)
    state = common.CliState()
    try:
        result = _app(args=argv, prog_name="dataflow", standalone_mode=False, obj=state)
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
