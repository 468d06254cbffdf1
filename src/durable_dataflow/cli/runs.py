"""``dataflow run``, ``dataflow runs`` and ``dataflow reconcile``: submit, list and settle runs."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.text import Text

from durable_dataflow.cli import common, interrupts, options, progress_line, remote, render
from durable_dataflow.core import ledger
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow.protocol import runs, views
from durable_dataflow.dataflow.protocol.requests import (
    MAX_ATTEMPTS_DEFAULT,
    AccessContext,
    Provenance,
    RunRequest,
)
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus

if TYPE_CHECKING:  # `run` and `reconcile` import what they execute with; `runs` reads only
    from durable_dataflow.dataflow.definitions.definitions import LoadedDefinition
    from durable_dataflow.dataflow.protocol import reconcile
    from durable_dataflow.platform import Platform

PARAMS_MAX = 100
REPLAY_NOTE = "replayed: existing run returned, nothing executed"
# `--wait` (`run`, `submit`): how often the run is read again while it is queued or running. One read a
# second is prompt enough for a person and costs the database one indexed row (and its lease) per second.
WAIT_POLL_S_DEFAULT = 1.0
WAIT_POLL_S_MIN = 0.01
WAIT_POLL_S_MAX = 3600.0

# `run` and `submit`: wait for the run to end (or to need a person) before printing it.
Wait = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="If the run is queued or running (a replay, or a submitted run), wait until it ends or is "
        "unresolved, then print it and exit with its status.",
    ),
]
PollInterval = Annotated[
    float | None,
    typer.Option(
        "--poll-interval",
        metavar="SECONDS",
        help=f"With --wait: seconds between two reads of the run (default {WAIT_POLL_S_DEFAULT:g}).",
        show_default=False,
    ),
]
WaitTimeout = Annotated[
    float | None,
    typer.Option(
        "--wait-timeout",
        metavar="SECONDS",
        help="With --wait: stop waiting after this long, print the run as it stands and exit 9 (default: no limit).",
        show_default=False,
    ),
]


def parse_params(pairs: list[str]) -> dict[str, str]:
    """``k=v`` pairs as raw strings (typed by the definition); a repeated name is refused."""
    if len(pairs) > PARAMS_MAX:
        raise InputError(f"at most {PARAMS_MAX} --param options are accepted")
    parsed: dict[str, str] = {}
    for number, pair in enumerate(pairs, start=1):
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name:  # never repeat it: it may be a value pasted without its name
            raise InputError(f"--param number {number} must have the form NAME=VALUE")
        if name in parsed:
            raise InputError(f"--param {name} is given more than once")
        parsed[name] = value
    return parsed


def _announce(shown: Run | views.RunView, replayed: bool, ctx: typer.Context, as_json: bool) -> None:
    """Print the run; in JSON mode the notes go to stderr so stdout stays one JSON document."""
    run = common.view_of(shown).run
    if as_json:
        common.emit_json(common.run_json(shown, replayed=replayed))
        notes = common.stderr_console()
        if replayed:
            notes.print(Text(REPLAY_NOTE, style="bold"))
        if run.status == RunStatus.FAILED and run.error_code:
            notes.print(Text(printable(f"run failed [{run.error_code}]: {run.error_message}"), style="red"))
        common.print_warning_block(notes, shown, ctx)
        return
    console = common.stdout_console()
    if replayed:
        console.print(Text(REPLAY_NOTE, style="bold"))
    console.print(render.run_panel(shown, title="run (replayed)" if replayed else "run"))
    common.print_warning_block(console, shown, ctx)


@dataclass(frozen=True)
class Waiting:
    """``--wait``: read the run every ``poll_interval_s`` until it is settled, for at most ``timeout_s``."""

    poll_interval_s: float
    timeout_s: float | None


def waiting_of(wait: bool, poll_interval: float | None, wait_timeout: float | None) -> Waiting | None:
    """The ``--wait`` options checked (exit 2 before anything is recorded), or None without ``--wait``."""
    if not wait:
        for flag, given in (("--poll-interval", poll_interval), ("--wait-timeout", wait_timeout)):
            if given is not None:
                raise InputError(f"{flag} applies only with --wait")
        return None
    poll_s = WAIT_POLL_S_DEFAULT if poll_interval is None else poll_interval
    if not (math.isfinite(poll_s) and WAIT_POLL_S_MIN <= poll_s <= WAIT_POLL_S_MAX):
        raise InputError(
            f"--poll-interval must be between {WAIT_POLL_S_MIN:g} and {WAIT_POLL_S_MAX:g} seconds, got {poll_s}"
        )
    if wait_timeout is not None and not (math.isfinite(wait_timeout) and wait_timeout >= 0):
        raise InputError(f"--wait-timeout must be a number of seconds, 0 or more, got {wait_timeout}")
    return Waiting(poll_s, wait_timeout)


def settled(shown: Run | views.RunView) -> bool:
    """The run ended (succeeded, failed, cancelled) or needs a person (unresolved, as shown): nothing more
    comes without an operator. A run still queued or running (its lease expired before its dispatch
    authorization too: a sweeper retries it) is not."""
    return common.run_exit_code(shown) != common.EXIT_NOT_FINISHED


def read_shown(platform: Platform, run_id: str) -> views.RunView:
    """The run as every read view shows it now (one read transaction, as ``show``: never sweeps)."""
    with platform.db.read() as conn:
        return views.shown_run(conn, platform.db, run_id).view


def read_shown_remotely(api: remote.Remote, run_id: str) -> views.RunView:
    """Under --api: ``GET /v1/runs/{id}``, the run as the server reads it now."""
    return remote.run_view(api.call("GET", f"/v1/runs/{_quoted(run_id)}")["run"])


def wait_until_settled(
    ctx: typer.Context, shown: views.RunView, read: Callable[[], views.RunView], waiting: Waiting
) -> views.RunView:
    """Read the run every poll interval until it is ``settled`` or the timeout passes; the run as last read.

    On a terminal stderr shows one live status line; elsewhere one note says what is awaited (stdout is
    left to the run, and stays one JSON document with --json). Ctrl-C stops waiting only: the run goes on
    (it is never cancelled from here), stderr says so with the `show` command, and the exit status is 130.
    """
    if settled(shown):
        return shown
    run_id = shown.run.run_id
    show_command = f"`dataflow {common.db_option_hint(ctx)}show {run_id}`"
    started = time.monotonic()
    deadline = None if waiting.timeout_s is None else started + waiting.timeout_s
    try:
        with _waiting_line(shown) as update:  # notes are printed after it: never under a live line
            while not settled(shown) and (deadline is None or time.monotonic() < deadline):
                pause_s = waiting.poll_interval_s
                if deadline is not None:  # cut short by the timeout
                    pause_s = max(0.0, min(pause_s, deadline - time.monotonic()))
                time.sleep(pause_s)  # the poll interval: the run's state is read again after it
                shown = read()
                update(shown, time.monotonic() - started)
    except KeyboardInterrupt:
        _note(f"interrupted: stopped waiting; run {run_id} goes on (it was not cancelled): {show_command}")
        raise typer.Exit(common.EXIT_INTERRUPTED) from None
    if not settled(shown):
        _note(
            f"stopped waiting after {time.monotonic() - started:.1f} s (--wait-timeout): run {run_id} is still "
            f"{_status_word(shown)} and goes on: {show_command}"
        )
    return shown


def _status_word(shown: views.RunView) -> str:
    return "UNRESOLVED" if shown.unresolved else str(shown.run.status)


def _note(text: str) -> None:
    common.stderr_console().print(Text(printable(text), style="bold"))


@contextlib.contextmanager
def _waiting_line(shown: views.RunView) -> Iterator[Callable[[views.RunView, float], None]]:
    """How each read is shown: a live line on a terminal's stderr, else one note now and nothing after."""
    run_id = shown.run.run_id

    def line(view: views.RunView, elapsed_s: float) -> Text:
        return Text(
            f"waiting for run {common.short_id(run_id)}: {_status_word(view)}, attempt {view.run.attempt}"
            f" · {elapsed_s:.0f} s · Ctrl-C stops waiting"
        )

    if not sys.stderr.isatty():
        _note(f"waiting for run {run_id} ({_status_word(shown)}); Ctrl-C stops waiting, not the run")
        yield lambda view, elapsed_s: None
        return
    with common.stderr_console().status(line(shown, 0.0)) as status:
        yield lambda view, elapsed_s: status.update(line(view, elapsed_s))


def build_request(
    loaded: LoadedDefinition, param: list[str] | None, idempotency_key: str | None, tenant: str, max_attempts: int
) -> RunRequest:
    """The request `run` and `submit` make: the local user at a terminal, trigger "cli"."""
    access = AccessContext.local(tenant)
    return RunRequest(
        definition=loaded.definition,
        base_dir=loaded.base_dir,
        parameters=parse_params(param or []),
        access=access,
        provenance=Provenance(actor=access.principal, trigger="cli"),
        idempotency_key=idempotency_key,
        max_attempts=max_attempts,
    )


@common.with_limit_options
def run_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The definition file (YAML or JSON).")],
    param: options.Params = None,
    idempotency_key: options.IdempotencyKey = None,
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant the run belongs to.")] = "default",
    max_attempts: Annotated[
        int, typer.Option("--max-attempts", help="Attempts allowed before the run fails.")
    ] = MAX_ATTEMPTS_DEFAULT,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run as JSON.")] = False,
    wait: Wait = False,
    poll_interval: PollInterval = None,
    wait_timeout: WaitTimeout = None,
) -> None:
    """Register, submit and execute a dataflow in this process (under --api: on the server), then print the run."""
    from durable_dataflow.dataflow.definitions.definitions import load_definition

    waiting = waiting_of(wait, poll_interval, wait_timeout)
    api = common.state_of(ctx).remote
    if api is not None:
        remote.refuse_options(ctx, "the API records the run for the token's tenant", "tenant")
        _run_remotely(ctx, api, file, param, idempotency_key, max_attempts, as_json, waiting)
    loaded = load_definition(file)
    request = build_request(loaded, param, idempotency_key, tenant, max_attempts)
    with common.open_platform(ctx) as platform:
        with progress_line.run_progress(loaded.definition.name, as_json) as sink:
            ledger.require_key_setting(platform.db, platform.runs.config.evidence_key)
            service = platform.runs
            with interrupts.handled(service.interruption):
                submission = interrupts.call_in_thread(
                    lambda: service.run_inline(request, sink), lambda: _stop_waiting(service.cancel_interrupted())
                )
            cause = service.interruption.cause
            shown = common.as_shown(platform, submission.run)
        if platform.lineage_configured:  # its own events before it exits; what the receiver refuses waits
            from durable_dataflow.lineage import background, settings

            background.deliver_now(platform.db, settings.namespace())
        if waiting is not None and cause is None:  # a replay of a run another process executes, or queued
            run_id = shown.run.run_id
            shown = wait_until_settled(ctx, shown, lambda: read_shown(platform, run_id), waiting)
    _announce(shown, not submission.created, ctx, as_json)
    if cause is not None and submission.created:
        raise typer.Exit(_interrupted_exit(submission.run, cause.signal, file, param, idempotency_key))
    raise typer.Exit(common.run_exit_code(shown))


def _run_remotely(
    ctx: typer.Context,
    api: remote.Remote,
    file: Path,
    param: list[str] | None,
    key: str | None,
    max_attempts: int,
    as_json: bool,
    waiting: Waiting | None,
) -> NoReturn:
    """`run` under --api: the definition file's text as a YAML body (the server parses it), executed inline
    on the server for the token's tenant; printed and exited as the local run is. With --wait, a replayed
    run still queued or running is read again with ``GET /v1/runs/{id}`` until it is settled."""
    answer = submit_remotely(api, file, param, key, max_attempts, queue=False)
    shown = remote.run_view(answer["run"])
    if waiting is not None:
        run_id = shown.run.run_id
        shown = wait_until_settled(ctx, shown, lambda: read_shown_remotely(api, run_id), waiting)
    _announce(shown, not answer["created"], ctx, as_json)
    raise typer.Exit(common.run_exit_code(shown))


def submit_remotely(
    api: remote.Remote, file: Path, param: list[str] | None, key: str | None, max_attempts: int, *, queue: bool
) -> Any:
    """``POST /v1/runs`` (``?queue=true``: only recorded, a worker executes it) with the definition file's
    text as a YAML body the server parses, for the token's tenant; the API's answer (run and created)."""
    from durable_dataflow.core.files import read_capped
    from durable_dataflow.dataflow.definitions.definitions import DEFINITION_BYTES_MAX

    try:
        text = read_capped(file, DEFINITION_BYTES_MAX, f"{file}: the definition").decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{file}: the definition is not UTF-8 text") from None
    body = remote.run_body(text, parse_params(param or []), max_attempts)
    headers = {"Idempotency-Key": key} if key is not None else {}
    path = "/v1/runs?queue=true" if queue else "/v1/runs"
    return api.call("POST", path, body=body, media_type=remote.YAML_MEDIA_TYPE, headers=headers)


def _interrupted_exit(run: Run, signal_name: str, file: Path, param: list[str] | None, key: str | None) -> int:
    """What an interrupted `dataflow run` says on stderr, and its exit status: 130 when the run was
    cancelled; the run's own status when the signal came after its result was committed or its dispatch
    authorized (nothing was interrupted then)."""
    notes = common.stderr_console()
    if run.status != RunStatus.CANCELLED:
        after = "its dispatch was authorized" if run.mode == runs.Mode.FORWARD_RECOVERY else "its result was committed"
        notes.print(Text(f"{signal_name} arrived after {after}: nothing was interrupted", style="bold"))
        return common.run_exit_code(run)
    again = " ".join(["dataflow run", str(file), *(f"-p {pair}" for pair in param or [])])
    if key is not None:
        again += " -k NEW_KEY"
        how = f"with a new idempotency key (the key {key!r} now names this cancelled run): `{again}`"
    else:
        how = f"with `{again}`"
    notes.print(Text(printable(
        f"interrupted ({signal_name}): run {run.run_id} was cancelled before its dispatch was authorized, "
        f"nothing was published. Run it again {how}"
    ), style="bold yellow"))  # fmt: skip
    return common.EXIT_INTERRUPTED


def _stop_waiting(cancelled: list[Run]) -> None:
    """A second signal: say which run was cancelled here, or that one is left to the sweeper."""
    notes = common.stderr_console()
    for run in cancelled:
        notes.print(Text(f"interrupted again: run {run.run_id} was cancelled before its dispatch was authorized"))
    if not cancelled:
        notes.print(Text(
            "interrupted again: the run was not cancelled (its dispatch may have been authorized, or it ended); "
            "if it is still running, a sweeper decides it once its lease expires: see `dataflow runs`"
        ))  # fmt: skip


def runs_command(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option("--status", help="Only runs with this status.")] = None,
    recovery_status: Annotated[
        str | None, typer.Option("--recovery-status", help="Only runs with this recovery status.")
    ] = None,
    definition: Annotated[str | None, typer.Option("--definition", help="Only runs of this definition name.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only runs of this tenant (default: all).")] = None,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", metavar="NAME=VALUE",
                     help="NAME=VALUE: only runs with this parameter value (repeatable, all match)."),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help=f"At most this many runs (1 to {runs.PAGE_SIZE_MAX}).")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as a JSON list.")] = False,
) -> None:
    """The run history, newest first, with parameters, recovery status and a warning on every unresolved run."""
    _check_choice("--status", status, [s.value for s in RunStatus])
    _check_choice("--recovery-status", recovery_status, [s.value for s in runs.RecoveryStatus])
    if not 1 <= limit <= runs.PAGE_SIZE_MAX:
        raise InputError(f"--limit must be between 1 and {runs.PAGE_SIZE_MAX}, got {limit}")
    api = common.state_of(ctx).remote
    if api is not None:
        found = _runs_remotely(api, status, recovery_status, definition, tenant, param, limit)
    else:
        with common.open_platform(ctx) as platform, platform.db.read() as conn:
            listed = views.run_list(
                conn,
                platform.db,
                limit=limit,
                tenant=tenant,
                status=status,
                recovery_status=recovery_status,
                definition_name=definition,
                parameters=parse_params(param or []),
            )  # reads only: an expired lease is shown, never swept
        found = (listed.as_json(), listed.views)
    if as_json:
        common.emit_json(found[0])
        return
    items = found[1]
    console = common.stdout_console()
    if not items:
        console.print("no runs")
        return
    common.print_whole_rows(console, render.history_table(items, time.time()))
    unresolved = sum(1 for view in items if view.unresolved)
    if unresolved:
        console.print(Text(f"{unresolved} unresolved run(s): see the WARNING column", style="bold yellow"))


def _runs_remotely(
    api: remote.Remote,
    status: str | None,
    recovery_status: str | None,
    definition: str | None,
    tenant: str | None,
    param: list[str] | None,
    limit: int,
) -> tuple[list[dict[str, Any]], tuple[views.RunView, ...]]:
    """`runs` under --api: one page of GET /v1/runs (the token's tenant), as JSON and as read views."""
    parse_params(param or [])  # the same refusals as the local command, before anything is sent
    if tenant is not None:
        raise InputError("--tenant does not apply under --api: the token's tenant is listed")
    query: dict[str, str | list[str]] = {"limit": str(limit)}
    given = {"status": status, "recovery_status": recovery_status, "definition": definition}
    query.update({name: value for name, value in given.items() if value is not None})
    if param:
        query["param"] = list(param)
    listed: list[dict[str, Any]] = api.call("GET", "/v1/runs", query=query)["runs"]
    return listed, tuple(remote.run_view(item) for item in listed)


def _check_choice(option: str, value: str | None, choices: list[str]) -> None:
    if value is not None and value not in choices:
        raise InputError(f"{option} {value!r} is not one of: {', '.join(choices)}")


def reconcile_command(
    ctx: typer.Context,
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="The run id (or its tail as `runs` shows it).")],
    resume: Annotated[
        bool, typer.Option("--resume", help="When proven absent, re-dispatch the stored result (same key).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the finding and the run as JSON.")] = False,
) -> None:
    """Settle an outcome_unknown run by inspecting the sink with its idempotency key."""
    from durable_dataflow.dataflow.protocol import reconcile

    api = common.state_of(ctx).remote
    if api is not None:
        answer = api.call("POST", f"/v1/runs/{_quoted(run_id)}/reconcile", body=_json_bytes({"resume": resume}))
        outcome = reconcile.Reconciliation(
            remote.run_view(answer["run"]).run, reconcile.Finding(answer["finding"]), answer["detail"],
            bool(answer["resumed"]),
        )  # fmt: skip
    else:
        with common.open_platform(ctx) as platform:
            full_id, access = _operator_of(platform, run_id)
            with common.spinner(f"inspecting the sink for run {full_id}"):
                outcome = reconcile.reconcile(
                    platform.runs,
                    full_id,
                    access=access,
                    provenance=Provenance(actor=access.principal, trigger="cli"),
                    resume=resume,
                )
    code = _reconcile_exit_code(outcome)
    if as_json:
        common.emit_json(
            common.run_json(outcome.run, finding=outcome.finding, detail=outcome.detail, resumed=outcome.resumed)
        )
        common.print_warning_block(common.stderr_console(), outcome.run, ctx)
        raise typer.Exit(code)
    console = common.stdout_console()
    style = "bold green" if code == common.EXIT_OK else "bold yellow"
    console.print(Text(printable(f"finding: {outcome.finding} — {outcome.detail}"), style=style))
    console.print(render.run_panel(outcome.run))
    common.print_warning_block(console, outcome.run, ctx)
    raise typer.Exit(code)


def _operator_of(platform: Platform, run_id: str) -> tuple[str, AccessContext]:
    """The full run id and who acts on it from this terminal (the local user, for the run's tenant:
    recorded with each entry an operator's command appends). The command extends the run's chain, so
    it must carry the chain's own key setting."""
    with platform.db.read() as conn:
        full_id = runs.resolve_run_id(conn, run_id)
        access = AccessContext.local(runs.get(conn, full_id).tenant)
        problem = ledger.check_key_setting(conn, platform.runs.config.evidence_key, subject=(runs.MODULE, full_id))
    if problem:
        raise InputError(problem)
    return full_id, access


def cancel_command(
    ctx: typer.Context,
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="The run id (or its tail as `runs` shows it).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the run as JSON.")] = False,
) -> None:
    """Cancel a queued run, or a running one before its dispatch authorization (its attempt is fenced
    off: it commits nothing more). After authorization a publication may exist: refused (exit 5) with
    the reconcile instruction."""
    from durable_dataflow.dataflow.protocol import cancel

    api = common.state_of(ctx).remote
    if api is not None:
        answer = api.call("POST", f"/v1/runs/{_quoted(run_id)}/cancel")
        outcome = cancel.Cancellation(remote.run_view(answer["run"]).run, bool(answer["cancelled"]), answer["detail"])
    else:
        with common.open_platform(ctx) as platform:
            full_id, access = _operator_of(platform, run_id)
            outcome = cancel.cancel(
                platform.runs, full_id, access=access, provenance=Provenance(actor=access.principal, trigger="cli")
            )
    if as_json:
        common.emit_json(common.run_json(outcome.run, cancelled=outcome.cancelled, detail=outcome.detail))
        return
    console = common.stdout_console()
    console.print(Text(printable(f"cancelled: {outcome.detail}" if outcome.cancelled else outcome.detail),
                       style="bold"))  # fmt: skip
    console.print(render.run_panel(outcome.run))


def _quoted(run_id: str) -> str:
    return urllib.parse.quote(run_id, safe="")


def _json_bytes(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


def _reconcile_exit_code(outcome: reconcile.Reconciliation) -> int:
    from durable_dataflow.dataflow.protocol.reconcile import Finding  # loaded already by reconcile_command

    if outcome.finding in (Finding.MISMATCH, Finding.UNDECIDED) or outcome.run.unresolved:
        return common.EXIT_UNRESOLVED
    if outcome.finding == Finding.PRESENT or (outcome.finding == Finding.ABSENT and not outcome.resumed):
        return common.EXIT_OK
    return common.run_exit_code(outcome.run)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
    app.command("runs")(runs_command)
    app.command("reconcile")(reconcile_command)
    app.command("cancel")(cancel_command)
