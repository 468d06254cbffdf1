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
from sqlalchemy.engine import Connection

from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import Conflict, EvidenceError, InputError, NotFound, QuotaExceeded
from durable_dataflow.dataflow.definitions import parameters as parameters_mod
from durable_dataflow.dataflow.definitions.definitions import IDENTIFIER_PATTERN, Definition, definition_hash
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
        items.append(BackfillItem(label, f"{key_prefix(tenant, definition.name)}{label}", raw, tick.local_date))
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
    ``<key>:<definition hash, 12 hex digits>``. With ``stale``, a day with no publication keeps its plain key
    unless a run of another definition hash holds it: a run of this definition already queued under it is
    then replayed, never run a second time under the suffixed key. A definition whose target has no
    partition is refused."""
    target = definition.target
    if target is None or target.partition is None:
        raise InputError("--only-missing needs a definition whose target has mode replace_partition and a partition")
    d_hash = definition_hash(definition)
    selection = Selection([], [])
    with db.read() as conn:
        current = partitions.current_publications(conn, db, tenant, target.datasource)
        for item in items:
            canonical = parameters_mod.check_parameters(definition, item.parameters)
            digest = partition_tokens.partition_digest(parameters_mod.resolve_partition(target.partition, canonical))
            found = current.get(digest)
            if found is not None and (not stale or found.run.definition_hash == d_hash):
                selection.published.append((item, found.run))
            elif stale and (found is not None or _held_by_another_definition(conn, tenant, item.key, d_hash)):
                suffix = d_hash.removeprefix("sha256:")[:STALE_KEY_HASH_CHARS]
                selection.submit.append(BackfillItem(item.tick, f"{item.key}:{suffix}", item.parameters, item.day))
            else:
                selection.submit.append(item)
    return selection


def _held_by_another_definition(conn: Connection, tenant: str, key: str, d_hash: str) -> bool:
    """A run of another definition hash holds ``key`` (a submit under it would be refused as a conflict)."""
    holder = runs.find_by_key(conn, tenant, key)
    return holder is not None and holder.definition_hash != d_hash


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
    """Submit (queue) every item's run; an item whose key has a run is reported, not submitted. A quota
    that refuses an item after earlier ones were queued says which were (QuotaExceeded): they stay
    queued, and the same backfill run again reports them and submits the rest."""
    results: list[BackfillResult] = []
    for item in items:
        request = RunRequest(
            definition=definition, base_dir=workspace.base_dir, parameters=item.parameters, access=access,
            provenance=provenance, idempotency_key=item.key, workspace=workspace,
        )  # fmt: skip
        try:
            submission = service.submit(request)
        except QuotaExceeded as error:
            queued = [result.item.tick for result in results if result.created]
            if not queued:
                raise
            days = f"{len(queued)} day(s) of this backfill were queued before it ({queued[0]} to {queued[-1]})"
            if error.quota == quotas.Quota.RESULT_BYTES:  # the days queued fail at their claim as well
                recorded = (f"{days}: they fail quota_exceeded when a worker claims them unless the quota is "
                            f"raised first; {item.tick} and the days after it were not queued")  # fmt: skip
            else:
                recorded = (f"{days}, {item.tick} and the days after it were not: run the same backfill again "
                            "once the quota allows it (the queued days are reported, not submitted again)")  # fmt: skip
            raise quotas.refused_after(error, recorded) from None
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


# ---- reading backfills (the web view: /ui/schedules and /ui/backfills/<definition>) ----------------
# A backfill is recorded as its runs only: one per day (or tick) under ``backfill:<tenant>:<name>:<tick>``,
# or ``…:<tick>:<12 hex digits of the definition hash>`` for a day re-submitted by ``--stale``. So a
# definition's backfills are read as one: every day any backfill of it covered, each in the state of its
# newest run (a stale re-run replaces the day's earlier run).

# The states a backfill's progress counts days in; ``unresolved`` holds outcome_unknown and evidence_failed
# (and a run whose lease expired after dispatch authorization, on the page that reads its lease).
PROGRESS_STATES = ("queued", "running", "succeeded", "failed", "cancelled", "unresolved")
_UNRESOLVED_STATUSES = frozenset({RunStatus.OUTCOME_UNKNOWN.value, RunStatus.EVIDENCE_FAILED.value})
# The most runs one read of a tenant's backfills (the summary) or of one definition's (its page) reads.
BACKFILL_RUNS_READ_MAX = 20_000
# A schedule's recent runs as the schedules page lists them: ticks and backfill days together.
RECENT_RUNS_SHOWN = 5
_NAME = re.compile(IDENTIFIER_PATTERN)
_STALE_SUFFIX = re.compile(rf"^(?P<tick>.+):(?P<hash>[0-9a-f]{{{STALE_KEY_HASH_CHARS}}})$")


def key_prefix(tenant: str, name: str | None = None) -> str:
    """What the keys of the tenant's backfill runs start with (of definition ``name`` only, when given)."""
    return f"backfill:{tenant}:" if name is None else f"backfill:{tenant}:{name}:"


def parse_key(tenant: str, key: str) -> tuple[str, str] | None:
    """``(definition name, tick)`` of a backfill run's key (a stale day's hash suffix dropped); None for
    a key that is not a backfill key of the tenant."""
    prefix = key_prefix(tenant)
    if not key.startswith(prefix):
        return None
    name, sep, tail = key[len(prefix) :].partition(":")
    if not sep or not tail or _NAME.fullmatch(name) is None:
        return None
    stale = _STALE_SUFFIX.fullmatch(tail)
    return name, stale.group("tick") if stale is not None else tail


def state_of(status: str, unresolved: bool = False) -> str:
    """The progress state of a day whose newest run has ``status`` (one of ``PROGRESS_STATES``)."""
    return "unresolved" if unresolved or status in _UNRESOLVED_STATUSES else status


@dataclass(frozen=True)
class BackfillSummary:
    """One definition's backfills: how many days, in which state, over which ticks, recorded when."""

    definition: str
    counts: dict[str, int]  # days per PROGRESS_STATES state
    first_tick: str
    last_tick: str
    last_recorded_us: int  # the newest run's recorded time (database clock)

    @property
    def days(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        """Days that reached a final state (succeeded, failed, cancelled)."""
        return sum(self.counts[state] for state in ("succeeded", "failed", "cancelled"))


@dataclass(frozen=True)
class Summaries:
    items: list[BackfillSummary]  # the most recently recorded backfill first
    truncated: bool  # the tenant has more than BACKFILL_RUNS_READ_MAX backfill runs: the oldest were not read


def summaries(db: Database, tenant: str) -> Summaries:
    """The tenant's backfills, one per definition, from its newest ``BACKFILL_RUNS_READ_MAX`` backfill runs
    (three columns each): each day counted once, in the state of its newest run."""
    with db.read() as conn:
        rows = runs.key_prefix_states(conn, tenant, key_prefix(tenant), limit=BACKFILL_RUNS_READ_MAX + 1)
    newest: dict[tuple[str, str], tuple[str, int]] = {}  # (name, tick) -> (status, recorded); rows newest first
    for key, status, created_us in rows[:BACKFILL_RUNS_READ_MAX]:
        parsed = parse_key(tenant, key)
        if parsed is not None:
            newest.setdefault(parsed, (status, created_us))
    by_name: dict[str, list[tuple[str, str, int]]] = {}
    for (name, tick), (status, created_us) in newest.items():
        by_name.setdefault(name, []).append((tick, status, created_us))
    items = []
    for name, days in by_name.items():
        counts = dict.fromkeys(PROGRESS_STATES, 0)
        for _, status, _ in days:
            counts[state_of(status)] += 1
        ticks = sorted(tick for tick, _, _ in days)
        items.append(BackfillSummary(name, counts, ticks[0], ticks[-1], max(created for _, _, created in days)))
    items.sort(key=lambda s: (-s.last_recorded_us, s.definition))
    return Summaries(items, truncated=len(rows) > BACKFILL_RUNS_READ_MAX)


@dataclass(frozen=True)
class BackfillDay:
    tick: str
    view: views.RunView  # the day's newest run, as readers show it
    earlier: list[views.RunView]  # the day's older runs (a --stale re-run keeps the day's earlier one), newest first

    @property
    def state(self) -> str:
        return state_of(self.view.run.status, self.view.unresolved)


@dataclass(frozen=True)
class BackfillProgress:
    definition: str
    days: list[BackfillDay]  # in tick order
    now_us: int  # the database clock at the read (a queued or running day's time so far)
    truncated: bool  # more than BACKFILL_RUNS_READ_MAX runs: only the newest were read

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PROGRESS_STATES, 0)
        for day in self.days:
            counts[day.state] += 1
        return counts


def progress(db: Database, tenant: str, name: str) -> BackfillProgress:
    """Every day of the tenant's backfills of definition ``name``, each with its runs' views; NotFound
    when the tenant has no backfill run of that name (another tenant's name is not found either)."""
    missing = NotFound(f"no backfill of a definition named {name!r}")
    if _NAME.fullmatch(name) is None:
        raise missing
    with db.read() as conn:
        found = runs.list_by_key_prefix(conn, tenant, key_prefix(tenant, name), limit=BACKFILL_RUNS_READ_MAX + 1)
        shown = views.load(conn, db, found[:BACKFILL_RUNS_READ_MAX])
        now_us = db.now_us(conn)
    if not shown:
        raise missing
    by_tick: dict[str, list[views.RunView]] = {}
    for view in shown:  # newest first
        parsed = parse_key(tenant, view.run.idempotency_key)
        if parsed is not None:
            by_tick.setdefault(parsed[1], []).append(view)
    days = [BackfillDay(tick, found_views[0], found_views[1:]) for tick, found_views in sorted(by_tick.items())]
    return BackfillProgress(name, days, now_us, truncated=len(found) > BACKFILL_RUNS_READ_MAX)


@dataclass(frozen=True)
class RecentRun:
    origin: str  # "tick" (the schedule's own) or "backfill"
    tick: str
    view: views.RunView


@dataclass(frozen=True)
class RecentRuns:
    items: list[RecentRun]  # newest recorded first
    now_us: int


def recent_runs(db: Database, tenant: str, names: list[str], limit: int = RECENT_RUNS_SHOWN) -> dict[str, RecentRuns]:
    """Per schedule name: its newest ``limit`` runs, the schedule's tick runs and the backfill days of its
    definition (``schedule:<tenant>:<name>:`` and ``backfill:<tenant>:<name>:``) together, newest first."""
    found: dict[str, RecentRuns] = {}
    with db.read() as conn:
        now_us = db.now_us(conn)
        for name in names:
            ticks = runs.list_by_key_prefix(conn, tenant, schedules.schedule_key_prefix(tenant, name), limit=limit)
            days = runs.list_by_key_prefix(conn, tenant, key_prefix(tenant, name), limit=limit)
            newest = sorted(ticks + days, key=lambda r: (r.created_at_us, r.run_id), reverse=True)[:limit]
            shown = views.load(conn, db, newest)
            items = []
            tick_prefix = schedules.schedule_key_prefix(tenant, name)
            for view in shown:
                key = view.run.idempotency_key
                if key.startswith(tick_prefix):
                    items.append(RecentRun("tick", key.removeprefix(tick_prefix), view))
                else:
                    parsed = parse_key(tenant, key)
                    items.append(RecentRun("backfill", parsed[1] if parsed is not None else key, view))
            found[name] = RecentRuns(items, now_us)
    return found
