"""The platform-wide ledger projection: every module's subjects, entries, leases and checkpoints,
the Dataflow runs by status and recovery status, and the unresolved runs with their ages (unresolved
as every read view shows it: ``dataflow.protocol.views``, one definition).

Read-only by construction: every function here takes a connection from ``Database.read()`` and
only selects. Ops never reconciles and never changes a run; it shows what the ledger says. Ops
builds no query itself: each table's statements live in the module that owns it (``core.ledger``,
``core.leases``, ``core.checkpoints``, ``dataflow.protocol.runs``, ``dataflow.definitions.catalog``) and Ops composes
them. Ages use the database clock, as leases do, never this host's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from durable_dataflow.core import checkpoints, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.protocol import runs, views
from durable_dataflow.dataflow.protocol.runs import MODULE as DATAFLOW_MODULE
from durable_dataflow.dataflow.protocol.runs import unresolved_warning

UNRESOLVED_SHOWN_MAX = 100
DEFINITIONS_LISTED_MAX = 1000
RECENT_FAILURES_WINDOW_S = 24 * 3600  # how far back the Ops views count failed runs by error code


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
class RunStateCount:
    """How many runs are in one (status, recovery status) pair."""

    status: str
    recovery_status: str
    runs: int


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
    # Each (status, recovery status) pair with its runs: cancelled and failed share no_external_output.
    runs_by_state: list[RunStateCount] = field(default_factory=list)
    # Failed runs recorded in the last RECENT_FAILURES_WINDOW_S, by error code, most first.
    recent_failures: dict[str, int] = field(default_factory=dict)
    recent_failures_window_s: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _tenant_scope(tenant: str | None) -> dict[str, Any]:
    """Core's filter for a tenant's view: Dataflow's subjects that are the tenant's runs."""
    if tenant is None:
        return {}
    return {"module": DATAFLOW_MODULE, "subjects": runs.tenant_run_ids(tenant)}


def _subject_and_entry_counts(
    conn: Connection, tenant: str | None, *, count_entries: bool, skip_dataflow: bool
) -> dict[str, tuple[int, int | None]]:
    """Subjects (and, on request, entries) per module. ``skip_dataflow`` leaves Dataflow out when
    its subjects are already known (its runs)."""
    if skip_dataflow and tenant is not None:
        return {}  # a tenant's view holds Dataflow subjects only, and those are already known
    return ledger.subject_and_entry_counts(
        conn,
        count_entries=count_entries,
        exclude_module=DATAFLOW_MODULE if skip_dataflow else None,
        **_tenant_scope(tenant),
    )


def _lease_counts(conn: Connection, db: Database, tenant: str | None) -> dict[str, tuple[int, int]]:
    """Held leases per module, live and expired on the database clock."""
    if tenant is None:
        return leases.held_counts(conn, db)
    # Few leases are held: join them to their runs rather than list the tenant's runs.
    return leases.held_counts(
        conn,
        db,
        module=DATAFLOW_MODULE,
        join_subjects=lambda query, subject: runs.join_tenant_runs(query, subject, tenant),
    )


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
    checkpoint_counts = checkpoints.count_by_module(conn, **_tenant_scope(tenant))
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


def runs_by_status(conn: Connection, tenant: str | None = None) -> dict[str, int]:
    return {str(value): int(count) for value, count in runs.count_by(conn, "status", tenant=tenant)}


def runs_by_recovery_status(conn: Connection, tenant: str | None = None) -> dict[str, int]:
    return {str(value): int(count) for value, count in runs.count_by(conn, "recovery_status", tenant=tenant)}


def ledger_kind_counts(conn: Connection) -> dict[str, int]:
    """Platform-wide count of Dataflow ledger entries per kind (attempt outcomes for /metrics)."""
    return ledger.kind_counts(conn, DATAFLOW_MODULE)


def unresolved_runs(
    conn: Connection, db: Database, now_us: int, tenant: str | None = None, limit: int = UNRESOLVED_SHOWN_MAX
) -> tuple[int, list[UnresolvedRun]]:
    """The total number of unresolved runs, and the oldest ``limit`` of them, oldest first: unresolved as
    the read views show it (``views.unresolved_page``), an expired attempt after dispatch authorization too."""
    total, page = views.unresolved_page(conn, db, tenant, limit=max(1, min(limit, UNRESOLVED_SHOWN_MAX)))
    return total, [_unresolved_run(view, now_us) for view in page]


def _unresolved_run(view: views.RunView, now_us: int) -> UnresolvedRun:
    run = view.run
    return UnresolvedRun(
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
        warning=view.warning or unresolved_warning(run),
        created_at_us=run.created_at_us,
        updated_at_us=run.updated_at_us,
        age_s=max(0, now_us - run.created_at_us) / US_PER_S,
        unresolved_for_s=max(0, now_us - run.updated_at_us) / US_PER_S,
    )


def _status_pairs(
    conn: Connection, tenant: str | None
) -> tuple[dict[str, int], dict[str, int], list[RunStateCount]]:
    """Runs by status, by recovery status and by the pair of both, from ONE grouped scan of the projection."""
    by_status: dict[str, int] = {}
    by_recovery: dict[str, int] = {}
    pairs = []
    for status, recovery, count in runs.count_by(conn, "status", "recovery_status", tenant=tenant, ordered=False):
        by_status[str(status)] = by_status.get(str(status), 0) + int(count)
        by_recovery[str(recovery)] = by_recovery.get(str(recovery), 0) + int(count)
        pairs.append(RunStateCount(str(status), str(recovery), int(count)))
    pairs.sort(key=lambda pair: (pair.status, pair.recovery_status))
    return dict(sorted(by_status.items())), dict(sorted(by_recovery.items())), pairs


def projection(
    conn: Connection, db: Database, tenant: str | None = None, *, count_entries: bool = False
) -> LedgerProjection:
    """The whole Ops view in one read transaction (one consistent snapshot on PostgreSQL)."""
    now_us = db.now_us(conn)
    total, unresolved = unresolved_runs(conn, db, now_us, tenant)
    by_status, by_recovery, pairs = _status_pairs(conn, tenant)
    runs_total = sum(by_status.values())
    since_us = now_us - RECENT_FAILURES_WINDOW_S * US_PER_S
    return LedgerProjection(
        tenant=tenant,
        now_us=now_us,
        modules=module_counts(conn, db, tenant, count_entries=count_entries, dataflow_runs_total=runs_total),
        runs_by_status=by_status,
        runs_by_recovery_status=by_recovery,
        unresolved_total=total,
        unresolved=unresolved,
        oldest_unresolved=unresolved[0] if unresolved else None,
        runs_by_state=pairs,
        recent_failures=runs.failures_by_error_code(conn, since_us, tenant),
        recent_failures_window_s=RECENT_FAILURES_WINDOW_S,
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


def list_definitions(conn: Connection, tenant: str) -> list[DefinitionSummary]:
    """The pinned definitions a tenant's runs used, with the tenant's own first use as their
    registration time: a tenant never sees another tenant's SQL, nor when another tenant ran it."""
    rows = views.tenant_definitions(conn, tenant, limit=DEFINITIONS_LISTED_MAX)
    return [DefinitionSummary(str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows]


def definition_body(conn: Connection, tenant: str, definition_hash: str) -> str | None:
    """The canonical body of a pinned definition the tenant has used, else None."""
    return views.tenant_definition_body(conn, tenant, definition_hash)
