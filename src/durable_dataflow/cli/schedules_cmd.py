"""``dataflow schedules apply|list|pause|resume|tick`` and ``dataflow backfill`` (docs/schedules.md).

``--now ISO`` (apply, pause, resume, tick, list) stands for the present instant, for cron-driven and
test use; without it the database clock decides.

Under ``--api`` (docs/cli.md, Remote CLI) ``apply``, ``list``, ``pause``, ``resume``, ``backfill`` and
``backfill cancel`` call the API's routes for the token's tenant (api/schedules_api.py) and print its answer
with the same renderers as the local commands, which render the same JSON; ``tick`` stays local.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from durable_dataflow.cli import common, remote
from durable_dataflow.cli import runs as cli_runs
from durable_dataflow.core import ledger
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow.definitions.definitions import LoadedDefinition, load_definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.protocol.runs import UNRESOLVED_RECOVERY
from durable_dataflow.dataflow.protocol.views import RunView
from durable_dataflow.dataflow.schedules import backfill as backfill_mod
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.platform import Platform

schedules_app = typer.Typer(
    name="schedules", help="Apply, list, pause and resume schedules; evaluate due ticks.", no_args_is_help=True
)

Tenant = Annotated[str, typer.Option("--tenant", help="The tenant the schedule belongs to.")]
Now = Annotated[str | None, typer.Option("--now", metavar="ISO", help="The present instant (else the database clock).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
# Why --tenant and --now are refused under --api (remote.refuse_options).
OVER_API = "the API acts for the token's tenant, at the server's database clock"
TICK_IS_LOCAL = (
    "dataflow schedules tick is not available over --api: it is the evaluator (a cron job or every `dataflow "
    "worker`) that decides every tenant's due ticks and submits their runs, and the API has no route for it; "
    "run it where the database URL is"
)


def _api(ctx: typer.Context, *local_options: str) -> remote.Remote | None:
    """The API under --api (``local_options`` refused when given), else None."""
    api = common.state_of(ctx).remote
    if api is not None:
        remote.refuse_options(ctx, OVER_API, *local_options)
    return api


@schedules_app.command("apply")
def apply_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="A definition with a schedule: block (YAML or JSON).")],
    tenant: Tenant = "default",
    now: Now = None,
    as_json: AsJson = False,
) -> None:
    """Pin the definition and its schedule; re-applying an unchanged file changes nothing."""
    api = _api(ctx, "tenant", "now")
    if api is not None:  # the file's text (checked here first), applied for the token's tenant
        body = remote.definition_body(file)
        answer = api.call("POST", "/v1/schedules", body=body.data, media_type=body.media_type)
    else:
        loaded = load_definition(file)
        moment = schedules.parse_now(now)
        with common.open_platform(ctx) as platform:
            result = schedules.apply(
                platform.runs, loaded.definition, workspace.local(loaded.base_dir), AccessContext.local(tenant),
                now=moment,
            )  # fmt: skip
        answer = {"schedule": result.schedule.as_json(), "created": result.created, "changed": result.changed}
    if as_json:
        common.emit_json(answer)
        return
    applied = answer["schedule"]
    what = "applied" if answer["created"] else ("updated" if answer["changed"] else "unchanged: nothing written")
    typer.echo(printable(f"schedule {applied['tenant']}/{applied['name']} {what} ({applied['cron']}, "
                         f"{applied['timezone']}, {applied['definition_hash']})"))  # fmt: skip


def _state(applied: dict[str, Any]) -> str:
    """``AppliedSchedule.state`` from its JSON: ``paused``, else ``active`` or ``disabled``."""
    if applied["paused"]:
        return "paused"
    return "active" if applied["enabled"] else "disabled"


def _pause_or_resume(ctx: typer.Context, name: str, tenant: str, now: str | None, paused: bool, as_json: bool) -> None:
    api = _api(ctx, "tenant", "now")
    if api is not None:
        action = "pause" if paused else "resume"
        applied = api.call("POST", f"/v1/schedules/{remote.quoted(name)}/{action}")["schedule"]
    else:
        moment = schedules.parse_now(now)
        with common.open_platform(ctx) as platform:
            applied = schedules.set_paused(platform.db, tenant, name, paused, now=moment).as_json()
    if as_json:
        common.emit_json({"schedule": applied})
        return
    typer.echo(printable(f"schedule {applied['tenant']}/{applied['name']} {_state(applied)}"))


@schedules_app.command("pause")
def pause_command(
    ctx: typer.Context, name: Annotated[str, typer.Argument(help="The definition name.")],
    tenant: Tenant = "default", now: Now = None, as_json: AsJson = False,
) -> None:  # fmt: skip
    """Stop deciding ticks of a schedule."""
    _pause_or_resume(ctx, name, tenant, now, True, as_json)


@schedules_app.command("resume")
def resume_command(
    ctx: typer.Context, name: Annotated[str, typer.Argument(help="The definition name.")],
    tenant: Tenant = "default", now: Now = None, as_json: AsJson = False,
) -> None:  # fmt: skip
    """Decide ticks again, from now on (ticks of the paused time never run)."""
    _pause_or_resume(ctx, name, tenant, now, False, as_json)


@schedules_app.command("tick")
def tick_command(
    ctx: typer.Context,
    now: Now = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's schedules.")] = None,
    as_json: AsJson = False,
) -> None:
    """Evaluate every active schedule once: decide and submit the due ticks (any number of evaluators
    may run at once; each tick gets one decision and at most one run)."""
    if common.state_of(ctx).remote is not None:
        raise InputError(TICK_IS_LOCAL)
    moment = schedules.parse_now(now)
    with common.open_platform(ctx) as platform:
        _require_key_setting(platform)
        evaluation = schedules.evaluate(platform.db, platform.runs, moment, tenant=tenant)
    if as_json:
        common.emit_json(evaluation.as_json())
    else:
        console = common.stdout_console()
        if not evaluation.decisions:
            console.print("no tick due")
        for d in evaluation.decisions:
            shown = f"{d.tenant}/{d.name} {d.tick} {d.decision}" + (f" run {d.run_id}" if d.run_id else "")
            if d.error:
                shown += f" (no run: {d.error})"
            console.print(Text(printable(shown)))
        for error in evaluation.errors:
            console.print(Text(printable(f"{error['tenant']}/{error['name']}: error [{error['code']}]: "
                                         f"{error['message']}"), style="red"))  # fmt: skip
    if evaluation.errors:
        raise typer.Exit(common.EXIT_ERROR)


def parse_after(text: str | None) -> tuple[str, str] | None:
    """The ``TENANT/NAME`` cursor of ``--after``; InputError for anything else."""
    if text is None:
        return None
    tenant, slash, name = text.partition("/")
    if not slash or not tenant or not name:
        raise InputError("--after must be TENANT/NAME, as the previous page's hint names it")
    return tenant, name


def _more_hint(after: tuple[str, str] | None) -> str | None:
    if after is None:
        return None
    return printable(f"more schedules follow: run again with --after {after[0]}/{after[1]}")


def _listed_remotely(
    api: remote.Remote, cursor: tuple[str, str] | None, limit: int
) -> tuple[list[dict[str, Any]], tuple[str, str] | None]:
    """`schedules list` under --api: one page of GET /v1/schedules (the token's tenant) and the cursor of the
    next; ``--after TENANT/NAME`` is sent as the name (the tenant is the token's)."""
    query = {"limit": str(limit), **({"cursor": cursor[1]} if cursor is not None else {})}
    answer = api.call("GET", "/v1/schedules", query=query)
    items: list[dict[str, Any]] = answer["schedules"]
    after = answer["next_cursor"]
    return items, (items[-1]["tenant"], after) if after is not None and items else None


@schedules_app.command("list")
def list_command(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's schedules (default: all).")] = None,
    now: Now = None,
    limit: Annotated[
        int, typer.Option("--limit", help=f"At most this many schedules (1 to {schedules.LIST_PAGE_MAX}).")
    ] = schedules.LIST_PAGE_DEFAULT,
    after: Annotated[
        str | None, typer.Option("--after", metavar="TENANT/NAME", help="Start after this schedule (the next page).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """The schedules by tenant and name, a page at a time, each with its next tick, its last tick and
    that tick's run (UNRESOLVED when it is); a hint names the next page when more follow."""
    if not 1 <= limit <= schedules.LIST_PAGE_MAX:  # before anything is read or sent
        raise InputError(f"the page size must be between 1 and {schedules.LIST_PAGE_MAX}, got {limit}")
    cursor = parse_after(after)
    api = _api(ctx, "tenant", "now")
    if api is not None:
        items, next_after = _listed_remotely(api, cursor, limit)
        views = None
    else:
        moment = schedules.parse_now(now)
        with common.open_platform(ctx) as platform:
            page = schedules.shown_page(platform.db, tenant, moment, after=cursor, limit=limit)
        items, next_after = [item.as_json() for item in page.items], page.next_after
        views = [item.view for item in page.items if item.view is not None and item.view.warning is not None]
    hint = _more_hint(next_after)
    if as_json:
        common.emit_json(items)
        if hint is not None:
            common.stderr_console().print(Text(hint))
        return
    console = common.stdout_console()
    if not items:
        console.print("no schedules")
        return
    table = Table(
        "SCHEDULE", "CRON", "STATE", "NEXT TICK", "LAST TICK", "DECISION", "LAST RUN TICK", "RUN", "STATUS", "RECOVERY"
    )
    for item in items:  # each schedule's JSON (ShownSchedule.as_json), read here or answered by the API
        run_id = item["last_run_id"]
        table.add_row(
            Text(printable(f"{item['tenant']}/{item['name']}")),
            Text(printable(f"{item['cron']} {item['timezone']}")),
            _state(item),
            item["next_tick"] or "-",
            item["last_tick"] or "-",
            item["last_decision"] or "-",
            item["last_run_tick"] or "-",
            common.short_id(run_id) if run_id else "-",
            remote.status_cell(item["last_run_status"], item["unresolved"]) if run_id else Text("-"),
            item["last_run_recovery_status"] if run_id else "-",
        )
    console.print(table)
    _print_warnings(ctx, console, views, [item["last_run_id"] for item in items if item["warning"] is not None])
    if hint is not None:
        console.print(Text(hint, style="bold"))


def _print_warnings(ctx: typer.Context, console: Any, views: list[RunView] | None, run_ids: list[str]) -> None:
    """The warning block of each run with a warning: its view read here (``views``), or under --api (``views``
    None) read from the API by id, as the server shows it now."""
    api = common.state_of(ctx).remote
    shown = views if views is not None else remote.run_views(api, run_ids) if api is not None else []
    for view in shown:
        common.print_warning_block(console, view, ctx)


DefinitionFile = Annotated[Path, typer.Argument(help="The definition (YAML or JSON).")]
FirstDay = Annotated[str, typer.Option("--from", metavar="DATE", help="The first day, YYYY-MM-DD.")]
LastDay = Annotated[str, typer.Option("--to", metavar="DATE", help="The last day (included), YYYY-MM-DD.")]
Params = Annotated[list[str] | None, typer.Option("--param", metavar="NAME=VALUE",
                                                       help="NAME=VALUE, may use {{ tick.date }} (repeatable).")]


class _BackfillGroup(TyperGroup):
    """``dataflow backfill FILE …`` submits and ``dataflow backfill cancel FILE …`` cancels: a first
    word that names no subcommand is the submit's FILE (``./cancel`` for a file named cancel)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # Any: typer vendors click's Context
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [SUBMIT, *args]
        return super().parse_args(ctx, args)


SUBMIT = "submit"
backfill_app = typer.Typer(
    name="backfill", cls=_BackfillGroup, no_args_is_help=True,
    help="Queue one run per day of a range (`dataflow backfill FILE --from D --to D`), or cancel them.",
)  # fmt: skip


def _plan(
    file: Path, start: str, end: str, param: list[str] | None, tenant: str
) -> tuple[LoadedDefinition, list[backfill_mod.BackfillItem]]:
    loaded = load_definition(file)
    items = backfill_mod.plan(
        loaded.definition, tenant, backfill_mod.parse_day(start, "--from"), backfill_mod.parse_day(end, "--to"),
        cli_runs.parse_params(param or []),
    )  # fmt: skip
    return loaded, items


def _require_key_setting(platform: Platform) -> None:
    """Refuse (exit 2) when DATAFLOW_EVIDENCE_KEY, set or not, differs from the ledger's: these commands
    append to run chains (run.recorded, run.cancelled), as `dataflow submit` does."""
    ledger.require_key_setting(platform.db, platform.runs.config.evidence_key)


def _waiting(label: str, as_json: bool) -> contextlib.AbstractContextManager[None]:
    """Under --api, where the days are one request: a spinner on a terminal's stderr, never with --json."""
    return contextlib.nullcontext() if as_json else common.spinner(label)


@contextlib.contextmanager
def _progress(label: str, total: int, as_json: bool) -> Iterator[Callable[[object], None]]:
    """A progress bar on stderr (a terminal only, never with --json); yields the per-day advance."""
    bar = Progress(TextColumn("backfill {task.description}"), BarColumn(), MofNCompleteColumn(),
                   console=common.stderr_console(), disable=as_json or not sys.stderr.isatty(),
                   transient=True)  # fmt: skip
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda _: bar.advance(task)


@backfill_app.command(SUBMIT)
def backfill_command(
    ctx: typer.Context,
    file: DefinitionFile,
    start: FirstDay,
    end: LastDay,
    param: Params = None,
    tenant: Tenant = "default",
    only_missing: Annotated[
        bool, typer.Option("--only-missing", help="Submit only days whose partition has no current publication.")
    ] = False,
    stale: Annotated[
        bool,
        typer.Option("--stale", help="With --only-missing: also days published by another definition hash."),
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Queue one run per day (or per tick of the definition's schedule) with the key
    backfill:<tenant>:<name>:<tick>. Running it again submits nothing that exists and reports every
    day's run; exit 3 when one of them is unresolved. `submit` may be left out. With --only-missing
    (a partitioned target), a day whose partition has a current publication is skipped (reported with
    that run); --stale also submits the days published by another definition hash."""
    if stale and not only_missing:
        raise InputError("--stale is a refinement of --only-missing: give both")
    api = _api(ctx, "tenant")
    loaded, items = _plan(file, start, end, param, tenant)  # under --api too: the local refusals, before sending
    views: list[RunView] | None = None
    if api is not None:
        body = _backfill_body(file, start, end, param, only_missing=only_missing, stale=stale)
        with _waiting(f"backfill {loaded.definition.name}: {len(items)} day(s)", as_json):
            reported = api.call("POST", "/v1/backfills", body=body.data, media_type=body.media_type)["runs"]
    else:
        access = AccessContext.local(tenant)
        with common.open_platform(ctx) as platform, _progress(loaded.definition.name, len(items), as_json) as advance:
            _require_key_setting(platform)
            results = backfill_mod.run_selected(
                platform.runs, loaded.definition, items, only_missing=only_missing, stale=stale, access=access,
                provenance=Provenance(actor=access.principal, trigger="cli"),
                workspace=workspace.local(loaded.base_dir), on_item=advance,
            )  # fmt: skip
            loaded_views = backfill_mod.load_views(platform.db, results)
        reported = [r.as_json(v) for r, v in zip(results, loaded_views, strict=True)]
        views = [v for v in loaded_views if v.unresolved]
    unresolved = [day["run_id"] for day in reported if day["unresolved"]]
    if as_json:
        common.emit_json(reported)
    else:
        console = common.stdout_console()
        table = Table("TICK", "RUN", "SUBMITTED", "STATUS", "RECOVERY")
        for day in reported:  # each day's JSON (BackfillResult.as_json), reported here or by the API
            submitted = "now" if day["created"] else "published" if day["skipped"] else "existed"
            table.add_row(day["tick"], common.short_id(day["run_id"]), submitted,
                          remote.status_cell(day["status"], day["unresolved"]), day["recovery_status"])  # fmt: skip
        console.print(table)
        created = sum(1 for day in reported if day["created"])
        published = sum(1 for day in reported if day["skipped"])
        note = f", {published} skipped (a current publication)" if only_missing else ""
        console.print(f"{created} run(s) submitted, {len(reported) - created - published} existed already{note}")
        _print_warnings(ctx, console, views, unresolved)
    if unresolved:
        raise typer.Exit(common.EXIT_UNRESOLVED)


def _backfill_body(
    file: Path, start: str, end: str, param: list[str] | None, **submit: bool
) -> remote.Body:
    """The POST /v1/backfills(/cancel) body: the definition file, the days and the parameters (and, for a
    submit, only_missing and stale)."""
    rest = {"from": start, "to": end, "parameters": cli_runs.parse_params(param or []), **submit}
    return remote.definition_body(file, **rest)


@backfill_app.command("cancel")
def backfill_cancel_command(
    ctx: typer.Context,
    file: DefinitionFile,
    start: FirstDay,
    end: LastDay,
    param: Params = None,
    tenant: Tenant = "default",
    as_json: AsJson = False,
) -> None:
    """Cancel every day's run of the backfill that cannot have published yet (queued, or running before
    dispatch authorization) and report every day. Exit 1 when a day's evidence failed verification
    (nothing was written for it: verify it), else 5 when a day's run was refused (its dispatch was
    authorized: reconcile it), else 0."""
    api = _api(ctx, "tenant")
    _, items = _plan(file, start, end, param, tenant)  # under --api too: the local refusals, before sending
    if api is not None:
        body = _backfill_body(file, start, end, param)
        with _waiting(f"backfill cancel: {len(items)} day(s)", as_json):
            reported = api.call("POST", "/v1/backfills/cancel", body=body.data, media_type=body.media_type)["runs"]
        unresolved = [day["recovery_status"] in UNRESOLVED_RECOVERY for day in reported]  # as Run.unresolved
    else:
        access = AccessContext.local(tenant)
        with common.open_platform(ctx) as platform, _progress("cancel", len(items), as_json) as advance:
            _require_key_setting(platform)
            results = backfill_mod.cancel_runs(
                platform.runs, tenant, items, access=access,
                provenance=Provenance(actor=access.principal, trigger="cli"), on_item=advance,
            )  # fmt: skip
        reported = [r.as_json() for r in results]
        unresolved = [r.run is not None and r.run.unresolved for r in results]
    outcomes = [backfill_mod.CancelOutcome(day["outcome"]) for day in reported]
    if as_json:
        common.emit_json(reported)
    else:
        console = common.stdout_console()
        table = Table("TICK", "RUN", "OUTCOME", "STATUS", "DETAIL")
        for day, outcome, shown_unresolved in zip(reported, outcomes, unresolved, strict=True):
            run_id = day["run_id"]  # each day's JSON (CancelResult.as_json), reported here or by the API
            table.add_row(day["tick"], common.short_id(run_id) if run_id else "-", str(outcome),
                          remote.status_cell(day["status"], shown_unresolved) if run_id else Text("-"),
                          Text(printable(day["detail"])))  # fmt: skip
        console.print(table)
        counts = {o: outcomes.count(o) for o in backfill_mod.CancelOutcome}
        console.print(", ".join(f"{n} {o}" for o, n in counts.items() if n))
    if backfill_mod.CancelOutcome.EVIDENCE_FAILED in outcomes:
        raise typer.Exit(common.EXIT_ERROR)
    if backfill_mod.CancelOutcome.REFUSED in outcomes:
        raise typer.Exit(common.EXIT_CODES["conflict"])


def register(app: typer.Typer) -> None:
    """Add `schedules …` and `backfill` to the main CLI."""
    app.add_typer(schedules_app, name="schedules")
    app.add_typer(backfill_app, name="backfill")
