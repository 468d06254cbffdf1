"""Backfills (docs/schedules.md): one run per day, or per tick of the definition's schedule, over a
date range, each under the key ``backfill:<tenant>:<definition name>:<tick>``.

``<tick>`` is the day (``2026-03-01``) for a definition without a schedule and the tick instant in
UTC ISO 8601 for one with a schedule. Submitting is idempotent per key, so a backfill interrupted
anywhere and run again submits only the days that have no run and reports every day's run as it
is: succeeded, queued, failed, or unresolved (never re-run: an ``outcome_unknown`` run is settled by
``dataflow reconcile``). Everything (range, parameters, every day's request) is checked before the
first submit. ``cancel_runs`` cancels a backfill started by mistake: every day's run that cannot have
published yet (docs/schedules.md#cancellation).
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from croniter import CroniterError

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import Conflict, EvidenceError, InputError
from durable_dataflow.dataflow.definitions import parameters as parameters_mod
from durable_dataflow.dataflow.definitions.definitions import Definition, definition_hash
from durable_dataflow.dataflow.definitions.schedule_spec import Tick, parse_template, render
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import cancel, partition_tokens, partitions, quotas, runs, views
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus
from durable_dataflow.dataflow.protocol.service import RunService
from durable_dataflow.dataflow.schedules import schedules

BACKFILL_DAYS_MAX = 366  # the widest range one backfill may cover
BACKFILL_RUNS_MAX = 1000  # the most runs one backfill may submit (a schedule with many ticks a day)
# Days far enough from the ends of the calendar that a tick, its time zone and a {{ tick.date + N days }}
# offset (at most 3660 days) always stay inside it.
BACKFILL_DAY_MIN = dt.date(1900, 1, 1)
BACKFILL_DAY_MAX = dt.date(2999, 12, 31)
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")  # what the refusal promises; fromisoformat takes more
Given = Mapping[str, str | int | float | bool]  # parameters given to the backfill: literals or templates


@dataclass(frozen=True)
class InputNames:
    """How the caller's input is named in refusals: the CLI's options, or the API's body fields."""

    first: str
    last: str
    parameter: str  # put before a parameter's name


CLI_NAMES = InputNames(first="--from", last="--to", parameter="--param ")
API_NAMES = InputNames(first="from", last="to", parameter="parameters.")


@dataclass(frozen=True)
class BackfillItem:
    tick: str  # the day, or the tick instant (UTC ISO 8601)
    key: str
    parameters: dict[str, Any]
    day: dt.date | None = None  # the tick's day in the schedule's time zone (the backfill_days quota)


@dataclass(frozen=True)
class BackfillResult:
    item: BackfillItem
    run: Run  # the day's run; for a day skipped by --only-missing, its partition's current publication
    created: bool  # False: the key had a run already (or the day was skipped); nothing was submitted
    skipped: bool = False  # --only-missing: the partition has a current publication; nothing was submitted

    def as_json(self, view: views.RunView | None = None) -> dict[str, Any]:
        """The day's report; with the run's ``view`` (``load_views``), unresolved and warning as readers
        show them (an expired lease read on the database clock)."""
        shown = view if view is not None else views.plain(self.run)
        return {
            "tick": self.item.tick, "idempotency_key": self.item.key, "run_id": self.run.run_id,
            "created": self.created, "status": str(self.run.status),
            "recovery_status": str(self.run.recovery_status), "unresolved": shown.unresolved,
            "warning": shown.warning, "skipped": self.skipped,
        }  # fmt: skip


def load_views(db: Database, results: list[BackfillResult]) -> list[views.RunView]:
    """Every day's run as shown, in the order of ``results``, in one read."""
    with db.read() as conn:
        return views.load(conn, db, [r.run for r in results])


def parse_day(text: str, option: str) -> dt.date:
    """A day of the range, named ``option`` in the refusal."""
    try:
        if not _DAY.fullmatch(text.strip()):
            raise ValueError(text)
        day = dt.date.fromisoformat(text.strip())
    except ValueError:
        raise InputError(f"{option} must be a date, YYYY-MM-DD") from None
    if not BACKFILL_DAY_MIN <= day <= BACKFILL_DAY_MAX:
        raise InputError(f"{option} must be a day from {BACKFILL_DAY_MIN} to {BACKFILL_DAY_MAX}")
    return day


def plan(
    definition: Definition,
    tenant: str,
    first: dt.date,
    last: dt.date,
    given: Given,
    names: InputNames = CLI_NAMES,
) -> list[BackfillItem]:
    """Every run of the backfill, oldest first, with its key and raw parameters.

    A parameter given (``--param``) may use the schedule's expressions (``{{ tick.date }}``...) and
    overrides the schedule's; a definition without a schedule gives its only ``date`` parameter the
    day unless it is given."""
    if last < first:
        raise InputError(f"{names.last} must not be before {names.first}")
    days = (last - first).days + 1
    if days > BACKFILL_DAYS_MAX:
        raise InputError(f"a backfill covers at most {BACKFILL_DAYS_MAX} days; this range has {days}")
    for name, value in given.items():
        try:
            if isinstance(value, str):
                parse_template(value)
        except ValueError as error:
            raise InputError(f"{names.parameter}{name}: {error}") from None
    spec = definition.schedule
    if spec is None:
        template: dict[str, str | int | float | bool] = dict(given)
        dates = [name for name, p in definition.parameters.items() if p.type == "date" and name not in given]
        if len(dates) == 1:
            template[dates[0]] = "{{ tick.date }}"
        ticks = [Tick(dt.datetime(d.year, d.month, d.day, tzinfo=dt.UTC), d) for d in _days(first, days)]
        labels = [t.local_date.isoformat() for t in ticks]
    else:
        zone = spec.zone()
        start = dt.datetime(first.year, first.month, first.day, tzinfo=zone).astimezone(dt.UTC)
        end_day = last + dt.timedelta(days=1)
        end = dt.datetime(end_day.year, end_day.month, end_day.day, tzinfo=zone).astimezone(dt.UTC)
        try:
            ticks = spec.ticks(start - dt.timedelta(microseconds=1), end - dt.timedelta(microseconds=1),
                               BACKFILL_RUNS_MAX + 1)  # fmt: skip
        except CroniterError:
            raise schedules.no_date_refusal(spec) from None
        template = {**spec.parameters, **given}
        labels = [t.iso for t in ticks]
    if len(ticks) > BACKFILL_RUNS_MAX:
        raise InputError(f"a backfill submits at most {BACKFILL_RUNS_MAX} runs; this range has more")
    items = []
    for tick, label in zip(ticks, labels, strict=True):
        raw = {name: render(value, tick) for name, value in template.items()}
        # Typed now, for every day: a bad value refuses the whole backfill before anything is recorded.
        parameters_mod.check_parameters(definition, raw)
        items.append(BackfillItem(label, f"backfill:{tenant}:{definition.name}:{label}", raw, tick.local_date))
    return items


def _days(first: dt.date, count: int) -> list[dt.date]:
    return [first + dt.timedelta(days=offset) for offset in range(count)]


@dataclass(frozen=True)
class Selection:
    """What ``--only-missing`` keeps of a backfill: the days to submit, and the days whose partition has a
    current publication to keep (each with that publication's run), both in the backfill's order."""

    submit: list[BackfillItem]
    published: list[tuple[BackfillItem, Run]]


# With --stale, a submitted day's key ends with this many hex digits of the definition hash: the day's
# plain key may name the earlier definition's run, and a key names one request only.
STALE_KEY_HASH_CHARS = 12


def select_missing(
    db: Database, definition: Definition, tenant: str, items: list[BackfillItem], *, stale: bool = False
) -> Selection:
    """The days whose partition has no current publication (``dataflow.protocol.partitions``); with ``stale``, also
    those whose current publication came from another definition hash, each under the key
    ``<key>:<definition hash, 12 hex digits>``. A definition whose target has no partition is refused."""
    target = definition.target
    if target is None or target.partition is None:
        raise InputError("--only-missing needs a definition whose target has mode replace_partition and a partition")
    d_hash = definition_hash(definition)
    with db.read() as conn:
        current = partitions.current_publications(conn, db, tenant, target.datasource)
    selection = Selection([], [])
    for item in items:
        canonical = parameters_mod.check_parameters(definition, item.parameters)
        digest = partition_tokens.partition_digest(parameters_mod.resolve_partition(target.partition, canonical))
        found = current.get(digest)
        if found is not None and (not stale or found.run.definition_hash == d_hash):
            selection.published.append((item, found.run))
        elif stale:
            suffix = d_hash.removeprefix("sha256:")[:STALE_KEY_HASH_CHARS]
            selection.submit.append(BackfillItem(item.tick, f"{item.key}:{suffix}", item.parameters, item.day))
        else:
            selection.submit.append(item)
    return selection


def run_selected(
    service: RunService,
    definition: Definition,
    items: list[BackfillItem],
    *,
    only_missing: bool,
    stale: bool,
    access: AccessContext,
    provenance: Provenance,
    workspace: Workspace,
    on_item: Callable[[BackfillResult], None] | None = None,
) -> list[BackfillResult]:
    """``run``, or with ``only_missing`` (``--only-missing``): submit the days ``select_missing`` keeps and
    report the others skipped with their partition's current publication, every day in the backfill's
    order. ``stale`` without ``only_missing`` is refused, and so is a backfill covering more days than the
    tenant's ``backfill_days`` quota (QuotaExceeded), both before anything is recorded."""
    if stale and not only_missing:
        raise InputError("stale is a refinement of only_missing: give both")
    quotas.check_backfill_days(service.config.quotas, access.tenant, days_covered(items))
    chosen = Selection(items, [])
    if only_missing:
        chosen = select_missing(service.db, definition, access.tenant, items, stale=stale)
    submitted = run(service, definition, chosen.submit, access=access, provenance=provenance,
                    workspace=workspace, on_item=on_item)  # fmt: skip
    skipped = [BackfillResult(item, found, False, skipped=True) for item, found in chosen.published]
    order = {item.tick: number for number, item in enumerate(items)}
    return sorted(submitted + skipped, key=lambda r: order[r.item.tick])


def days_covered(items: list[BackfillItem]) -> int:
    """The days from the first item's to the last item's, both included (0 for no item)."""
    days = [item.day for item in items if item.day is not None]
    return (max(days) - min(days)).days + 1 if days else 0


def run(
    service: RunService,
    definition: Definition,
    items: list[BackfillItem],
    *,
    access: AccessContext,
    provenance: Provenance,
    workspace: Workspace,
    on_item: Callable[[BackfillResult], None] | None = None,
) -> list[BackfillResult]:
    """Submit (queue) every item's run; an item whose key has a run is reported, not submitted."""
    results = []
    for item in items:
        request = RunRequest(
            definition=definition, base_dir=workspace.base_dir, parameters=item.parameters, access=access,
            provenance=provenance, idempotency_key=item.key, workspace=workspace,
        )  # fmt: skip
        submission = service.submit(request)
        result = BackfillResult(item, submission.run, submission.created)
        results.append(result)
        if on_item is not None:
            on_item(result)
    return results


# ---- cancelling a backfill -----------------------------------------------------------------------


class CancelOutcome(enum.StrEnum):
    CANCELLED = "cancelled"  # cancelled now
    ALREADY_CANCELLED = "already_cancelled"
    FINISHED = "finished"  # succeeded or failed before the cancel: left as it is
    REFUSED = "refused"  # its dispatch was authorized: a publication may exist; reconcile it
    EVIDENCE_FAILED = "evidence_failed"  # its chain does not verify: nothing was written; `dataflow verify` it
    NO_RUN = "no_run"  # the day has no run under its key


@dataclass(frozen=True)
class CancelResult:
    item: BackfillItem
    run: Run | None
    outcome: CancelOutcome
    detail: str

    def as_json(self) -> dict[str, Any]:
        run = self.run
        return {
            "tick": self.item.tick, "idempotency_key": self.item.key, "run_id": run.run_id if run else None,
            "outcome": str(self.outcome), "detail": self.detail,
            "status": str(run.status) if run else None,
            "recovery_status": str(run.recovery_status) if run else None,
        }  # fmt: skip


def cancel_runs(
    service: RunService,
    tenant: str,
    items: list[BackfillItem],
    *,
    access: AccessContext,
    provenance: Provenance,
    on_item: Callable[[CancelResult], None] | None = None,
) -> list[CancelResult]:
    """Cancel every day's run that cannot have published (``dataflow.protocol.cancel``) and report every day:
    one refused, finished or evidence_failed day never stops the others."""
    results = []
    for item in items:
        with service.db.read() as conn:
            found = runs.find_by_key(conn, tenant, item.key)
        if found is None:
            result = CancelResult(item, None, CancelOutcome.NO_RUN, "no run under this key")
        else:
            result = _cancel_one(service, item, found, access, provenance)
        results.append(result)
        if on_item is not None:
            on_item(result)
    return results


def _cancel_one(
    service: RunService, item: BackfillItem, found: Run, access: AccessContext, provenance: Provenance
) -> CancelResult:
    try:
        done = cancel.cancel(service, found.run_id, access=access, provenance=provenance, tenant=found.tenant)
    except Conflict as refused:
        now = service.get(found.run_id)
        finished = now.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
        return CancelResult(item, now, CancelOutcome.FINISHED if finished else CancelOutcome.REFUSED, refused.message)
    except EvidenceError as broken:  # this day's chain does not verify: nothing was written for it
        return CancelResult(item, service.get(found.run_id), CancelOutcome.EVIDENCE_FAILED, broken.message)
    outcome = CancelOutcome.CANCELLED if done.cancelled else CancelOutcome.ALREADY_CANCELLED
    return CancelResult(item, done.run, outcome, done.detail)
