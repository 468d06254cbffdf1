"""What every command shares: global settings, the one error table, output helpers.

The CLI is a thin shell (DESIGN §2): it parses options, calls a service and prints. Errors map
to exit statuses in ONE table (``EXIT_CODES``); their messages go to stderr as
``error [code]: message`` and a traceback only with ``--debug``. Nothing resolved from
``core.secrets`` is ever printed: runs carry digests and references only, and error messages are
masked where they are raised. Everything shown to a person goes through ``core.text.printable``
(run values and error messages can hold a submitter's control characters); ``--json`` stays exact.

Every command imports this module, ``version`` included, so it imports no database library
(SQLAlchemy; pydantic comes with Typer anyway): the helpers that need the platform, the run model or
the read views import them when called (issue 15, a CLI that answers at once).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from durable_dataflow.core.errors import DataflowError, InputError
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.text import printable
from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.execution import limits

if TYPE_CHECKING:
    from rich.table import Table

    from durable_dataflow.cli.remote import Remote
    from durable_dataflow.dataflow.protocol.runs import Run
    from durable_dataflow.dataflow.protocol.views import RunView
    from durable_dataflow.platform import Platform

# Exit statuses of a run's outcome (``run``, ``reconcile``).
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_UNRESOLVED = 3
EXIT_NOT_FINISHED = 9  # a replay returned a run that is still queued or running
# The one error table: DataflowError.code -> exit status. Codes not listed exit EXIT_ERROR.
EXIT_ERROR = 1
EXIT_CODES: Mapping[str, int] = {
    "invalid_input": 2,
    "not_found": 4,
    "conflict": 5,
    "missing_capability": 6,
    "storage_unavailable": 7,
    "stale_attempt": 8,
    "quota_exceeded": 10,  # a tenant's quota refused the request; nothing was recorded (9: EXIT_NOT_FINISHED)
}
EXIT_INTERRUPTED = 130
# Rich wraps at 80 columns when stdout or stderr is not a terminal; run ids, digests and one-line
# messages read (and grep) better unwrapped: soft wrap, and this width for what must be laid out.
PIPE_WIDTH_COLUMNS = 200
# What a table may measure at when each of its rows must stay one line (`print_whole_rows`).
UNBOUNDED_WIDTH_COLUMNS = 100_000
PAYLOAD_CHARS_SHOWN_MAX = 100
RUN_ID_TAIL_CHARS = 12


@dataclass
class CliState:
    """Global options, filled by the root callback before any command runs.

    Mutable on purpose: ``main`` creates it empty and hands it to click as ``obj`` so that, when a
    command fails, ``main`` still knows whether ``--debug`` was given.
    """

    db_url: str | None = None
    debug: bool = False
    lease_ttl_s: float | None = None
    limits: limits.ExecutionLimits | None = None  # set by the limit options; None: DATAFLOW_* variables
    remote: Remote | None = None  # under --api: the API the command talks to instead of the database


def state_of(ctx: typer.Context) -> CliState:
    state = ctx.find_object(CliState)
    if state is None:  # commands invoked without main() (e.g. typer's test runner)
        state = ctx.ensure_object(CliState)
    return state


@contextlib.contextmanager
def open_platform(ctx: typer.Context) -> Iterator[Platform]:
    """The platform on the ``--db`` URL (else DATAFLOW_DB, else the embedded default), migrated."""
    from durable_dataflow.platform import Platform

    state = state_of(ctx)
    platform = Platform(state.db_url, lease_ttl_s=state.lease_ttl_s, limits=state.limits)
    try:
        yield platform
    finally:
        platform.close()


# ---- platform limits: one option set for `run`, `worker` and `serve` ------------------------------

P = ParamSpec("P")
R = TypeVar("R")
_LIMIT_METAVARS = {
    limits.SettingKind.DURATION: "SECONDS",
    limits.SettingKind.SIZE: "SIZE",
    limits.SettingKind.COUNT: "N",
    limits.SettingKind.DIRECTORY: "DIR",
}


def _limit_parameter(setting: limits.Setting) -> inspect.Parameter:
    value_type = Path if setting.kind is limits.SettingKind.DIRECTORY else str
    option = typer.Option(
        setting.option,
        metavar=_LIMIT_METAVARS[setting.kind],
        help=(
            f"{setting.meaning[:1].upper()}{setting.meaning[1:]}: {limits.KIND_FORMS[setting.kind]} "
            f"(else ${setting.variable}, else {setting.default_text})."
        ),
        rich_help_panel="Limits",
        show_default=False,
    )
    annotation = Annotated[value_type | None, option]  # type: ignore[valid-type]  # built from the table
    return inspect.Parameter(setting.field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


LIMIT_PARAMETERS = tuple(_limit_parameter(setting) for setting in limits.SETTINGS)


def _spark_parameter(name: str, flag: str, variable: str, meaning: str) -> inspect.Parameter:
    option = typer.Option(flag, metavar="URL", help=f"{meaning} (else ${variable}).", rich_help_panel="Spark engine",
                          show_default=False)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[str | None, option])


# The platform settings of the Spark engine (execution/engine.py): an option given sets its variable
# for this process, which is where the engine (and any worker thread) reads it.
SPARK_PARAMETERS = {
    "spark_master": (_spark_parameter("spark_master", "--spark-master", limits.SPARK_MASTER_ENV,
                                      "Spark master for engine: spark definitions: local[N], spark://host:7077, …"),
                     limits.SPARK_MASTER_ENV),
    "spark_remote": (_spark_parameter("spark_remote", "--spark-remote", limits.SPARK_REMOTE_ENV,
                                      "Spark Connect server, sc://host:15002 (wins over the master)"),
                     limits.SPARK_REMOTE_ENV),
}


_CONNECT_TOKEN = re.compile(r"(?i);\s*token\s*=")  # a Spark Connect URL's bearer-token parameter


def _apply_spark_options(given: dict[str, str | None]) -> None:
    for name, value in given.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "spark_remote" and _CONNECT_TOKEN.search(value):
            fail(f"{flag}: a token on the command line is visible to every user of the machine (ps); "
                 f"put the URL with its token in {limits.SPARK_REMOTE_ENV}, or the token in "
                 "SPARK_CONNECT_AUTHENTICATE_TOKEN")
        if not value.strip() or any(ch.isspace() or not ch.isprintable() for ch in value):
            fail(f"{flag} must be a URL without spaces or control characters")
        os.environ[SPARK_PARAMETERS[name][1]] = value


def with_limit_options(command: Callable[P, R]) -> Callable[P, R]:
    """Give a command that executes runs the platform-limit options (``limits.SETTINGS``).

    One option set, declared once, for every such command: the options are appended to the
    command's signature (Typer reads ``__signature__``), parsed together with the ``DATAFLOW_*``
    variables before the command body runs, and kept in ``CliState.limits`` for ``open_platform``.
    A bad value exits 2 naming its option or variable. The command must take ``ctx``.
    """
    signature = inspect.signature(command, eval_str=True)
    invariant("ctx" in signature.parameters, f"{command.__name__} takes ctx, where the limits are kept")

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        given = {parameter.name: kwargs.pop(parameter.name, None) for parameter in LIMIT_PARAMETERS}
        spark = {name: kwargs.pop(name, None) for name in SPARK_PARAMETERS}
        # Typer passes every parameter by name, ctx included (a click context, whatever the annotation).
        state_of(kwargs["ctx"]).limits = limits.from_env(**given)  # type: ignore[arg-type]  # typed by the options
        _apply_spark_options(spark)  # type: ignore[arg-type]  # typed by the options
        return command(*args, **kwargs)

    parameters = [*signature.parameters.values(), *LIMIT_PARAMETERS, *(p for p, _ in SPARK_PARAMETERS.values())]
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return wrapper


def db_option_hint(ctx: typer.Context) -> str:
    """``--db URL `` (password hidden) when one was given, so printed commands can be pasted."""
    from durable_dataflow.core.db import redact_url

    state = state_of(ctx)
    if state.remote is not None:  # under --api the command to paste talks to the same API
        return f"--api {state.remote.url} "
    url = state.db_url
    return f"--db {redact_url(url)} " if url else ""


# ---- errors ------------------------------------------------------------------------------------


def exit_code_for(error: DataflowError) -> int:
    return EXIT_CODES.get(error.code, EXIT_ERROR)


def report_error(error: BaseException, debug: bool) -> int:
    """Print an error to stderr (traceback only with --debug) and return its exit status."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    if isinstance(error, DataflowError):
        sys.stderr.write(f"error [{error.code}]: {printable(error.message)}\n")
        return exit_code_for(error)
    # An unexpected exception is a bug. Its message could echo anything it was handed, so only
    # its type is printed; --debug shows the whole traceback.
    sys.stderr.write(f"error [internal]: unexpected {type(error).__name__}; rerun with --debug for the traceback\n")
    return EXIT_ERROR


def fail(message: str) -> NoReturn:
    """Refuse bad command-line input (exit 2 through the error table)."""
    raise InputError(message)


# ---- output ------------------------------------------------------------------------------------


def stdout_console() -> Console:
    terminal = sys.stdout.isatty()
    return Console(highlight=False, width=None if terminal else PIPE_WIDTH_COLUMNS, soft_wrap=not terminal)


def print_whole_rows(console: Console, table: Table) -> None:
    """Print ``table`` so that, into a pipe or a file, each row stays one line at any width (a folded
    warning would break `grep`); a terminal folds it to its own width as usual."""
    if not console.is_terminal:
        unbounded = console.options.update_width(UNBOUNDED_WIDTH_COLUMNS)
        console.width = max(console.width, console.measure(table, options=unbounded).maximum)
    console.print(table)


def stderr_console() -> Console:
    # Not a terminal (a pipe, a log file): never wrap, so `grep 'run failed'` finds the whole message.
    terminal = sys.stderr.isatty()
    return Console(stderr=True, highlight=False, width=None if terminal else PIPE_WIDTH_COLUMNS, soft_wrap=not terminal)


@contextlib.contextmanager
def spinner(message: str) -> Iterator[None]:
    """A Rich status spinner on stderr, only when stderr is a terminal (never in pipes or logs)."""
    if not sys.stderr.isatty():
        yield
        return
    with stderr_console().status(message):
        yield


def emit_json(data: Any) -> None:
    """Stable, machine-readable JSON on stdout: field order as documented, one trailing newline."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def run_json(run: Run | RunView, **extra: Any) -> dict[str, Any]:
    """``run.public()`` plus command-specific fields (only ever added, docs/cli.md). A read view's run
    (``runs``, ``show``) carries its derived ``warning`` and ``unresolved`` and adds ``lease_expired``."""
    return {**run.public(), **extra}


def view_of(run: Run | RunView) -> RunView:
    """A run as shown: a read view as it is; a run a write returned, without its lease (``views.plain``)."""
    from durable_dataflow.dataflow.protocol import views

    return run if isinstance(run, views.RunView) else views.plain(run)


def as_shown(platform: Platform, run: Run) -> RunView:
    """The run as every read view shows it now (``views.load_one``: its lease read on the database clock).
    `run` and `submit` print their run this way, so a replay of a run whose process died after its dispatch
    authorization says UNRESOLVED and exits 3, as `show`, Ops and the API say, not ``running``."""
    from durable_dataflow.dataflow.protocol import views

    with platform.db.read() as conn:
        return views.load_one(conn, platform.db, run)


def warning_of(run: Run | RunView) -> str | None:
    """The run's warning; an unresolved run always has one, even if the projection lacks it."""
    return view_of(run).warning


def status_text(run: Run | RunView) -> Text:
    """The status cell: unresolved runs say UNRESOLVED in bold yellow, never 'failed' (invariant 13).

    The recovery status is shown beside it, in its own column or row.
    """
    from durable_dataflow.dataflow.protocol.runs import RunStatus

    view = view_of(run)
    if view.unresolved:
        return Text("UNRESOLVED", style="bold yellow")
    style = {RunStatus.SUCCEEDED: "green", RunStatus.FAILED: "red", RunStatus.CANCELLED: "magenta"}.get(
        RunStatus(view.run.status), "cyan"
    )
    return Text(view.run.status, style=style)


def short_id(run_id: str) -> str:
    """The random tail of a UUIDv7, accepted by every command that takes a run id."""
    return run_id[-RUN_ID_TAIL_CHARS:]


def time_text(us: int | None) -> str:
    """ISO 8601 with milliseconds, UTC (``views.time_text``)."""
    from durable_dataflow.dataflow.protocol import views

    return views.time_text(us)


def age_text(us: int, now_s: float | None = None) -> str:
    from durable_dataflow.dataflow.protocol import views

    return views.age_text((now_s if now_s is not None else time.time()) - us / US_PER_S)


def short_payload(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    if len(text) <= PAYLOAD_CHARS_SHOWN_MAX:
        return text
    return text[: PAYLOAD_CHARS_SHOWN_MAX - 1] + "…"


def print_warning_block(console: Console, shown: Run | RunView, ctx: typer.Context) -> None:
    """The loud block an unresolved run gets wherever it is shown in detail."""
    from durable_dataflow.dataflow.protocol.runs import RunStatus

    view = view_of(shown)
    run = view.run
    if view.warning is None:
        return
    console.print(Text(printable(f"WARNING: {view.warning}"), style="bold yellow"))
    if not view.unresolved:
        return
    key = printable(run.publication_idempotency_key or run.idempotency_key, multiline=False)
    console.print(Text(f"  idempotency key:  {key}", style="yellow"))
    console.print(Text(printable(f"  output digest:    {run.output_digest}"), style="yellow"))
    if run.status == RunStatus.OUTCOME_UNKNOWN or view.reconcilable:
        command = f"dataflow {db_option_hint(ctx)}reconcile {run.run_id}"
        console.print(Text(f"  reconcile with:   {command}", style="bold yellow"))
    else:
        command = f"dataflow {db_option_hint(ctx)}verify {run.run_id}"
        console.print(Text(f"  inspect with:     {command}", style="bold yellow"))


def run_exit_code(shown: Run | RunView) -> int:
    """A run's outcome as an exit status: 0 succeeded, 1 failed, 3 unresolved (as shown: a read view's
    expired attempt after dispatch authorization too), 9 not finished."""
    from durable_dataflow.dataflow.protocol.runs import RunStatus

    view = view_of(shown)
    run = view.run
    if view.unresolved:
        return EXIT_UNRESOLVED
    if run.status == RunStatus.SUCCEEDED:
        return EXIT_OK
    if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
        return EXIT_NOT_FINISHED
    return EXIT_RUN_FAILED
