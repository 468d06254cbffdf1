"""``dataflow schedules apply|list|pause|resume|tick`` and ``dataflow backfill`` (docs/schedules.md).

``--now ISO`` (apply, pause, resume, tick, list) stands for the present instant, for cron-driven and
test use; without it the database clock decides.
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

from durable_dataflow.cli import common
from durable_dataflow.cli import runs as cli_runs
from durable_dataflow.core import ledger
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.text import printable
from durable_dataflow.dataflow.definitions.definitions import LoadedDefinition, load_definition
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.schedules import backfill as backfill_mod
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.platform import Platform

schedules_app = typer.Typer(
    name="schedules", help="Apply, list, pause and resume schedules; evaluate due ticks.", no_args_is_help=True
)

Tenant = Annotated[str, typer.Option("--tenant", help="The tenant the schedule belongs to.")]
Now = Annotated[str | None, typer.Option("--now", metavar="ISO", help="The present instant (else the database clock).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]


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
            platform.runs, loaded.definition, workspace.local(loaded.base_dir), AccessContext.local(tenant), now=moment
        )
    if as_json:
        common.emit_json({"schedule": result.schedule.as_json(), "created": result.created,
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
        common.emit_json({"schedule": applied.as_json()})
        return
    typer.echo(printable(f"schedule {applied.tenant}/{applied.name} {applied.state}"))


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


def _more_hint(page: schedules.ShownPage) -> str | None:
    after = page.next_after
    if after is None:
        return None
    return printable(f"more schedules follow: run again with --after {after[0]}/{after[1]}")


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
    moment = schedules.parse_now(now)
    cursor = parse_after(after)
    with common.open_platform(ctx) as platform:
        page = schedules.shown_page(platform.db, tenant, moment, after=cursor, limit=limit)
    hint = _more_hint(page)
    if as_json:
        common.emit_json([item.as_json() for item in page.items])
        if hint is not None:
            common.stderr_console().print(Text(hint))
        return
    items = [(item.status, item.view) for item in page.items]
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
            applied.state,
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
    if hint is not None:
        console.print(Text(hint, style="bold"))


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
    loaded, items = _plan(file, start, end, param, tenant)
    access = AccessContext.local(tenant)
    with common.open_platform(ctx) as platform, _progress(loaded.definition.name, len(items), as_json) as advance:
        _require_key_setting(platform)
        results = backfill_mod.run_selected(
            platform.runs, loaded.definition, items, only_missing=only_missing, stale=stale, access=access,
            provenance=Provenance(actor=access.principal, trigger="cli"),
            workspace=workspace.local(loaded.base_dir), on_item=advance,
        )  # fmt: skip
        loaded_views = backfill_mod.load_views(platform.db, results)
    unresolved = [v for v in loaded_views if v.unresolved]
    if as_json:
        common.emit_json([r.as_json(v) for r, v in zip(results, loaded_views, strict=True)])
    else:
        console = common.stdout_console()
        table = Table("TICK", "RUN", "SUBMITTED", "STATUS", "RECOVERY")
        for result, view in zip(results, loaded_views, strict=True):
            submitted = "now" if result.created else "published" if result.skipped else "existed"
            table.add_row(result.item.tick, common.short_id(result.run.run_id), submitted,
                          common.status_text(view), str(view.run.recovery_status))  # fmt: skip
        console.print(table)
        created = sum(1 for r in results if r.created)
        published = sum(1 for r in results if r.skipped)
        note = f", {published} skipped (a current publication)" if only_missing else ""
        console.print(f"{created} run(s) submitted, {len(results) - created - published} existed already{note}")
        for view in unresolved:
            common.print_warning_block(console, view, ctx)
    if unresolved:
        raise typer.Exit(common.EXIT_UNRESOLVED)


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
    _, items = _plan(file, start, end, param, tenant)
    access = AccessContext.local(tenant)
    with common.open_platform(ctx) as platform, _progress("cancel", len(items), as_json) as advance:
        _require_key_setting(platform)
        results = backfill_mod.cancel_runs(
            platform.runs, tenant, items, access=access,
            provenance=Provenance(actor=access.principal, trigger="cli"), on_item=advance,
        )  # fmt: skip
    refused = [r for r in results if r.outcome == backfill_mod.CancelOutcome.REFUSED]
    if as_json:
        common.emit_json([r.as_json() for r in results])
    else:
        console = common.stdout_console()
        table = Table("TICK", "RUN", "OUTCOME", "STATUS", "DETAIL")
        for result in results:
            table.add_row(result.item.tick, common.short_id(result.run.run_id) if result.run else "-",
                          str(result.outcome), common.status_text(result.run) if result.run else Text("-"),
                          Text(printable(result.detail)))  # fmt: skip
        console.print(table)
        counts = {o: sum(1 for r in results if r.outcome == o) for o in backfill_mod.CancelOutcome}
        console.print(", ".join(f"{n} {o}" for o, n in counts.items() if n))
    if any(r.outcome == backfill_mod.CancelOutcome.EVIDENCE_FAILED for r in results):
        raise typer.Exit(common.EXIT_ERROR)
    if refused:
        raise typer.Exit(common.EXIT_CODES["conflict"])


def register(app: typer.Typer) -> None:
    """Add `schedules …` and `backfill` to the main CLI."""
    app.add_typer(schedules_app, name="schedules")
    app.add_typer(backfill_app, name="backfill")
