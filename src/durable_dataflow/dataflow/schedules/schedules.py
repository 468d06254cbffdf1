"""Applied schedules and exactly-once ticks (docs/schedules.md).

``apply`` pins a definition with its ``schedule:`` block for a tenant (re-applying an unchanged one
writes nothing). ``evaluate`` decides every due tick of every active schedule, in tick order. It reads
only the schedules that are due, by their ``next_due_us`` (NULL while paused or disabled; kept current
by apply, pause, resume and each evaluation), in pages of ``EVALUATION_PAGE_SCHEDULES`` ordered by it,
through every tenant: its cost follows the due schedules, never the applied ones, and no tenant's
schedules can push another's out of a page. Per schedule:

- a tick older than ``now - catchup_window`` is recorded ``skipped_catchup``;
- otherwise, when the run of the schedule's previous submitted tick is still queued or running,
  ``overlap`` decides: ``allow`` submits, ``skip`` records ``skipped_overlap``, ``buffer_one`` keeps
  the newest due tick waiting (undecided) and records the older ones ``skipped_overlap``;
- otherwise the tick is ``submitted``.

Exactly once: the decision is inserted first (insert-or-ignore on ``(tenant, name, tick)``) and
read back, so the first evaluator's decision is the decision, whatever any other one thought. A
``submitted`` decision's run is then submitted through ``RunService.submit`` with the idempotency
key ``schedule:<tenant>:<name>:<tick instant UTC ISO 8601>``: evaluators racing on one tick create
one run, and an evaluator that died between the decision and the submit is repaired by the next one
(a submitted decision without a run is submitted again under the same key while inside the window).
A quota's refusal stops the evaluation's submits for that tenant, and a refused tick's schedule waits a
little before its retry (``_Refusals``): a tenant past its quota costs one refused submit.

All SQL of the two tables lives here.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import sqlalchemy as sa
import structlog
from croniter import CroniterError
from sqlalchemy.engine import Connection

from durable_dataflow.core import hashing
from durable_dataflow.core.db import Database, insert_if_absent
from durable_dataflow.core.errors import DataflowError, InputError, NotFound, QuotaExceeded
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.names import check_tenant
from durable_dataflow.core.units import US_PER_S, from_us, to_us
from durable_dataflow.dataflow.definitions.definitions import (
    IDENTIFIER_PATTERN,
    Definition,
    canonical_body,
    definition_hash,
)
from durable_dataflow.dataflow.definitions.schedule_spec import ScheduleSpec, Tick, iso_utc
from durable_dataflow.dataflow.execution.workspace import Workspace
from durable_dataflow.dataflow.protocol import quotas, runs, views
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import Run, RunStatus
from durable_dataflow.dataflow.protocol.service import RunService
from durable_dataflow.dataflow.schedules.schedule_schema import schedule_ticks, schedules

Decision = Literal["submitted", "skipped_overlap", "skipped_catchup"]
DECISIONS: tuple[Decision, ...] = ("submitted", "skipped_overlap", "skipped_catchup")
# Ticks decided per schedule in one evaluation: a long outage of a minutely schedule is worked off
# over several evaluations, never in one unbounded loop.
TICKS_PER_EVALUATION_MAX = 1000
# Due schedules read per statement of an evaluation; an evaluation reads pages until none is left due.
EVALUATION_PAGE_SCHEDULES = 100
# Schedules one listing page shows (`schedules list --limit`, GET /v1/schedules?limit=): the default, the most.
LIST_PAGE_DEFAULT = 100
LIST_PAGE_MAX = 1000
ERROR_CHARS_MAX = 1000
# After a tick's submit was refused, the longest its schedule waits before its ticks without a run are
# submitted again (a quota's Retry-After, or half the catch-up window, when sooner): see retry_wait_s.
SUBMIT_RETRY_S = 60
ACTIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})
DECISIONS_SHOWN_MAX = 200  # the most tick decisions one read returns
# The instants `--now` may name: the years backfill days may name (backfill.BACKFILL_DAY_MIN/MAX).
NOW_MIN = dt.datetime(1900, 1, 1, tzinfo=dt.UTC)
NOW_MAX = dt.datetime(2999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)
_NAME = re.compile(IDENTIFIER_PATTERN)
# Where check_has_ticks looks for a first tick: a cron that croniter can match has one within years.
_TICKS_PROBE_FROM = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)

_log = structlog.get_logger("dataflow.schedules")


def schedule_key(tenant: str, name: str, tick: Tick) -> str:
    """The idempotency key of a tick's run."""
    return f"{schedule_key_prefix(tenant, name)}{tick.iso}"


def schedule_key_prefix(tenant: str, name: str) -> str:
    """What every tick run's key of the schedule starts with (its tick follows)."""
    return f"schedule:{tenant}:{name}:"


def parse_now(text: str | None) -> dt.datetime | None:
    """An ISO 8601 instant given as ``--now`` (a time without an offset is UTC); None for None."""
    if text is None:
        return None
    try:
        moment = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InputError("--now must be an ISO 8601 instant, e.g. 2026-03-29T02:00:00Z") from None
    moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    # A schedule applied "now" starts its ticks there, and each evaluation looks back from it: an
    # instant at the edge of the calendar would make every later evaluation fail.
    if not NOW_MIN <= moment <= NOW_MAX:
        raise InputError(f"--now must be an instant from {iso_utc(NOW_MIN)} to {iso_utc(NOW_MAX)}")
    return moment


# ---- applied schedules -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppliedSchedule:
    tenant: str
    name: str
    definition_hash: str
    definition: Definition
    spec: ScheduleSpec
    workspace: Workspace
    applied_by: str
    paused: bool
    applied_at_us: int
    updated_at_us: int
    next_due_us: int | None = None  # as read: when an evaluation next has work for it (None: inactive)

    @property
    def active(self) -> bool:
        return self.spec.enabled and not self.paused

    @property
    def state(self) -> str:
        """What readers call it: ``paused``, else ``active`` or ``disabled`` (``enabled: false``)."""
        if self.paused:
            return "paused"
        return "active" if self.spec.enabled else "disabled"

    def as_json(self) -> dict[str, Any]:
        """The applied schedule as `schedules apply|pause|resume --json` and the API show it."""
        spec = self.spec
        return {
            "tenant": self.tenant, "name": self.name, "definition_hash": self.definition_hash,
            "cron": spec.cron, "timezone": spec.timezone, "overlap": spec.overlap,
            "catchup_window": spec.catchup_window, "enabled": spec.enabled, "paused": self.paused,
            "applied_by": self.applied_by, "applied_at": iso_utc(from_us(self.applied_at_us)),
        }  # fmt: skip


@dataclass(frozen=True)
class ApplyResult:
    schedule: AppliedSchedule
    created: bool
    changed: bool  # False: the same definition, schedule and workspace were applied already; nothing written


def _from_row(row: sa.Row[Any]) -> AppliedSchedule:
    definition = Definition.model_validate(json.loads(row.definition_json))
    # apply stores only scheduled definitions
    invariant(definition.schedule is not None, "a stored schedule's definition has a schedule")
    spec = cast(ScheduleSpec, definition.schedule)  # not None: the invariant holds
    return AppliedSchedule(
        tenant=row.tenant,
        name=row.name,
        definition_hash=row.definition_hash,
        definition=definition,
        spec=spec,
        workspace=Workspace.from_json(json.loads(row.workspace_json)),
        applied_by=row.applied_by,
        paused=bool(row.paused),
        applied_at_us=int(row.applied_at_us),
        updated_at_us=int(row.updated_at_us),
        next_due_us=None if row.next_due_us is None else int(row.next_due_us),
    )


def next_due_us(spec: ScheduleSpec, paused: bool, after_us: int) -> int | None:
    """When an active schedule next has a tick to decide: its first tick after ``after_us``; None when
    paused, disabled, or its cron matches no date (no evaluation needs to read it)."""
    if paused or not spec.enabled:
        return None
    tick = _next_tick(spec, from_us(after_us))
    return None if tick is None else to_us(tick.instant)


def _now_us(conn: Connection, db: Database, now: dt.datetime | None) -> int:
    return to_us(now) if now is not None else db.now_us(conn)


def _now_or_db(db: Database, now: dt.datetime | None) -> dt.datetime:
    if now is not None:
        return now
    with db.read() as conn:
        return from_us(db.now_us(conn))


def apply(
    service: RunService,
    definition: Definition,
    workspace: Workspace,
    access: AccessContext,
    *,
    now: dt.datetime | None = None,
) -> ApplyResult:
    """Pin ``definition`` and its schedule for ``access.tenant``. A changed definition, schedule or
    workspace replaces the pinned one, and its ticks start after ``now``; an unchanged one writes nothing.
    What every tick's submit would refuse (the tenant, sources outside the data roots, a sink outside the
    sink root, secrets not granted) is refused here, with nothing recorded."""
    check_tenant(access.tenant)
    if definition.schedule is None:
        raise InputError(f"definition {definition.name!r} has no schedule: block; nothing to apply")
    check_has_ticks(definition.schedule)
    service.check_placement(definition, workspace, access)
    db = service.db
    d_hash = definition_hash(definition)
    body = hashing.canonical_json(canonical_body(definition)).decode("utf-8")
    spec_json = hashing.canonical_json(definition.schedule.model_dump(mode="json")).decode("utf-8")
    space_json = hashing.canonical_json(workspace.as_json()).decode("utf-8")
    key = {"tenant": access.tenant, "name": definition.name}
    with db.read() as conn:
        existing = conn.execute(sa.select(schedules).filter_by(**key)).first()
    if existing is not None and (existing.definition_hash, existing.workspace_json) == (d_hash, space_json):
        return ApplyResult(_from_row(existing), created=False, changed=False)
    limit = service.config.quotas.of(access.tenant).applied_schedules
    try:
        stored, created = _write_applied(db, key, d_hash, body, spec_json, space_json, access.principal, now, limit)
    except sa.exc.IntegrityError:  # another apply of the same name committed first: apply over it
        stored, created = _write_applied(db, key, d_hash, body, spec_json, space_json, access.principal, now, limit)
    return ApplyResult(_from_row(stored), created=created, changed=True)


def _count_applied(conn: Connection, tenant: str, count_max: int) -> int:
    """The tenant's applied schedules (paused ones included), counted up to ``count_max`` on the primary
    key's tenant prefix and no further."""
    found = sa.select(sa.literal(1)).select_from(schedules).where(schedules.c.tenant == tenant).limit(count_max)
    return int(conn.execute(sa.select(sa.func.count()).select_from(found.subquery())).scalar_one())


def no_date_refusal(spec: ScheduleSpec) -> InputError:
    """The refusal of a cron that is well formed but matches no date (``0 0 30 2 *``: February 30)."""
    return InputError(
        f"the schedule's cron {spec.cron!r} matches no date (such as February 30): no tick would ever run"
    )


def check_has_ticks(spec: ScheduleSpec) -> None:
    """InputError unless the cron matches some date: croniter raises on every tick search otherwise,
    which would stop each evaluation (every tenant's) and every listing of the schedule."""
    try:
        spec.next_tick(_TICKS_PROBE_FROM)
    except CroniterError:
        raise no_date_refusal(spec) from None


def _write_applied(
    db: Database, key: dict[str, str], d_hash: str, body: str, spec_json: str, space_json: str, by: str,
    now: dt.datetime | None, applied_max: int,
) -> tuple[sa.Row[Any], bool]:
    """Insert or replace the schedule ``key``; the row and whether it was inserted. A new name is counted
    against ``applied_max`` (the tenant's applied_schedules quota) inside this transaction, after taking
    the tenant's turn: two concurrent applies of new names cannot both take the last slot."""
    spec = ScheduleSpec.model_validate(json.loads(spec_json))
    with db.begin() as conn:
        quotas.take_tenant_turn(conn, key["tenant"])  # first: a concurrent apply of this name has committed
        current = conn.execute(sa.select(schedules).filter_by(**key)).first()
        if current is None:  # refused before anything is written (the transaction rolls back)
            quotas.check_applied_schedules(applied_max, _count_applied(conn, key["tenant"], applied_max))
        at_us = _now_us(conn, db, now)
        values = {
            "definition_hash": d_hash, "definition_json": body, "schedule_json": spec_json,
            "workspace_json": space_json, "applied_by": by,
            "applied_at_us": at_us, "updated_at_us": at_us,
        }  # fmt: skip
        paused = current is not None and bool(current.paused)
        values["next_due_us"] = next_due_us(spec, paused, at_us)
        if current is None:
            conn.execute(sa.insert(schedules).values(**key, **values, paused=False))
        else:
            conn.execute(sa.update(schedules).filter_by(**key).values(**values))
        return conn.execute(sa.select(schedules).filter_by(**key)).one(), current is None


def get(db: Database, tenant: str, name: str) -> AppliedSchedule:
    """The tenant's schedule of that name; NotFound names it only when it is a definition name (never
    echo other input), and a name no definition can have is not looked up at all."""
    well_formed = _NAME.fullmatch(name) is not None
    row = None
    if well_formed:
        with db.read() as conn:
            row = conn.execute(sa.select(schedules).filter_by(tenant=tenant, name=name)).first()
    if row is None:
        raise NotFound(f"tenant {tenant!r} has no schedule named {name!r}" if well_formed else "no such schedule")
    return _from_row(row)


def list_applied(
    db: Database, tenant: str | None = None, *, after: tuple[str, str] | None = None, limit: int = LIST_PAGE_MAX
) -> list[AppliedSchedule]:
    """One page of applied schedules (of ``tenant``, or all), by tenant and name, after the ``(tenant,
    name)`` cursor ``after``: the primary key's order, so each page is one index range."""
    invariant(1 <= limit <= LIST_PAGE_MAX + 1, "a listing page is bounded")
    query = sa.select(schedules).order_by(schedules.c.tenant, schedules.c.name).limit(limit)
    if tenant is not None:
        query = query.where(schedules.c.tenant == tenant)
    if after is not None:
        query = query.where(sa.tuple_(schedules.c.tenant, schedules.c.name) > sa.tuple_(*after))
    with db.read() as conn:
        return [_from_row(row) for row in conn.execute(query)]


def _due_page(
    db: Database, now_us: int, tenant: str | None, after: tuple[int, str, str] | None
) -> list[AppliedSchedule]:
    """The next page of schedules due at ``now_us``, by (next due, tenant, name) after ``after``."""
    due = schedules.c.next_due_us
    query = (
        sa.select(schedules)
        .where(due.is_not(None), due <= now_us)
        .order_by(due, schedules.c.tenant, schedules.c.name)
        .limit(EVALUATION_PAGE_SCHEDULES)
    )
    if tenant is not None:
        query = query.where(schedules.c.tenant == tenant)
    if after is not None:
        query = query.where(sa.tuple_(due, schedules.c.tenant, schedules.c.name) > sa.tuple_(*after))
    with db.read() as conn:
        return [_from_row(row) for row in conn.execute(query)]


def seconds_until_due(db: Database) -> float | None:
    """Seconds from now (database clock) until the earliest next-due instant of any schedule (0 when one is
    due already; None when no schedule is active): one probe of ``ix_schedules_next_due``. A worker waits
    this long, at most its evaluation interval, before its next evaluation, so a tick is decided on time
    without evaluating every second."""
    with db.read() as conn:
        earliest, now_us = conn.execute(db.statement(_earliest_due)).one()
    return None if earliest is None else max(0.0, (int(earliest) - int(now_us)) / US_PER_S)


def _earliest_due(db: Database) -> sa.Select[Any, int]:
    """The earliest next-due instant and the database clock (built once per database and clock)."""
    return sa.select(sa.func.min(schedules.c.next_due_us), db.now_us_expr())


def _store_next_due(db: Database, applied: AppliedSchedule, due_us: int | None) -> None:
    """Store the schedule's next-due instant, guarded on the one this evaluation read: an apply, pause or
    resume (or another evaluator) that changed it since is newer and stays."""
    if due_us == applied.next_due_us:
        return
    seen = schedules.c.next_due_us
    guard = seen.is_(None) if applied.next_due_us is None else seen == applied.next_due_us
    with db.begin() as conn:
        conn.execute(
            sa.update(schedules).filter_by(tenant=applied.tenant, name=applied.name).where(guard)
            .values(next_due_us=due_us)
        )  # fmt: skip


def set_paused(
    db: Database, tenant: str, name: str, paused: bool, *, now: dt.datetime | None = None
) -> AppliedSchedule:
    """Pause or resume. Paused, no tick is decided; resuming starts the ticks after ``now`` (ticks of
    the paused time are never run). Pausing a paused (or resuming a running) schedule writes nothing."""
    current = get(db, tenant, name)
    if current.paused == paused:
        return current
    with db.begin() as conn:
        at_us = _now_us(conn, db, now)
        values: dict[str, Any] = {"paused": paused, "updated_at_us": at_us}
        values["next_due_us"] = next_due_us(current.spec, paused, at_us)
        if not paused:
            values["applied_at_us"] = at_us
        conn.execute(sa.update(schedules).filter_by(tenant=tenant, name=name).values(**values))
    return get(db, tenant, name)


# ---- tick decisions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TickDecision:
    tenant: str
    name: str
    tick: str  # UTC ISO 8601
    tick_us: int
    decision: str
    run_id: str | None
    error: str | None
    decided_at_us: int
    new: bool = False  # this evaluation inserted the decision

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant, "name": self.name, "tick": self.tick, "decision": self.decision,
            "run_id": self.run_id, "error": self.error, "decided_at": iso_utc(from_us(self.decided_at_us)),
            "new": self.new,
        }  # fmt: skip


def _decision_of(row: sa.Row[Any], new: bool = False) -> TickDecision:
    tick_us = int(row.tick_us)
    return TickDecision(
        row.tenant, row.name, iso_utc(from_us(tick_us)), tick_us, row.decision, row.run_id, row.error,
        int(row.decided_at_us), new,
    )  # fmt: skip


def decisions(db: Database, tenant: str, name: str, *, limit: int = 100) -> list[TickDecision]:
    """The schedule's decisions, newest tick first (at most ``DECISIONS_SHOWN_MAX``)."""
    query = (
        sa.select(schedule_ticks)
        .filter_by(tenant=tenant, name=name)
        .order_by(schedule_ticks.c.tick_us.desc())
        .limit(min(limit, DECISIONS_SHOWN_MAX))
    )
    with db.read() as conn:
        return [_decision_of(row) for row in conn.execute(query)]


def _insert_ignore(conn: Connection, values: dict[str, Any]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING on the tick's key; True when this statement inserted it."""
    statement = insert_if_absent(conn.dialect.name, schedule_ticks, ["tenant", "name", "tick_us"]).values(**values)
    return conn.execute(statement.returning(schedule_ticks.c.tick_us)).first() is not None


def _decide(
    db: Database, applied: AppliedSchedule, tick: Tick, decision: Decision, error: str | None = None
) -> TickDecision:
    """Record ``decision`` (with ``error``: a submitted tick that will not be submitted now) unless the
    tick has one already; the stored decision either way."""
    key = {"tenant": applied.tenant, "name": applied.name, "tick_us": to_us(tick.instant)}
    values = {**key, "decision": decision, "decided_at_us": db.now_us_expr()}
    if error is not None:
        values["error"] = error[:ERROR_CHARS_MAX]
    with db.begin() as conn:
        inserted = _insert_ignore(conn, values)
        row = conn.execute(sa.select(schedule_ticks).filter_by(**key)).one()
    return _decision_of(row, new=inserted)


def _set_outcome(db: Database, decided: TickDecision, run_id: str | None, error: str | None) -> TickDecision:
    key = {"tenant": decided.tenant, "name": decided.name, "tick_us": decided.tick_us}
    with db.begin() as conn:
        if run_id is not None:
            guard = schedule_ticks.c.run_id.is_(None)
            conn.execute(sa.update(schedule_ticks).filter_by(**key).where(guard).values(run_id=run_id, error=None))
        else:
            conn.execute(sa.update(schedule_ticks).filter_by(**key).where(schedule_ticks.c.run_id.is_(None)).values(
                error=(error or "")[:ERROR_CHARS_MAX]
            ))  # fmt: skip
        row = conn.execute(sa.select(schedule_ticks).filter_by(**key)).one()
    return _decision_of(row, new=decided.new)


def tick_request(applied: AppliedSchedule, tick: Tick) -> RunRequest:
    """The run request of a tick: the pinned definition, the tick's parameters, the applied workspace."""
    access = AccessContext(
        tenant=applied.tenant, principal=applied.applied_by, roles=("operator",), auth_method="schedule"
    )
    return RunRequest(
        definition=applied.definition,
        base_dir=applied.workspace.base_dir,
        parameters=applied.spec.parameters_for(tick),
        access=access,
        provenance=Provenance(actor=applied.applied_by, trigger="schedule"),
        idempotency_key=schedule_key(applied.tenant, applied.name, tick),
        workspace=applied.workspace,
    )


class _Refusals:
    """The tick submits one evaluation saw refused. After a quota refused a tenant's tick, the evaluation
    submits nothing more for that tenant: each later tick would be refused the same way, and a tenant
    past its quota with many schedules and a long backlog of ticks must not cost every evaluator a
    submit per tick (one refused submit per tenant per evaluation, at most). A tick not tried records
    that refusal as its error, saying it was not submitted. Any other refusal belongs to its own tick (a
    key that names another request, a database that did not answer): the schedule's other ticks are
    still submitted. A schedule with a tick refused either way is due again (its ticks without a run
    tried again) at its next tick, or after :func:`retry_wait_s`, whichever comes first."""

    def __init__(self) -> None:
        self.tenants: dict[str, QuotaExceeded] = {}  # tenant -> the quota refusal that stops its submits
        self.schedules: dict[tuple[str, str], int] = {}  # (tenant, name) -> seconds to wait: another refusal

    def of(self, applied: AppliedSchedule) -> QuotaExceeded | None:
        """The quota refusal that stops this schedule's submits in this evaluation, if any."""
        return self.tenants.get(applied.tenant)

    def wait_s(self, applied: AppliedSchedule) -> int:
        """How long the schedule waits before its ticks without a run are tried again (0: at once): after
        its own refusal, or its tenant's quota refusal, which stopped its submits."""
        quota = self.of(applied)
        if quota is not None:
            return retry_wait_s(applied.spec.catchup_window_s, quota)
        return self.schedules.get((applied.tenant, applied.name), 0)

    def note(self, applied: AppliedSchedule, error: DataflowError) -> None:
        if isinstance(error, QuotaExceeded):
            self.tenants[applied.tenant] = error
        else:
            self.schedules[(applied.tenant, applied.name)] = retry_wait_s(applied.spec.catchup_window_s, None)


def retry_wait_s(catchup_window_s: int, quota: QuotaExceeded | None) -> int:
    """After a refusal: ``SUBMIT_RETRY_S``, or the quota's Retry-After when sooner, and never more than
    half the catch-up window, so the refused tick is tried again while it is still inside it."""
    wait_s = SUBMIT_RETRY_S if quota is None else min(SUBMIT_RETRY_S, quota.retry_after_s)
    return max(1, min(wait_s, catchup_window_s // 2))


def _not_tried(refused: QuotaExceeded) -> str:
    """The error of a tick not submitted because its tenant's quota refused another tick just before."""
    return f"not submitted: this evaluation met its tenant's quota already: [{refused.code}] {refused.message}"


def _submit(
    service: RunService, applied: AppliedSchedule, decided: TickDecision, refusals: _Refusals
) -> tuple[TickDecision, Run | None]:
    """Submit a submitted decision's run (idempotent by its key) and store its run id; once a quota
    refused a tick of its tenant in this evaluation, store that it was not tried instead."""
    refused = refusals.of(applied)
    if refused is not None:
        return _set_outcome(service.db, decided, None, _not_tried(refused)), None
    tick = applied.spec.tick_at(from_us(decided.tick_us))
    try:
        run = service.submit(tick_request(applied, tick)).run
    except DataflowError as error:
        _log.warning("schedule.submit_refused", tenant=applied.tenant, schedule=applied.name, tick=tick.iso,
                     error_code=error.code, error=error.message)  # fmt: skip
        refusals.note(applied, error)
        return _set_outcome(service.db, decided, None, f"[{error.code}] {error.message}"), None
    return _set_outcome(service.db, decided, run.run_id, None), run


def _previous_active(service: RunService, applied: AppliedSchedule) -> bool:
    """Is the run of the newest submitted tick still queued or running?"""
    query = (
        sa.select(schedule_ticks.c.run_id)
        .filter_by(tenant=applied.tenant, name=applied.name, decision="submitted")
        .where(schedule_ticks.c.run_id.is_not(None))
        .order_by(schedule_ticks.c.tick_us.desc())
        .limit(1)
    )
    with service.db.read() as conn:
        run_id = conn.execute(query).scalar()
        if run_id is None:
            return False
        return runs.get(conn, run_id).status in ACTIVE_STATUSES


def _unsubmitted(db: Database, applied: AppliedSchedule, since_us: int) -> list[TickDecision]:
    query = (
        sa.select(schedule_ticks)
        .filter_by(tenant=applied.tenant, name=applied.name, decision="submitted")
        .where(schedule_ticks.c.run_id.is_(None), schedule_ticks.c.tick_us >= since_us)
        .order_by(schedule_ticks.c.tick_us)
        .limit(TICKS_PER_EVALUATION_MAX)
    )
    with db.read() as conn:
        return [_decision_of(row) for row in conn.execute(query)]


def _last_decided_us(db: Database, applied: AppliedSchedule) -> int | None:
    query = sa.select(sa.func.max(schedule_ticks.c.tick_us)).filter_by(tenant=applied.tenant, name=applied.name)
    with db.read() as conn:
        value = conn.execute(query).scalar()
    return None if value is None else int(value)


def evaluate_one(service: RunService, applied: AppliedSchedule, now: dt.datetime) -> list[TickDecision]:
    """Decide the due ticks of one schedule (see the module text); the decisions touched, in tick order."""
    return _evaluate_due(service, applied, now, _Refusals())[0]


def _evaluate_due(
    service: RunService, applied: AppliedSchedule, now: dt.datetime, refusals: _Refusals
) -> tuple[list[TickDecision], int | None]:
    """The decisions touched, in tick order, and the schedule's next-due instant after them: the tick
    after the last one decided (still due when the evaluation stopped early: a waiting ``buffer_one``
    tick or ``TICKS_PER_EVALUATION_MAX``), and, while a submitted tick has no run, ``now`` (retried on
    the next evaluation, inside the catch-up window) or, after a refusal (``_Refusals``), the refusal's
    wait from ``now``."""
    if not applied.active:
        return [], None
    db = service.db
    window_start_us = to_us(now) - applied.spec.catchup_window_s * US_PER_S
    touched: list[TickDecision] = []
    unsubmitted_left = False
    for pending in _unsubmitted(db, applied, window_start_us):  # an evaluator died, or a submit was refused
        if refusals.of(applied) is not None:
            unsubmitted_left = True  # left as it is: tried again once the schedule is due again
            break
        touched.append(_submit(service, applied, pending, refusals)[0])
    last_us = _last_decided_us(db, applied)
    start_us = max(applied.applied_at_us, last_us if last_us is not None else applied.applied_at_us)
    due = applied.spec.ticks(from_us(start_us), now, TICKS_PER_EVALUATION_MAX)
    previous_active = _previous_active(service, applied)
    decided_up_to_us = start_us
    for index, tick in enumerate(due):
        decision: Decision
        if to_us(tick.instant) < window_start_us:
            decision = "skipped_catchup"
        elif not previous_active or applied.spec.overlap == "allow":
            decision = "submitted"
        elif applied.spec.overlap == "buffer_one" and index == len(due) - 1:
            break  # the newest due tick waits, undecided, for the previous run to finish
        else:
            decision = "skipped_overlap"
        refused = refusals.of(applied) if decision == "submitted" else None
        not_tried = None if refused is None else _not_tried(refused)
        decided = _decide(db, applied, tick, decision, not_tried)  # a tick not tried: one write, not two
        decided_up_to_us = decided.tick_us
        if decided.decision == "submitted":
            run: Run | None = None
            if decided.run_id is not None:
                run = service.get(decided.run_id)
            elif not (decided.new and not_tried is not None):  # else recorded not tried, with its error
                decided, run = _submit(service, applied, decided, refusals)
            previous_active = run is not None and run.status in ACTIVE_STATUSES
        touched.append(decided)
    due_us = next_due_us(applied.spec, applied.paused, decided_up_to_us)
    if unsubmitted_left or any(d.decision == "submitted" and d.run_id is None for d in touched):
        retry_us = to_us(now) + refusals.wait_s(applied) * US_PER_S
        due_us = retry_us if due_us is None else min(due_us, retry_us)
    return touched, due_us


@dataclass(frozen=True)
class Evaluation:
    decisions: list[TickDecision]
    errors: list[dict[str, str]]  # schedules whose evaluation failed: tenant, name, code, message
    # False when the evaluation stopped at its time budget with schedules still due (evaluate's budget_s):
    # they are the first ones the next evaluation reads.
    complete: bool = True

    def as_json(self) -> dict[str, Any]:
        return {"decisions": [d.as_json() for d in self.decisions], "errors": self.errors}


def evaluate(
    db: Database,
    service: RunService,
    now: dt.datetime | None = None,
    *,
    tenant: str | None = None,
    budget_s: float | None = None,
) -> Evaluation:
    """One evaluation of every due schedule (of ``tenant``, or all) at ``now`` (else the database clock):
    page after page of ``EVALUATION_PAGE_SCHEDULES``, by next-due instant, until none is left due. With
    ``budget_s`` (a worker's: its claims wait while it evaluates) it stops once that many seconds have
    passed after a schedule's evaluation, ``complete`` False; the schedules not reached stay due, the
    earliest first, so the next evaluation starts with them."""
    moment = _now_or_db(db, now)
    evaluation = Evaluation([], [])
    evaluated: set[tuple[str, str]] = set()
    refusals = _Refusals()
    deadline = None if budget_s is None else time.monotonic() + budget_s
    after: tuple[int, str, str] | None = None
    while True:  # bounded: each page moves the cursor past its rows, and only due rows are read
        page = _due_page(db, to_us(moment), tenant, after)
        for applied in page:
            # A schedule still due after its evaluation (a waiting tick) may be met again further on.
            if (applied.tenant, applied.name) not in evaluated:
                if deadline is not None and evaluated and time.monotonic() >= deadline:
                    return Evaluation(evaluation.decisions, evaluation.errors, complete=False)
                evaluated.add((applied.tenant, applied.name))
                _evaluate_into(evaluation, service, applied, moment, refusals)
        if len(page) < EVALUATION_PAGE_SCHEDULES:
            return evaluation
        last = page[-1]
        invariant(last.next_due_us is not None, "a due schedule has a next-due instant")
        after = (cast(int, last.next_due_us), last.tenant, last.name)


def _evaluate_into(
    evaluation: Evaluation, service: RunService, applied: AppliedSchedule, now: dt.datetime, refusals: _Refusals
) -> None:
    """Evaluate one schedule and store its next-due instant; its error is the evaluation's entry (it
    stays due, so each evaluation reports it) and never stops the other schedules."""
    try:
        touched, due_us = _evaluate_checked(service, applied, now, refusals)
    except DataflowError as error:
        evaluation.errors.append(
            {"tenant": applied.tenant, "name": applied.name, "code": error.code, "message": error.message}
        )
        _log.warning("schedule.evaluation_failed", tenant=applied.tenant, schedule=applied.name,
                     error_code=error.code, error=error.message)  # fmt: skip
        return
    evaluation.decisions.extend(touched)
    _store_next_due(service.db, applied, due_us)


def _evaluate_checked(
    service: RunService, applied: AppliedSchedule, now: dt.datetime, refusals: _Refusals
) -> tuple[list[TickDecision], int | None]:
    """``_evaluate_due``, where a stored cron that matches no date (applied before apply refused it) is
    that schedule's InputError: it never stops the evaluation of the other schedules."""
    try:
        return _evaluate_due(service, applied, now, refusals)
    except CroniterError:
        raise no_date_refusal(applied.spec) from None


def _next_tick(spec: ScheduleSpec, after: dt.datetime) -> Tick | None:
    try:
        return spec.next_tick(after)
    except CroniterError:  # a stored cron that matches no date has no next tick
        return None


# ---- what `schedules list` shows ---------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleStatus:
    applied: AppliedSchedule
    next_tick: Tick | None
    last: TickDecision | None  # the newest decision
    last_submitted: TickDecision | None  # the newest submitted tick, whose run is last_run
    last_run: Run | None

    def as_json(self, warning: str | None, unresolved: bool) -> dict[str, Any]:
        run = self.last_run
        return {
            **self.applied.as_json(),
            "next_tick": self.next_tick.iso if self.next_tick is not None else None,
            "last_tick": self.last.tick if self.last is not None else None,
            "last_decision": self.last.decision if self.last is not None else None,
            "last_error": self.last.error if self.last is not None else None,
            "last_run_tick": self.last_submitted.tick if self.last_submitted is not None else None,
            "last_run_id": run.run_id if run is not None else None,
            "last_run_status": str(run.status) if run is not None else None,
            "last_run_recovery_status": str(run.recovery_status) if run is not None else None,
            "unresolved": unresolved,
            "warning": warning,
        }


def statuses(
    db: Database, tenant: str | None, now: dt.datetime | None = None, *,
    after: tuple[str, str] | None = None, limit: int = LIST_PAGE_MAX,
) -> Iterator[ScheduleStatus]:  # fmt: skip
    """Each applied schedule of one page (``list_applied``) with its next tick, its newest decision and
    that decision's run."""
    moment = _now_or_db(db, now)
    for applied in list_applied(db, tenant, after=after, limit=limit):
        yield status_of(db, applied, moment)


def status_of(db: Database, applied: AppliedSchedule, now: dt.datetime) -> ScheduleStatus:
    newest = decisions(db, applied.tenant, applied.name, limit=1)
    last = newest[0] if newest else None
    start = max(now, from_us(applied.applied_at_us))
    next_tick = _next_tick(applied.spec, start) if applied.active else None
    submitted = _newest_submitted(db, applied)
    run = None
    if submitted is not None and submitted.run_id is not None:
        with db.read() as conn:
            run = runs.get(conn, submitted.run_id)
    return ScheduleStatus(applied, next_tick, last, submitted, run)


@dataclass(frozen=True)
class ShownSchedule:
    """A schedule's status with its last run as readers show it (``views.load``: the lease read on the
    database clock, so an unresolved run says UNRESOLVED with its warning)."""

    status: ScheduleStatus
    view: views.RunView | None  # the view of status.last_run

    @property
    def unresolved(self) -> bool:
        return self.view is not None and self.view.unresolved

    def as_json(self) -> dict[str, Any]:
        """One item of `schedules list --json` and of GET /v1/schedules."""
        return self.status.as_json(self.view.warning if self.view is not None else None, self.unresolved)


@dataclass(frozen=True)
class ShownPage:
    """One page of ``schedules list`` and GET /v1/schedules, by tenant and name."""

    items: list[ShownSchedule]
    more: bool  # schedules follow the last one shown: ask again after it

    @property
    def next_after(self) -> tuple[str, str] | None:
        """The ``(tenant, name)`` to list after for the next page; None on the last page."""
        if not self.more or not self.items:
            return None
        applied = self.items[-1].status.applied
        return applied.tenant, applied.name


def shown_page(
    db: Database, tenant: str | None, now: dt.datetime | None = None, *,
    after: tuple[str, str] | None = None, limit: int = LIST_PAGE_DEFAULT,
) -> ShownPage:  # fmt: skip
    """At most ``limit`` schedules of ``tenant`` (None: all) after the ``(tenant, name)`` cursor, with
    their last runs' views, and whether more follow."""
    if not 1 <= limit <= LIST_PAGE_MAX:
        raise InputError(f"the page size must be between 1 and {LIST_PAGE_MAX}, got {limit}")
    if after is not None and (_NAME.fullmatch(after[1]) is None or not after[0].isprintable()):
        raise InputError("the cursor names no schedule: give the tenant and name the previous page named")
    found = list(statuses(db, tenant, now, after=after, limit=limit + 1))
    return ShownPage(_with_views(db, found[:limit]), more=len(found) > limit)


def shown(
    db: Database, tenant: str | None, now: dt.datetime | None = None, *, name: str | None = None
) -> list[ShownSchedule]:
    """The first ``LIST_PAGE_MAX`` schedules of ``tenant`` (None: all; the web view), or only the one
    called ``name`` (NotFound when the tenant has none), with its last run's view."""
    if name is None:
        return shown_page(db, tenant, now, limit=LIST_PAGE_MAX).items
    invariant(tenant is not None, "a schedule is named within its tenant")
    return _with_views(db, [status_of(db, get(db, str(tenant), name), _now_or_db(db, now))])


def _with_views(db: Database, found: list[ScheduleStatus]) -> list[ShownSchedule]:
    with db.read() as conn:
        loaded = views.load(conn, db, [s.last_run for s in found if s.last_run is not None])
    by_run = {view.run.run_id: view for view in loaded}
    return [ShownSchedule(s, by_run.get(s.last_run.run_id) if s.last_run is not None else None) for s in found]


def _newest_submitted(db: Database, applied: AppliedSchedule) -> TickDecision | None:
    query = (
        sa.select(schedule_ticks)
        .filter_by(tenant=applied.tenant, name=applied.name, decision="submitted")
        .order_by(schedule_ticks.c.tick_us.desc())
        .limit(1)
    )
    with db.read() as conn:
        row = conn.execute(query).first()
    return None if row is None else _decision_of(row)



def oldest_due_us(conn: Connection) -> int | None:
    """The earliest next-due instant of any schedule (None when no schedule is due ever): one probe of
    ``ix_schedules_next_due``. A due instant in the past is work no evaluation has done yet: the metrics'
    schedule lag."""
    value = conn.execute(sa.select(sa.func.min(schedules.c.next_due_us))).scalar()
    return None if value is None else int(value)
