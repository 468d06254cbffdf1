"""Partition status (issue 27, docs/operations.md "Partition status"): per partition value of one
tenant's partitioned datasource, its current publication and what is pending after it.

The **current publication** of a partition is its succeeded run with the highest partition token
(``dataflow.protocol.partition_tokens``; the token each run's ``dispatch.authorized`` took): the sink applied
that run's rows last and refuses any lower token, so it is exactly what the partition holds. A run
refused as superseded, or a succeeded run a later token replaced, is not current. **After it** are
the partition's runs that are queued, running, unresolved or failed and either were created after the
current publication's run or took a higher token (with no current publication: all of them); a
cancelled run is never shown. For a date partition the days of the range without any run or
publication are shown **missing** too. The CLI (``dataflow partitions``), the JSON API and the page
all read this one module, so they cannot disagree; the run states come from ``dataflow.protocol.views`` (the one
definition of unresolved).
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError, NotFound
from durable_dataflow.dataflow.definitions import catalog
from durable_dataflow.dataflow.definitions import parameters as parameters_mod
from durable_dataflow.dataflow.definitions.definitions import Definition, partition_column_kind
from durable_dataflow.dataflow.protocol import evidence, partition_tokens, runs, views
from durable_dataflow.dataflow.protocol.runs import MODULE, Run, RunStatus
from durable_dataflow.datasources import registry

# The widest range of days whose missing ones a status lists.
PARTITION_DAYS_MAX = 3660
# How refusals name the bounds: the CLI's options, or the API's and the page's query fields.
CLI_BOUNDS = ("--from", "--to")
API_BOUNDS = ("from", "to")


class PartitionState(enum.StrEnum):
    PUBLISHED = "published"  # the partition has a current publication
    MISSING = "missing"  # no run of the partition has published it (or, for a date, none exists at all)


class PendingState(enum.StrEnum):
    QUEUED = "queued"  # recorded, waiting for a worker
    RUNNING = "running"  # an attempt holds the lease
    UNRESOLVED = "unresolved"  # external output may exist: reconcile (or verify) it
    FAILED = "failed"  # failed (no external output), including a publication refused as superseded


@dataclass(frozen=True)
class Publication:
    """The run whose rows the partition holds."""

    run: Run
    partition_token: int | None

    def as_json(self) -> dict[str, Any]:
        run = self.run
        return {
            "run_id": run.run_id, "idempotency_key": run.idempotency_key, "definition_hash": run.definition_hash,
            "output_digest": run.output_digest, "row_count": run.row_count, "published_at_us": run.updated_at_us,
            "partition_token": self.partition_token,
        }  # fmt: skip


@dataclass(frozen=True)
class Pending:
    """A run of the partition after its current publication, and what it is now."""

    view: views.RunView
    state: PendingState

    def as_json(self) -> dict[str, Any]:
        run = self.view.run
        return {
            "run_id": run.run_id, "idempotency_key": run.idempotency_key, "state": str(self.state),
            "status": str(run.status), "recovery_status": str(run.recovery_status),
            "unresolved": self.view.unresolved, "definition_hash": run.definition_hash,
            "created_at_us": run.created_at_us, "error_code": run.error_code, "warning": self.view.warning,
        }  # fmt: skip


@dataclass(frozen=True)
class PartitionStatus:
    partition: dict[str, Any]  # column -> canonical value
    current: Publication | None
    pending: tuple[Pending, ...]

    @property
    def state(self) -> PartitionState:
        return PartitionState.PUBLISHED if self.current is not None else PartitionState.MISSING

    @property
    def label(self) -> str:
        """The partition as one text: the value of a one-column partition, else ``col=value`` pairs."""
        if len(self.partition) == 1:
            return _value_text(next(iter(self.partition.values())))
        return " ".join(f"{column}={_value_text(value)}" for column, value in sorted(self.partition.items()))

    def as_json(self) -> dict[str, Any]:
        return {
            "partition": dict(self.partition), "state": str(self.state),
            "current": self.current.as_json() if self.current is not None else None,
            "after": [p.as_json() for p in self.pending],
        }  # fmt: skip


@dataclass(frozen=True)
class Range:
    """The ``--from``/``--to`` bounds (included), as canonical values of the one partition column."""

    column: str
    kind: str
    first: Any | None
    last: Any | None


@dataclass(frozen=True)
class DatasourceStatus:
    tenant: str
    datasource: str
    columns: tuple[str, ...]
    partitions: tuple[PartitionStatus, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "datasource": self.datasource, "tenant": self.tenant, "columns": list(self.columns),
            "partitions": [p.as_json() for p in self.partitions],
        }  # fmt: skip


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def status(
    conn: Connection,
    db: Database,
    tenant: str,
    datasource: str,
    first: str | None = None,
    last: str | None = None,
    names: tuple[str, str] = CLI_BOUNDS,
) -> DatasourceStatus:
    """The partitions of the tenant's ``datasource`` (every one, or those from ``first`` to ``last``,
    given as text in the partition column's type; refusals call them ``names``). NotFound when the
    tenant has no partitioned run of it: another tenant's datasource is unknown to this one."""
    registry.check_name_text(datasource)
    found = runs.partitioned_runs(conn, tenant, datasource)
    if not found:
        named = repr(datasource) if registry.NAME_PATTERN.match(datasource) else "(the name given)"
        raise NotFound(f"tenant {tenant} has no partitioned runs of datasource {named}")
    columns = tuple(sorted({column for _, values in found if values for column in values}))
    bounds = _range(conn, found[0][0], columns, (first, last), names)
    by_partition: dict[str, tuple[dict[str, Any], list[Run]]] = {}
    for run, values in found:
        if values is None or (bounds is not None and not _inside(bounds, values)):
            continue
        by_partition.setdefault(_identity(values), (values, []))[1].append(run)
    every = [run for _, group in by_partition.values() for run in group]
    tokens = _tokens(conn, every)
    shown = _views(conn, db, [run for run in every if run.status not in _NEVER_PENDING])
    partitions = [_one(values, group, tokens, shown) for values, group in by_partition.values()]
    if bounds is not None and bounds.kind == "date":
        partitions += _missing_days(partitions, bounds)
    partitions.sort(key=lambda p: _sort_key(p.partition))
    return DatasourceStatus(tenant, datasource, columns, tuple(partitions))


# A succeeded run is current or replaced, a cancelled one published nothing: neither is ever pending.
_NEVER_PENDING = frozenset({RunStatus.SUCCEEDED, RunStatus.CANCELLED})


def _views(conn: Connection, db: Database, items: Sequence[Run]) -> dict[str, views.RunView]:
    """The runs as shown (``views.load``), read in pages of at most the runs one lease query may name."""
    page = leases.EXPIRY_SUBJECTS_MAX
    shown: dict[str, views.RunView] = {}
    for start in range(0, len(items), page):
        shown.update((view.run.run_id, view) for view in views.load(conn, db, items[start : start + page]))
    return shown


def _identity(values: Mapping[str, Any]) -> str:
    return partition_tokens.partition_digest(values)


def _tokens(conn: Connection, items: Sequence[Run]) -> dict[str, int]:
    """Each authorized run's partition token, from its first ``dispatch.authorized`` (the ledger)."""
    payloads = ledger.first_payloads_of_kind(conn, MODULE, [r.run_id for r in items], evidence.DISPATCH_AUTHORIZED)
    taken = {run_id: payload.get(partition_tokens.PARTITION_TOKEN) for run_id, payload in payloads.items()}
    return {run_id: token for run_id, token in taken.items() if isinstance(token, int)}


def _one(
    values: dict[str, Any], group: list[Run], tokens: Mapping[str, int], shown: Mapping[str, views.RunView]
) -> PartitionStatus:
    """One partition's status from its runs (newest first)."""
    succeeded = [run for run in group if run.status == RunStatus.SUCCEEDED]
    current_run = max(succeeded, key=lambda r: (tokens.get(r.run_id, -1), r.created_at_us, r.run_id), default=None)
    current = Publication(current_run, tokens.get(current_run.run_id)) if current_run is not None else None
    pending = []
    for run in group:
        view = shown.get(run.run_id)
        state = _pending_state(view) if view is not None else None
        if view is not None and state is not None and (current is None or _after(run, current, tokens)):
            pending.append(Pending(view, state))
    return PartitionStatus(values, current, tuple(pending))


def _after(run: Run, current: Publication, tokens: Mapping[str, int]) -> bool:
    """Created after the current publication's run, authorized with a higher token than it took, or not
    authorized yet while it may still be (queued or running: its token, when taken, will be higher)."""
    later = (run.created_at_us, run.run_id) > (current.run.created_at_us, current.run.run_id)
    token = tokens.get(run.run_id)
    if token is None:
        return later or run.status in (RunStatus.QUEUED, RunStatus.RUNNING)
    return later or (current.partition_token is not None and token > current.partition_token)


def _pending_state(view: views.RunView) -> PendingState | None:
    """What a run not current shows as; None for one never shown (succeeded, cancelled)."""
    if view.unresolved:
        return PendingState.UNRESOLVED
    return {
        RunStatus.QUEUED: PendingState.QUEUED,
        RunStatus.RUNNING: PendingState.RUNNING,
        RunStatus.FAILED: PendingState.FAILED,
    }.get(view.run.status)


def _range(
    conn: Connection,
    newest: Run,
    columns: tuple[str, ...],
    given: tuple[str | None, str | None],
    names: tuple[str, str],
) -> Range | None:
    """The bounds (either may be None), typed by the partition column's type in the newest run's
    definition; None for a datasource partitioned by several columns (refused with bounds given)."""
    first, last = given
    if len(columns) != 1:
        if first is None and last is None:
            return None
        raise InputError(f"{names[0]} and {names[1]} apply to a datasource partitioned by one column; this one has "
                         f"{len(columns)} ({', '.join(columns)})")  # fmt: skip
    column = columns[0]
    body = catalog.definition_body(conn, newest.definition_hash)
    kind = partition_column_kind(Definition.model_validate(json.loads(body)), column) if body else None
    if kind is None:
        if first is None and last is None:
            return None
        raise InputError(f"the type of partition column {column!r} is not known: {names[0]} and {names[1]} "
                         "cannot be compared")  # fmt: skip
    return Range(column, kind, _bound(kind, column, first, names[0]), _bound(kind, column, last, names[1]))


def _bound(kind: str, column: str, text: str | None, option: str) -> Any | None:
    if text is None:
        return None
    try:
        return parameters_mod.coerce(kind, text)
    except parameters_mod.ParameterValueError:
        example = " (YYYY-MM-DD)" if kind == "date" else ""
        raise InputError(f"{option} must be a {kind}{example}: partition column {column!r} has that type") from None


def _comparable(kind: str, value: Any) -> Any:
    """A canonical value in an order that matches its type's (a decimal by its number)."""
    if kind == "decimal":
        try:
            return decimal.Decimal(str(value))
        except decimal.InvalidOperation:
            return decimal.Decimal(0)
    return value


def _inside(bounds: Range, values: Mapping[str, Any]) -> bool:
    value = values.get(bounds.column)
    if value is None:
        return False
    try:
        here = _comparable(bounds.kind, value)
        if bounds.first is not None and here < _comparable(bounds.kind, bounds.first):
            return False
        return bounds.last is None or here <= _comparable(bounds.kind, bounds.last)
    except TypeError:  # a value of another type (a definition that changed the column's type)
        return False


def _missing_days(partitions: list[PartitionStatus], bounds: Range) -> list[PartitionStatus]:
    """For a one-column date partition: every day of the range (from ``--from``, else the first day
    seen, to ``--to``, else the last day seen) with no run at all, as a missing partition."""
    seen = {day for p in partitions if (day := _day(p.partition.get(bounds.column))) is not None}
    first = _day(bounds.first) if bounds.first is not None else min(seen, default=None)
    last = _day(bounds.last) if bounds.last is not None else max(seen, default=None)
    if first is None or last is None or last < first:
        return []
    count = (last - first).days + 1
    if count > PARTITION_DAYS_MAX:
        raise InputError(f"a partition status lists the missing days of at most {PARTITION_DAYS_MAX} days; "
                         f"this range has {count}: narrow it")  # fmt: skip
    every = (first + dt.timedelta(days=offset) for offset in range(count))
    return [PartitionStatus({bounds.column: day.isoformat()}, None, ()) for day in every if day not in seen]


def _day(value: Any) -> dt.date | None:
    if not isinstance(value, str) or len(value) != len("YYYY-MM-DD"):
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        return None


def _sort_key(values: Mapping[str, Any]) -> tuple[tuple[str, str, Any], ...]:
    """Partitions in the order of their values, column by column (a type name first keeps mixed types
    comparable; numbers compare as numbers)."""
    key = []
    for column, value in sorted(values.items()):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        key.append((column, "0" if number else type(value).__name__, value if number else str(value)))
    return tuple(key)


def current_publications(
    conn: Connection, db: Database, tenant: str, datasource: str
) -> dict[str, Publication]:
    """The current publication of each published partition (by ``partition_tokens.partition_digest``)
    of the tenant's datasource; empty when the tenant has no partitioned run of it (a backfill's
    ``--only-missing`` reads this)."""
    try:
        found = status(conn, db, tenant, datasource)
    except NotFound:
        return {}
    return {_identity(p.partition): p.current for p in found.partitions if p.current is not None}
