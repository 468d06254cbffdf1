"""Quotas per tenant (docs/deployment.md#quotas): how much of the platform one tenant may hold at once.

Each quota has a platform default (a ``DATAFLOW_QUOTA_*`` variable, else the documented default) and
per-tenant overrides in the quotas file (``$DATAFLOW_QUOTAS``, YAML, validated like the grants file).
A request past a quota is refused before anything is recorded, with :class:`QuotaExceeded` naming the
quota and its limit (HTTP 429 with ``Retry-After``, CLI exit 10); the message names the caller's own
usage only, never another tenant's.

Where each is checked:

- ``queued_runs``, ``running_runs``, ``result_bytes``: by :func:`check_submit`, inside the transaction
  that records a run (``Submitter._record``), before it writes anything of the run (an inline submit's
  lease is granted beside the count on PostgreSQL, below). A queued submit counts queued
  runs, an inline one (it starts running at once) running runs; both sum stored result bytes.
- ``result_bytes`` again when a worker claims a queued run (``attempt.claim_next``, :func:`claim_refusal`:
  the claim's select reads the counter too): a run queued while its tenant was under the quota is not
  executed once the tenant's stored results reach it; its attempt fails ``quota_exceeded``.
- ``backfill_days``: by :func:`check_backfill_days`, before a backfill submits its first day.
- ``applied_schedules``: by ``schedules.apply`` (:func:`check_applied_schedules`), before a new name is
  written; re-applying an existing name is never refused.
- ``inline_executions``: by the API's inline executor (``api.inline``), with the platform-wide
  ``inline_executions_max`` beside it.

Two recording transactions of one tenant take turns from its quota check to their commit, so two
concurrent submits cannot both count the same last free slot: on PostgreSQL :func:`check_submit` first
takes a transaction-scoped advisory lock on the tenant (``_TENANT_TURN``: ``pg_advisory_xact_lock`` with
the class ``QUOTA_LOCK_CLASS`` and a key hashed from the tenant name, released by the commit or
rollback); READ COMMITTED counts only committed rows, so without it both would pass. On SQLite every
write transaction begins IMMEDIATE (core.db), which already makes writers take turns. Another tenant's
submit waits for it only when its name hashes to the same 32-bit key (rare, and only for the moment from
the check to the commit).

Statements (``_TENANT_TURN`` is the one lock; the rest read, and an inline submit's read on PostgreSQL
also grants its lease):

- ``_usage``: one statement, built once per database, status and whether it grants
  (``Database.statement``), of two scalar
  subqueries from the tables' owners: ``runs.count_in_status``, the tenant's runs in one status counted
  through ``ix_dataflow_runs_tenant_status_pair`` and stopped at the limit, so its cost is bounded by the
  limit; and ``results.tenant_stored_bytes``, one primary-key read of the counter of stored result bytes
  kept in the transaction storing each result (``results.count_stored``, or ``results.stored_ctes`` in a
  transition's one statement). Neither grows with the tenant's
  history. The same read returns the database clock: the time of a queued run and its first ledger
  entries (an inline run takes its lease grant's), so neither needs a read of its own
  (transitions.record). An inline submit's lease (attempt 1's) is granted by the same statement on
  PostgreSQL (``leases.first_grant_cte``, a data-modifying CTE the read selects from): a refusal rolls
  it back with the transaction, so nothing is recorded. When the lease is already there (the CTE grants
  nothing, so the read returns no row) the quotas are read again and checked first, then the grant is
  refused, in the order SQLite checks them.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, ValidationError
from sqlalchemy.engine import Connection

from durable_dataflow.core import leases, units
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError, QuotaExceeded
from durable_dataflow.core.files import read_capped
from durable_dataflow.core.names import TENANT_PATTERN
from durable_dataflow.core.text import validation_problems
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.protocol import runs
from durable_dataflow.dataflow.protocol.runs import RunStatus

QUOTAS_ENV = "DATAFLOW_QUOTAS"  # the per-tenant overrides file (YAML)
INLINE_EXECUTIONS_MAX_ENV = "DATAFLOW_INLINE_EXECUTIONS_MAX"  # the API's inline executions, all tenants
INLINE_EXECUTIONS_MAX_DEFAULT = 8
QUOTAS_FILE_BYTES_MAX = 1024 * 1024
QUOTA_VALUE_MAX = 2**62  # any larger number is a typo; it would also overflow a BIGINT comparison


class Quota(enum.StrEnum):
    QUEUED_RUNS = "queued_runs"  # runs recorded and waiting for a worker
    RUNNING_RUNS = "running_runs"  # runs executing now (checked when an inline submit starts one)
    INLINE_EXECUTIONS = "inline_executions"  # API submits executing inline at once (per server process)
    BACKFILL_DAYS = "backfill_days"  # days one backfill may cover
    APPLIED_SCHEDULES = "applied_schedules"  # schedules applied (paused ones included)
    RESULT_BYTES = "result_bytes"  # bytes of every result the tenant's runs have stored


@dataclass(frozen=True)
class QuotaSetting:
    """One quota: its variable, its default, whether it is a size, and when a refused caller may retry."""

    quota: Quota
    variable: str
    default: int
    is_size: bool
    retry_after_s: int  # what Retry-After says: when the usage may have gone down


SETTINGS: tuple[QuotaSetting, ...] = (
    QuotaSetting(Quota.QUEUED_RUNS, "DATAFLOW_QUOTA_QUEUED_RUNS", 10_000, False, 60),
    QuotaSetting(Quota.RUNNING_RUNS, "DATAFLOW_QUOTA_RUNNING_RUNS", 100, False, 30),
    QuotaSetting(Quota.INLINE_EXECUTIONS, "DATAFLOW_QUOTA_INLINE_EXECUTIONS", 4, False, 5),
    QuotaSetting(Quota.BACKFILL_DAYS, "DATAFLOW_QUOTA_BACKFILL_DAYS", 366, False, 3600),
    QuotaSetting(Quota.APPLIED_SCHEDULES, "DATAFLOW_QUOTA_APPLIED_SCHEDULES", 1000, False, 3600),
    QuotaSetting(Quota.RESULT_BYTES, "DATAFLOW_QUOTA_RESULT_BYTES", 100 * 1024**3, True, 3600),
)
SETTING_BY_QUOTA: Mapping[Quota, QuotaSetting] = {s.quota: s for s in SETTINGS}


@dataclass(frozen=True)
class TenantQuotas:
    """The limits of one tenant (each at least 1)."""

    queued_runs: int = SETTING_BY_QUOTA[Quota.QUEUED_RUNS].default
    running_runs: int = SETTING_BY_QUOTA[Quota.RUNNING_RUNS].default
    inline_executions: int = SETTING_BY_QUOTA[Quota.INLINE_EXECUTIONS].default
    backfill_days: int = SETTING_BY_QUOTA[Quota.BACKFILL_DAYS].default
    applied_schedules: int = SETTING_BY_QUOTA[Quota.APPLIED_SCHEDULES].default
    result_bytes: int = SETTING_BY_QUOTA[Quota.RESULT_BYTES].default

    def limit(self, quota: Quota) -> int:
        value: int = getattr(self, quota.value)
        return value


@dataclass(frozen=True)
class Quotas:
    """The platform's quotas: defaults, per-tenant overrides, and the platform-wide inline capacity."""

    defaults: TenantQuotas = field(default_factory=TenantQuotas)
    tenants: Mapping[str, TenantQuotas] = field(default_factory=dict)
    inline_executions_max: int = INLINE_EXECUTIONS_MAX_DEFAULT

    def of(self, tenant: str) -> TenantQuotas:
        return self.tenants.get(tenant, self.defaults)


NOTHING_RECORDED = "; nothing was recorded"


def refusal(quota: Quota, limit: int, detail: str) -> QuotaExceeded:
    """The error for ``quota``: its name, its limit and ``detail`` (the caller's own usage)."""
    setting = SETTING_BY_QUOTA[quota]
    shown = _shown(setting, limit)
    return QuotaExceeded(
        f"quota {quota.value} ({shown}) exceeded: {detail}{NOTHING_RECORDED}",
        quota=quota.value,
        limit=limit,
        retry_after_s=setting.retry_after_s,
    )


def refused_after(error: QuotaExceeded, recorded: str) -> QuotaExceeded:
    """``error`` for a request of several records (a backfill's days) refused part-way: what this
    request had recorded before it (``recorded``) instead of "nothing was recorded"."""
    message = error.message.removesuffix(NOTHING_RECORDED)
    return QuotaExceeded(f"{message}; {recorded}", quota=error.quota, limit=error.limit,
                         retry_after_s=error.retry_after_s)  # fmt: skip


def _shown(setting: QuotaSetting, value: int) -> str:
    if setting.is_size:
        from durable_dataflow.dataflow.execution.limits import format_size

        return format_size(value)
    return str(value)


# ---- the checks --------------------------------------------------------------------------------


QUOTA_LOCK_CLASS = 0x51554F54  # "QUOT": the first key of the quota checks' advisory locks (the second: the tenant's)
# Two int4 keys, not one bigint: PostgreSQL keeps the two forms apart, so no other advisory lock collides.
_TENANT_TURN = sa.text("SELECT pg_advisory_xact_lock(:lock_class, :tenant_key)")


def _tenant_key(tenant: str) -> int:
    """A stable signed 32-bit key for the tenant's name (two tenants sharing one only take turns)."""
    digest = hashlib.sha256(tenant.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


def take_tenant_turn(conn: Connection, tenant: str) -> None:
    """Wait until no other open transaction of ``tenant`` holds its turn, and hold it until this one ends."""
    if conn.dialect.name == "postgresql":
        conn.execute(_TENANT_TURN, {"lock_class": QUOTA_LOCK_CLASS, "tenant_key": _tenant_key(tenant)})


def check_submit(
    db: Database, conn: Connection, quotas: Quotas, tenant: str, *, grant: leases.FirstGrant | None = None
) -> tuple[int, leases.Lease | None]:
    """Refuse recording one more run of ``tenant`` (queued, or inline with ``grant``: running at once)
    when it would pass a quota. Called in the recording transaction before it writes anything of the run;
    it takes the tenant's turn (``take_tenant_turn``) before counting, so the count and the insert are one
    step for the tenant. Returns the database time of its read (a queued run's ``created_at_us`` and its first
    entries' time) and, inline, the lease ``grant`` asked for: on PostgreSQL granted by the same statement
    as the read (``leases.first_grant_cte``), a round trip less, and rolled back with the transaction
    when a quota refuses; on SQLite by its own statement after the read. An inline run's time is its
    lease's grant time."""
    limits = quotas.of(tenant)
    take_tenant_turn(conn, tenant)
    inline = grant is not None
    status, quota = (RunStatus.RUNNING, Quota.RUNNING_RUNS) if inline else (RunStatus.QUEUED, Quota.QUEUED_RUNS)
    limit = limits.limit(quota)
    parameters = {"tenant": tenant, "count_max": limit}
    row = None
    if grant is not None and db.dialect == "postgresql":
        granting = {**parameters, **leases.first_grant_parameters(grant)}
        row = conn.execute(db.statement(_usage, status, True), granting).one_or_none()  # none: a lease was there
    usage = row or conn.execute(db.statement(_usage, status, False), parameters).one()
    in_status, stored, now_us = int(usage[0]), int(usage[1]), int(usage[2])
    if in_status >= limit:
        raise refusal(quota, limit, f"this tenant has {limit} {status.value} runs")
    refused = result_bytes_refusal(limits, stored)
    if refused is not None:
        raise refused
    if grant is None:
        return now_us, None
    if db.dialect != "postgresql":
        return now_us, leases.acquire(
            conn, db, grant.module, grant.subject_id, grant.holder, grant.ttl_s, expected_attempt=0
        )  # fmt: skip
    return now_us, leases.granted_first(row, grant) if row is not None else leases.first_refused(grant)


def _usage(db: Database, status: RunStatus, granting: bool) -> sa.Select[Any]:
    """The tenant's runs in ``status`` (up to ``:count_max``), its stored result bytes and the database
    clock, in one read; ``granting``: with a subject's first lease granted (``leases.first_grant_cte``),
    its columns after those three."""
    tenant = sa.bindparam("tenant", type_=sa.String)
    count_max = sa.bindparam("count_max", type_=sa.BigInteger)  # a quota may be up to QUOTA_VALUE_MAX
    columns: list[sa.ColumnElement[Any]] = [
        runs.count_in_status(tenant, status, count_max), results.tenant_stored_bytes(tenant), db.now_us_expr()
    ]  # fmt: skip
    if not granting:
        return sa.select(*columns)
    granted = leases.first_grant_cte(db)
    lease = (granted.c.attempt, granted.c.acquired_at_us, granted.c.expires_at_us)
    return sa.select(*columns, *lease).select_from(granted)


def result_bytes_refusal(limits: TenantQuotas, stored: int) -> QuotaExceeded | None:
    """The result_bytes refusal when the tenant's runs have stored ``stored`` bytes, its quota or more."""
    if stored < limits.result_bytes:
        return None
    shown = _shown(SETTING_BY_QUOTA[Quota.RESULT_BYTES], stored)
    return refusal(Quota.RESULT_BYTES, limits.result_bytes, f"this tenant's runs have stored {shown} of results")


def claim_refusal(quotas: Quotas, tenant: str, stored: int) -> QuotaExceeded | None:
    """A claimed queued run's refusal: its tenant's runs have stored its result_bytes quota or more since
    it was queued. The run is not executed (its attempt fails ``quota_exceeded``): every run queued while
    the tenant was under its quota would otherwise store up to its ``output.max_bytes`` past it."""
    refused = result_bytes_refusal(quotas.of(tenant), stored)
    if refused is None:
        return None
    return refused_after(refused, "this run was queued before the tenant reached it and is not executed; "
                                  "once the quota allows it, submit its parameters again under a new "
                                  "idempotency key (its own key, a backfill day's or a schedule tick's too, "
                                  "keeps naming this run)")  # fmt: skip


def check_backfill_days(quotas: Quotas, tenant: str, days: int) -> None:
    """Refuse a backfill covering more days than ``tenant``'s quota, before its first submit."""
    limit = quotas.of(tenant).backfill_days
    if days > limit:
        raise refusal(Quota.BACKFILL_DAYS, limit, f"this backfill covers {days} days; split it into smaller ranges")


def check_applied_schedules(limit: int, applied: int) -> None:
    """Refuse applying one more schedule (a new name) when the tenant has ``limit`` applied already
    (counted by ``schedules``, the table's owner, in the same read)."""
    if applied >= limit:
        detail = f"this tenant has {applied} applied schedules (paused ones count)"
        raise refusal(Quota.APPLIED_SCHEDULES, limit, detail)


# ---- settings: the environment and the quotas file -------------------------------------------------

QuotaValue = StrictInt | Annotated[str, Field(max_length=40)]  # ranges checked by _value
# A tenant's name as every request names it (core.names): a key that no request can name ("acme ", say)
# would load and never apply.
TenantName = Annotated[str, StringConstraints(pattern=TENANT_PATTERN.pattern)]


class _TenantModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    queued_runs: QuotaValue | None = None
    running_runs: QuotaValue | None = None
    inline_executions: QuotaValue | None = None
    backfill_days: QuotaValue | None = None
    applied_schedules: QuotaValue | None = None
    result_bytes: QuotaValue | None = None


class _QuotasFileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[TenantName, _TenantModel] = {}


def from_env(environ: Mapping[str, str] = os.environ) -> Quotas:
    """The platform's quotas: each default from its ``DATAFLOW_QUOTA_*`` variable (else the documented
    default), the overrides from ``$DATAFLOW_QUOTAS``, the inline capacity from
    ``$DATAFLOW_INLINE_EXECUTIONS_MAX``. A bad value is an InputError naming where it is, never its text."""
    chosen: dict[str, int] = {}
    for setting in SETTINGS:
        raw = environ.get(setting.variable, "").strip()
        if raw:
            chosen[setting.quota.value] = _value(setting, raw, setting.variable)
    defaults = TenantQuotas(**chosen)
    inline_raw = environ.get(INLINE_EXECUTIONS_MAX_ENV, "").strip()
    inline_max = INLINE_EXECUTIONS_MAX_DEFAULT
    if inline_raw:
        inline_max = _value(SETTING_BY_QUOTA[Quota.INLINE_EXECUTIONS], inline_raw, INLINE_EXECUTIONS_MAX_ENV)
    configured = environ.get(QUOTAS_ENV, "").strip()
    tenants: dict[str, TenantQuotas] = {}
    if configured:
        data = read_capped(Path(configured), QUOTAS_FILE_BYTES_MAX, f"{QUOTAS_ENV}: the quotas file")
        tenants = parse_quotas_file(data.decode("utf-8", errors="replace"), QUOTAS_ENV, defaults)
    return Quotas(defaults, tenants, inline_max)


def parse_quotas_file(text: str, origin: str, defaults: TenantQuotas) -> dict[str, TenantQuotas]:
    """Per-tenant quotas from a quotas document (YAML): each tenant's quotas not named keep ``defaults``.
    An InputError names the problem and where (never a value) otherwise."""
    from durable_dataflow.dataflow.definitions.definitions import parse_yaml_document

    # The definitions' strict reader: a tenant named twice is refused (PyYAML keeps the last one silently,
    # which may be the looser), and so are anchors and aliases.
    document = parse_yaml_document(text, f"quotas file {origin}")
    try:
        model = _QuotasFileModel.model_validate(document or {})
    except ValidationError as error:
        where = validation_problems(error)
        raise InputError(f"quotas file {origin}: {where}") from None
    tenants: dict[str, TenantQuotas] = {}
    for tenant, given in model.tenants.items():
        chosen: dict[str, int] = {}
        for setting in SETTINGS:
            raw = getattr(given, setting.quota.value)
            if raw is not None:
                where = f"quotas file {origin}: tenants.{tenant!r}.{setting.quota.value}"
                chosen[setting.quota.value] = _value(setting, raw, where)
        tenants[tenant] = replace(defaults, **chosen)
    return tenants


def _value(setting: QuotaSetting, raw: int | str, origin: str) -> int:
    """A quota's value: a whole number at least 1 (a size like ``10GiB`` for a size quota)."""
    kind = "a size (bytes, or e.g. 10GiB)" if setting.is_size else "a whole number"
    try:
        value = units.parse_size(raw) if setting.is_size else _whole(raw)
    except ValueError:
        raise InputError(f"{origin} must be {kind}, at least 1") from None
    if not 1 <= value <= QUOTA_VALUE_MAX:
        raise InputError(f"{origin} must be {kind}, at least 1 and at most {QUOTA_VALUE_MAX}")
    return value


def _whole(raw: int | str) -> int:
    if isinstance(raw, int):
        return raw
    if not raw.strip().isdigit():
        raise ValueError("not a whole number")
    return int(raw)
