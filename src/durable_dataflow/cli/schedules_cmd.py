"""``dataflow schedules apply|list|pause|resume|tick`` and ``dataflow backfill`` (docs/schedules.md).

``--now ISO`` (apply, pause, resume, tick, list) stands for the present instant, for cron-driven and
test use; without it the database clock decides.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from durable_dataflow.cli import common
from durable_dataflow.cli import runs as cli_runs
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow import backfill as backfill_mod
from durable_dataflow.dataflow import schedules, views, workspace
from durable_dataflow.dataflow.definitions import load_definition
from durable_dataflow.dataflow.requests import AccessContext, Provenance
from durable_dataflow.dataflow.schedule_spec import iso_utc
from durable_dataflow.dataflow.views import RunView

schedules_app = typer.Typer(
    name="schedules", help="Apply, list, pause and resume schedules; evaluate due ticks.", no_args_is_help=True
)

Tenant = Annotated[str, typer.Option("--tenant", help="The tenant the schedule belongs to.")]
Now = Annotated[
    str | None, typer.Option("--now", metavar="ISO", help="The present instant (else the database clock).")
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _state(applied: schedules.AppliedSchedule) -> str:
    if applied.paused:
        return "paused"
    return "active" if applied.spec.enabled else "disabled"


def _applied_json(applied: schedules.AppliedSchedule) -> dict[str, Any]:
    spec = applied.spec
    return {
        "tenant": applied.tenant, "name": applied.name, "definition_hash": applied.definition_hash,
        "cron": spec.cron, "timezone": spec.timezone, "overlap": spec.overlap,
        "catchup_window": spec.catchup_window, "enabled": spec.enabled, "paused": applied.paused,
        "applied_by": applied.applied_by,
        "applied_at": iso_utc(schedules.from_us(applied.applied_at_us)),
    }  # fmt: skip


@schedules_app.command("apply")
def apply_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="A definition with a schedule: block (YAML or JSON).")],
    tenant: Tenant = "default",
    now: Now = None,
    as_json: AsJson = False,
) -> None:
    """Pin the definition and its schedule; re-applying an unchanged file changes nothing."""
    loaded = load_definition(file)
    moment = schedules.parse_now(now)
    with common.open_platform(ctx) as platform:
        result = schedules.apply(
            platform.db, loaded.definition, workspace.local(loaded.base_dir), AccessContext.local(tenant), now=moment
        )
    if as_json:
        common.emit_json({"schedule": _applied_json(result.schedule), "created": result.created,
                          "changed": result.changed})  # fmt: skip
        return
    applied = result.schedule
    what = "applied" if result.created else ("updated" if result.changed else "unchanged: nothing written")
    typer.echo(printable(f"schedule {applied.tenant}/{applied.name} {what} ({applied.spec.cron}, "
                         f"{applied.spec.timezone}, {applied.definition_hash})"))  # fmt: skip


def _pause_or_resume(ctx: typer.Context, name: str, tenant: str, now: str | None, paused: bool, as_json: bool) -> None:
    moment = schedules.parse_now(now)
    with common.open_platform(ctx) as platform:
        applied = schedules.set_paused(platform.db, tenant, name, paused, now=moment)
    if as_json:
        common.emit_json({"schedule": _applied_json(applied)})
        return
    typer.echo(printable(f"schedule {applied.tenant}/{applied.name} {_state(applied)}"))


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
    moment = schedules.parse_now(now)
    with common.open_platform(ctx) as platform:
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


@schedules_app.command("list")
def list_command(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's schedules (default: all).")] = None,
    now: Now = None,
    as_json: AsJson = False,
) -> None:
    """Every schedule with its next tick, its last tick and that tick's run (UNRESOLVED when it is)."""
    moment = schedules.parse_now(now)
    with common.open_platform(ctx) as platform:
        found = list(schedules.statuses(platform.db, tenant, moment))
        with platform.db.read() as conn:
            loaded = views.load(conn, platform.db, [s.last_run for s in found if s.last_run is not None])
    shown: dict[str, RunView] = {view.run.run_id: view for view in loaded}
    items = [(s, shown.get(s.last_run.run_id) if s.last_run is not None else None) for s in found]
    if as_json:
        common.emit_json([s.as_json(v.warning if v else None, bool(v and v.unresolved)) for s, v in items])
        return
    console = common.stdout_console()
    if not items:
        console.print("no schedules")
        return
    table = Table(
        "SCHEDULE", "CRON", "STATE", "NEXT TICK", "LAST TICK", "DECISION", "LAST RUN TICK", "RUN", "STATUS", "RECOVERY"
    )
    for status, view in items:
        applied = status.applied
        table.add_row(
            Text(printable(f"{applied.tenant}/{applied.name}")),
            Text(printable(f"{applied.spec.cron} {applied.spec.timezone}")),
            _state(applied),
            status.next_tick.iso if status.next_tick else "-",
            status.last.tick if status.last else "-",
            status.last.decision if status.last else "-",
            status.last_submitted.tick if status.last_submitted else "-",
            common.short_id(view.run.run_id) if view else "-",
            common.status_text(view) if view else Text("-"),
            str(view.run.recovery_status) if view else "-",
        )
    console.print(table)
    for _, view in items:
        if view is not None:
            common.print_warning_block(console, view, ctx)


def backfill_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The definition (YAML or JSON).")],
    start: Annotated[str, typer.Option("--from", metavar="DATE", help="The first day, YYYY-MM-DD.")],
    end: Annotated[str, typer.Option("--to", metavar="DATE", help="The last day (included), YYYY-MM-DD.")],
    param: Annotated[
        list[str] | None, typer.Option("--param", help="NAME=VALUE, may use {{ tick.date }} (repeatable).")
    ] = None,
    tenant: Tenant = "default",
    as_json: AsJson = False,
) -> None:
    """Queue one run per day (or per tick of the definition's schedule) with the key
    backfill:<tenant>:<name>:<tick>. Running it again submits nothing that exists and reports every
    day's run; exit 3 when one of them is unresolved."""
    loaded = load_definition(file)
    items = backfill_mod.plan(
        loaded.definition, tenant, backfill_mod.parse_day(start, "--from"), backfill_mod.parse_day(end, "--to"),
        cli_runs.parse_params(param or []),
    )  # fmt: skip
    access = AccessContext.local(tenant)
    show_bar = not as_json and sys.stderr.isatty()
    with common.open_platform(ctx) as platform:
        bar = Progress(TextColumn("backfill {task.description}"), BarColumn(), MofNCompleteColumn(),
                       console=common.stderr_console(), disable=not show_bar, transient=True)  # fmt: skip
        with bar:
            task = bar.add_task(loaded.definition.name, total=len(items))
            results = backfill_mod.run(
                platform.runs, loaded.definition, items, access=access,
                provenance=Provenance(actor=access.principal, trigger="cli"),
                workspace=workspace.local(loaded.base_dir), on_item=lambda _: bar.advance(task),
            )  # fmt: skip
        with platform.db.read() as conn:
            loaded_views = views.load(conn, platform.db, [r.run for r in results])
    unresolved = [v for v in loaded_views if v.unresolved]
    if as_json:
        common.emit_json([
            {**r.as_json(), "unresolved": v.unresolved, "warning": v.warning}
            for r, v in zip(results, loaded_views, strict=True)
        ])  # fmt: skip
    else:
        console = common.stdout_console()
        table = Table("TICK", "RUN", "SUBMITTED", "STATUS", "RECOVERY")
        for result, view in zip(results, loaded_views, strict=True):
            table.add_row(result.item.tick, common.short_id(result.run.run_id),
                          "now" if result.created else "existed", common.status_text(view),
                          str(view.run.recovery_status))  # fmt: skip
        console.print(table)
        created = sum(1 for r in results if r.created)
        console.print(f"{created} run(s) submitted, {len(results) - created} existed already")
        for view in unresolved:
            common.print_warning_block(console, view, ctx)
    if unresolved:
        raise typer.Exit(common.EXIT_UNRESOLVED)


def register(app: typer.Typer) -> None:
    """Add `schedules …` and `backfill` to the main CLI."""
    app.add_typer(schedules_app, name="schedules")
    app.command("backfill")(backfill_command)


