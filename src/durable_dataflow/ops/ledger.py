"""The platform-wide ledger projection: every module's subjects, entries, leases and checkpoints,
the Dataflow runs by status and recovery status, and the unresolved runs with their ages.

Read-only by construction: every function here takes a connection from ``Database.read()`` and
only selects. Ops never reconciles and never changes a run; it shows what the ledger says. All
of Ops' SQL is in this module. Ages use the database clock, as leases do, never this host's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from durable_dataflow.core.db import Database
from durable_dataflow.core.schema import checkpoints, leases, ledger_entries
from durable_dataflow.dataflow.runs import MODULE as DATAFLOW_MODULE
from durable_dataflow.dataflow.runs import UNRESOLVED_RECOVERY, from_row, unresolved_warning
from durable_dataflow.dataflow.schema import dataflow_runs, definitions

UNRESOLVED_SHOWN_MAX = 100
DEFINITIONS_LISTED_MAX = 1000
US_PER_S = 1_000_000


@dataclass(frozen=True)
class ModuleCounts:
    """One module's footprint in Core's tables."""

    module: str
    subjects: int  # distinct subjects with ledger entries
    entries: int | None  # None unless counted on request: it scans the whole ledger
    checkpoints: int
    leases_live: int  # held and unexpired (database clock)
    leases_expired: int  # held, expired, not yet swept


@dataclass(frozen=True)
class UnresolvedRun:
    """An unresolved run and what an operator needs to act on it."""

    module: str
    run_id: str
    tenant: str
    definition_name: str
    status: str
    recovery_status: str
    attempt: int
    idempotency_key: str
    publication_idempotency_key: str | None
    output_digest: str | None
    warning: str
    created_at_us: int
    updated_at_us: int
    age_s: float  # since the run was recorded
    unresolved_for_s: float  # since its last state change


@dataclass(frozen=True)
class LedgerProjection:
    """The Ops view. ``tenant`` None means platform-wide."""

    tenant: str | None
    now_us: int
    modules: list[ModuleCounts]
    runs_by_status: dict[str, int]
    runs_by_recovery_status: dict[str, int]
    unresolved_total: int
    unresolved: list[UnresolvedRun] = field(default_factory=list)
    oldest_unresolved: UnresolvedRun | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _dataflow_subjects(tenant: str) -> sa.Select[tuple[str]]:
    return sa.select(dataflow_runs.c.run_id).where(dataflow_runs.c.tenant == tenant)


def _grouped_counts(conn: Connection, table: sa.Table, tenant: str | None, *extra: Any) -> dict[str, int]:
    query = sa.select(table.c.module, sa.func.count()).group_by(table.c.module)
    for condition in extra:
        query = query.where(condition)
    if tenant is not None:
        query = query.where(table.c.module == DATAFLOW_MODULE, table.c.subject_id.in_(_dataflow_subjects(tenant)))
    return {str(module): int(count) for module, count in conn.execute(query)}


def _subject_and_entry_counts(
    conn: Connection, tenant: str | None, *, count_entries: bool, skip_dataflow: bool
) -> dict[str, tuple[int, int | None]]:
    """Subjects per module are their first entries (seq 1, a small partial index). Counting every
    entry scans the whole ledger, so it is done only on request. ``skip_dataflow`` leaves Dataflow
    out when its subjects are already known (its runs)."""
    if skip_dataflow and tenant is not None:
        return {}  # a tenant's view holds Dataflow subjects only, and those are already known
    first = ledger_entries.c.seq == 1
    if count_entries:
        query = sa.select(ledger_entries.c.module, sa.func.count().filter(first), sa.func.count())
    else:
        query = sa.select(ledger_entries.c.module, sa.func.count(), sa.null()).where(first)
    if skip_dataflow:
        query = query.where(ledger_entries.c.module != DATAFLOW_MODULE)
    if tenant is not None:
        query = query.where(
            ledger_entries.c.module == DATAFLOW_MODULE, ledger_entries.c.subject_id.in_(_dataflow_subjects(tenant))
        )
    rows = conn.execute(query.group_by(ledger_entries.c.module)).all()
    return {str(m): (int(n), None if e is None else int(e)) for m, n, e in rows}


def _lease_counts(conn: Connection, db: Database, tenant: str | None) -> dict[str, tuple[int, int]]:
    """Held leases per module, live and expired on the database clock, in one pass over held leases."""
    now = db.now_us_expr()
    live = sa.func.count().filter(leases.c.expires_at_us > now)
    expired = sa.func.count().filter(leases.c.expires_at_us <= now)
    query = (
        sa.select(leases.c.module, live, expired)
        .where(leases.c.released_at_us.is_(None))
        .group_by(leases.c.module)
    )
    if tenant is not None:  # few leases are held: join them to their runs rather than list the tenant's runs
        query = query.join(dataflow_runs, dataflow_runs.c.run_id == leases.c.subject_id).where(
            leases.c.module == DATAFLOW_MODULE, dataflow_runs.c.tenant == tenant
        )
    return {str(m): (int(a), int(b)) for m, a, b in conn.execute(query)}


def module_counts(
    conn: Connection,
    db: Database,
    tenant: str | None = None,
    *,
    count_entries: bool = False,
    dataflow_runs_total: int | None = None,
) -> list[ModuleCounts]:
    """Per module: subjects, checkpoints and leases from Core's tables (entries only on request).

    Every dataflow run has exactly one chain (recorded in the run's own submit transaction), so
    the number of runs, when the caller has it, is Dataflow's subject count.
    """
    known = dataflow_runs_total is not None and not count_entries
    subjects = _subject_and_entry_counts(conn, tenant, count_entries=count_entries, skip_dataflow=known)
    if known and dataflow_runs_total:
        subjects[DATAFLOW_MODULE] = (int(dataflow_runs_total), None)
    checkpoint_counts = _grouped_counts(conn, checkpoints, tenant)
    held = _lease_counts(conn, db, tenant)
    names = sorted(set(subjects) | set(checkpoint_counts) | set(held))
    return [
        ModuleCounts(
            module=name,
            subjects=subjects.get(name, (0, None))[0],
            entries=subjects.get(name, (0, 0 if count_entries else None))[1],
            checkpoints=checkpoint_counts.get(name, 0),
            leases_live=held.get(name, (0, 0))[0],
            leases_expired=held.get(name, (0, 0))[1],
        )
        for name in names
    ]


def _run_counts(conn: Connection, column: sa.Column[Any], tenant: str | None) -> dict[str, int]:
    query = sa.select(column, sa.func.count()).group_by(column).order_by(column)
    if tenant is not None:
        query = query.where(dataflow_runs.c.tenant == tenant)
    return {str(value): int(count) for value, count in conn.execute(query)}


def runs_by_status(conn: Connection, tenant: str | None = None) -> dict[str, int]:
    return _run_counts(conn, dataflow_runs.c.status, tenant)


def runs_by_recovery_status(conn: Connection, tenant: str | None = None) -> dict[str, int]:
    return _run_counts(conn, dataflow_runs.c.recovery_status, tenant)


def ledger_kind_counts(conn: Connection) -> dict[str, int]:
    """Platform-wide count of Dataflow ledger entries per kind (attempt outcomes for /metrics)."""
    query = (
        sa.select(ledger_entries.c.kind, sa.func.count())
        .where(ledger_entries.c.module == DATAFLOW_MODULE)
        .group_by(ledger_entries.c.kind)
    )
    return {str(kind): int(count) for kind, count in conn.execute(query)}


def _unresolved_where(tenant: str | None) -> list[sa.ColumnElement[bool]]:
    conditions: list[sa.ColumnElement[bool]] = [dataflow_runs.c.recovery_status.in_(sorted(UNRESOLVED_RECOVERY))]
    if tenant is not None:
        conditions.append(dataflow_runs.c.tenant == tenant)
    return conditions


def unresolved_runs(
    conn: Connection, now_us: int, tenant: str | None = None, limit: int = UNRESOLVED_SHOWN_MAX
) -> tuple[int, list[UnresolvedRun]]:
    """The total number of unresolved runs, and the oldest ``limit`` of them, oldest first."""
    where = _unresolved_where(tenant)
    total = int(conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs).where(*where)).scalar_one())
    rows = conn.execute(
        sa.select(dataflow_runs)
        .where(*where)
        .order_by(dataflow_runs.c.created_at_us, dataflow_runs.c.run_id)
        .limit(max(1, min(limit, UNRESOLVED_SHOWN_MAX)))
    ).all()
    found = []
    for row in rows:
        run = from_row(row)
        found.append(
            UnresolvedRun(
                module=DATAFLOW_MODULE,
                run_id=run.run_id,
                tenant=run.tenant,
                definition_name=run.definition_name,
                status=run.status,
                recovery_status=run.recovery_status,
                attempt=run.attempt,
                idempotency_key=run.idempotency_key,
                publication_idempotency_key=run.publication_idempotency_key,
                output_digest=run.output_digest,
                warning=run.warning or unresolved_warning(run),
                created_at_us=run.created_at_us,
                updated_at_us=run.updated_at_us,
                age_s=max(0, now_us - run.created_at_us) / US_PER_S,
                unresolved_for_s=max(0, now_us - run.updated_at_us) / US_PER_S,
            )
        )
    return total, found


def _status_pairs(conn: Connection, tenant: str | None) -> tuple[dict[str, int], dict[str, int]]:
    """Runs by status and by recovery status from ONE grouped scan of the projection."""
    query = sa.select(dataflow_runs.c.status, dataflow_runs.c.recovery_status, sa.func.count()).group_by(
        dataflow_runs.c.status, dataflow_runs.c.recovery_status
    )
    if tenant is not None:
        query = query.where(dataflow_runs.c.tenant == tenant)
    by_status: dict[str, int] = {}
    by_recovery: dict[str, int] = {}
    for status, recovery, count in conn.execute(query):
        by_status[str(status)] = by_status.get(str(status), 0) + int(count)
        by_recovery[str(recovery)] = by_recovery.get(str(recovery), 0) + int(count)
    return dict(sorted(by_status.items())), dict(sorted(by_recovery.items()))


def projection(
    conn: Connection, db: Database, tenant: str | None = None, *, count_entries: bool = False
) -> LedgerProjection:
    """The whole Ops view in one read transaction (one consistent snapshot on PostgreSQL)."""
    now_us = db.now_us(conn)
    total, unresolved = unresolved_runs(conn, now_us, tenant)
    by_status, by_recovery = _status_pairs(conn, tenant)
    runs_total = sum(by_status.values())
    return LedgerProjection(
        tenant=tenant,
        now_us=now_us,
        modules=module_counts(conn, db, tenant, count_entries=count_entries, dataflow_runs_total=runs_total),
        runs_by_status=by_status,
        runs_by_recovery_status=by_recovery,
        unresolved_total=total,
        unresolved=unresolved,
        oldest_unresolved=unresolved[0] if unresolved else None,
    )


def read_projection(db: Database, tenant: str | None = None, *, count_entries: bool = False) -> LedgerProjection:
    with db.read() as conn:
        return projection(conn, db, tenant, count_entries=count_entries)


# ---- the definitions catalogue (read-only, tenant-scoped) ---------------------------------------


@dataclass(frozen=True)
class DefinitionSummary:
    definition_hash: str
    name: str
    version: int
    registered_at_us: int
    runs: int  # runs of the tenant that pinned it


def _tenant_definitions(tenant: str) -> sa.Select[Any]:
    """A tenant's definitions with its own first use as their registration time: the platform-wide
    time would tell a tenant that (and when) another tenant ran the same definition first."""
    return (
        sa.select(
            definitions.c.definition_hash,
            definitions.c.name,
            definitions.c.version,
            sa.func.min(dataflow_runs.c.created_at_us).label("registered_at_us"),
            sa.func.count(dataflow_runs.c.run_id).label("runs"),
        )
        .join(dataflow_runs, dataflow_runs.c.definition_hash == definitions.c.definition_hash)
        .where(dataflow_runs.c.tenant == tenant)
        .group_by(definitions.c.definition_hash, definitions.c.name, definitions.c.version)
    )


def list_definitions(conn: Connection, tenant: str) -> list[DefinitionSummary]:
    """The pinned definitions a tenant's runs used: a tenant never sees another tenant's SQL."""
    query = _tenant_definitions(tenant).order_by(definitions.c.name, definitions.c.version.desc())
    rows = conn.execute(query.limit(DEFINITIONS_LISTED_MAX)).all()
    return [DefinitionSummary(str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows]


def definition_body(conn: Connection, tenant: str, definition_hash: str) -> str | None:
    """The canonical body of a pinned definition the tenant has used, else None."""
    visible = _tenant_definitions(tenant).where(definitions.c.definition_hash == definition_hash)
    if conn.execute(visible).first() is None:
        return None
    body = conn.execute(
        sa.select(definitions.c.body_json).where(definitions.c.definition_hash == definition_hash)
    ).scalar_one_or_none()
    return None if body is None else str(body)
