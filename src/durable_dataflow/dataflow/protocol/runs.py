"""The DataflowRun projection: statuses, the run as scripts see it, and its storage statements.

The projection is derived from the ledger and written in the same transactions; run histories,
the CLI and the API read it. Its JSON form is a documented interface (docs/cli.md): scripts parse
it, so fields are only ever added.
"""

from __future__ import annotations

import enum
import json
import os
import re
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, ValidationError
from sqlalchemy.engine import Connection

from durable_dataflow.core import hashing, leases, ledger
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import InputError, NotFound, StaleAttempt
from durable_dataflow.core.text import CC_CONTROLS
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.protocol import evidence
from durable_dataflow.dataflow.schema import dataflow_runs

MODULE = "dataflow"
PAGE_SIZE_MAX = 500
PAGE_SIZE_DEFAULT = 50
# A run id may be given by a unique tail of at least this many characters (the random part of a
# UUIDv7: its head is a timestamp and is shared by runs created in the same minute).
RUN_ID_TAIL_CHARS_MIN = 8
RUN_ID_CHARS = 36
RUN_ID_MATCHES_SHOWN_MAX = 5
_RUN_ID_TEXT = re.compile(r"^[0-9a-f-]+$")
# A run list filters by at most this many parameters, each value at most this long (a string
# parameter's own limit, dataflow.definitions.parameters.STRING_PARAMETER_CHARS_MAX).
PARAMETER_FILTERS_MAX = 20
PARAMETER_FILTER_CHARS_MAX = 10_000


class RunStatus(enum.StrEnum):
    QUEUED = "queued"  # recorded, waiting for a worker (or for its next attempt)
    RUNNING = "running"  # an attempt holds the lease
    SUCCEEDED = "succeeded"  # terminal, with verified evidence
    FAILED = "failed"  # terminal, and no external output exists (proven)
    OUTCOME_UNKNOWN = "outcome_unknown"  # dispatch may have happened; only an inspection can tell
    EVIDENCE_FAILED = "evidence_failed"  # verification refused the success projection
    CANCELLED = "cancelled"  # terminal: an operator cancelled it before dispatch authorization


# A run in one of these states changes no more (reconcile and resume never touch them but a
# ``reconciled_absent`` run, which a resume makes running again): ``updated_at_us`` is the time of the
# transition into it. An unresolved run's row is written by every reconcile attempt (reconcile.started,
# reconcile.undecided keep its status), so its ``updated_at_us`` is not when it became unresolved.
FINISHED_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


def _refuse_nul(message: str, *values: str | None) -> None:
    """PostgreSQL cannot compare a text holding NUL (SQLite can): a filter holding one is refused on both,
    before any statement, with ``message``."""
    if any(value is not None and "\x00" in value for value in values):
        raise InputError(message)


class RecoveryStatus(enum.StrEnum):
    RECORDED = "recorded"  # run.recorded committed, no attempt yet
    LEASED = "leased"  # an attempt holds the lease
    DISPATCH_AUTHORIZED = "dispatch_authorized"  # the pre-dispatch commit is durable; dispatch may start
    VERIFIED = "verified"  # terminal state with a verified checkpoint
    RECOVERED = "recovered"  # an expired attempt was proven absent and the run queued again
    OUTCOME_UNKNOWN = "outcome_unknown"  # dispatch may have started, no conclusive response
    RECONCILED_PRESENT = "reconciled_present"  # an inspection found the publication with the digest
    RECONCILED_ABSENT = "reconciled_absent"  # an inspection proved (and fenced) the absence
    EVIDENCE_FAILED = "evidence_failed"  # the evidence chain or its facts did not verify
    NO_EXTERNAL_OUTPUT = "no_external_output"  # failed before dispatch, or the sink proved nothing made


class Mode(enum.StrEnum):
    ATOMIC = "atomic"  # database-only: result, projection and checkpoint commit together
    FORWARD_RECOVERY = "forward_recovery"  # publishes to an external sink; never twice


_STATUSES = frozenset(s.value for s in RunStatus)
_RECOVERIES = frozenset(s.value for s in RecoveryStatus)
UNRESOLVED_RECOVERY = frozenset({RecoveryStatus.OUTCOME_UNKNOWN, RecoveryStatus.EVIDENCE_FAILED})
# Fields that hold the server's local paths: never in the JSON form scripts and tenants read.
LOCAL_FIELDS = frozenset({"base_dir", "workspace"})


class Run(BaseModel):
    """A run as scripts and operators see it."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    tenant: str
    idempotency_key: str
    definition_name: str
    definition_hash: str
    request_hash: str
    mode: Mode
    status: RunStatus
    recovery_status: RecoveryStatus
    attempt: int
    max_attempts: int
    parameters: dict[str, Any]
    provenance: dict[str, Any]
    principal: str
    access_context_digest: str
    target: dict[str, Any] | None
    base_dir: str
    workspace: dict[str, Any] | None = None
    row_count: int | None
    output_digest: str | None
    source_fingerprint_digest: str | None
    publication_idempotency_key: str | None
    publication_idempotency_digest: str | None
    publication_ref: str | None
    datasource_ref: str | None
    materialization_ref: str | None
    warning: str | None
    error_code: str | None
    error_message: str | None
    created_at_us: int
    updated_at_us: int
    # Set only when the stored row could not be read as a run (which columns); see from_row.
    corrupt: str | None = None

    @property
    def unresolved(self) -> bool:
        return self.corrupt is not None or self.recovery_status in UNRESOLVED_RECOVERY

    def public(self) -> dict[str, Any]:
        """The documented JSON form (no local paths)."""
        data = self.model_dump(
            mode="json", exclude=set(LOCAL_FIELDS) | ({"corrupt"} if self.corrupt is None else set())
        )
        data["unresolved"] = self.unresolved
        return data


RUN_ID_PATTERN = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _missing(run_id: str) -> str:
    """A run that does not exist is named only when its id is well formed: never echo other input."""
    return f"run {run_id} does not exist" if RUN_ID_PATTERN.fullmatch(run_id) else "the run does not exist"


def new_run_id() -> str:
    """A time-ordered UUIDv7 (RFC 9562): 48 bits of milliseconds, then random bits."""
    millis = time.time_ns() // 1_000_000
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= int.from_bytes(os.urandom(10), "big") & ((1 << 76) - 1)
    value = (value & ~(0x3 << 62)) | (0x2 << 62)
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


_JSON_COLUMNS = (
    ("parameters_json", "parameters", True),
    ("provenance_json", "provenance", True),
    ("target_json", "target", False),
    ("workspace_json", "workspace", False),
)


def from_row(row: sa.Row[Any]) -> Run:
    """The run a stored row holds. A row that cannot be read as one (a column edited by hand, a
    damaged page) is still returned, marked ``corrupt`` with the columns at fault and unresolved,
    so listings and ``show`` survive it and ``dataflow verify`` can say what the ledger implies."""
    data = dict(row._mapping)
    problems: list[str] = []
    for column, name, required in _JSON_COLUMNS:
        raw = data.pop(column, None)
        value: Any = {} if required else None
        if raw:
            try:
                value = json.loads(raw)
            except (TypeError, ValueError):
                problems.append(column)
        data[name] = value
    try:
        run = Run.model_validate(data)
    except ValidationError as error:
        problems.extend(str(e["loc"][0]) for e in error.errors() if e["loc"])
    else:
        if not problems:
            return run
    known: dict[str, Any] = {name: data.get(name) for name in Run.model_fields if name != "corrupt"}
    return Run.model_construct(**known, corrupt=", ".join(sorted(set(problems))) or "unreadable")


def insert(conn: Connection, db: Database, values: Mapping[str, Any], now_us: int) -> Run:
    """Insert a run at ``now_us`` (``created_at_us`` and ``updated_at_us``: a database time its transaction
    read) and return it as stored."""
    statement = db.statement(_insert_statement, tuple(sorted(values)))
    return from_row(conn.execute(statement, inserted_parameters(values, now_us)).one())


def _insert_statement(_db: Database, names: tuple[str, ...]) -> sa.Insert:
    columns = dataflow_runs.c
    given = {name: sa.bindparam(f"run_{name}", type_=columns[name].type) for name in (*names, *_TIMES)}
    return dataflow_runs.insert().values(given).returning(*columns)


def inserted_cte(_db: Database, names: tuple[str, ...]) -> sa.CTE:
    """:func:`insert`'s statement as a data-modifying CTE, for a PostgreSQL statement that writes the run
    together with another module's rows (the RECORDED transition, protocol/transitions.py) and selects
    the row from it; :func:`inserted_parameters` gives its values."""
    return _insert_statement(_db, names).cte("inserted_run")


def inserted_parameters(values: Mapping[str, Any], now_us: int) -> dict[str, Any]:
    """The values of :func:`insert`'s (and :func:`inserted_cte`'s) bind parameters: the row at ``now_us``."""
    parameters = {f"run_{name}": value for name, value in values.items()}
    parameters.update({f"run_{name}": now_us for name in _TIMES})
    return parameters


_TIMES = ("created_at_us", "updated_at_us")


def get(conn: Connection, run_id: str, tenant: str | None = None, *, for_update: bool = False) -> Run:
    if "\x00" in run_id:  # no run id holds one, and PostgreSQL refuses to compare it: not found on both
        raise NotFound(_missing(run_id))
    query = sa.select(dataflow_runs).where(dataflow_runs.c.run_id == run_id)
    if tenant is not None:
        query = query.where(dataflow_runs.c.tenant == tenant)
    if for_update:
        query = query.with_for_update()
    row = conn.execute(query).one_or_none()
    if row is None:
        raise NotFound(_missing(run_id))
    return from_row(row)


# Built once: every submit with a key looks its run up (a replay is only this read).
_BY_KEY = sa.select(dataflow_runs).where(
    dataflow_runs.c.tenant == sa.bindparam("match_tenant"),
    dataflow_runs.c.idempotency_key == sa.bindparam("match_key"),
)


def find_by_key(conn: Connection, tenant: str, idempotency_key: str) -> Run | None:
    row = conn.execute(_BY_KEY, {"match_tenant": tenant, "match_key": idempotency_key}).one_or_none()
    return from_row(row) if row is not None else None


def update(
    conn: Connection,
    db: Database,
    run_id: str,
    *,
    expected_attempt: int | None = None,
    **values: Any,
) -> Run:
    """Update the projection of one run and return it; the caller's transaction is fenced or guarded.
    ``updated_at_us`` becomes the database time.

    With ``expected_attempt`` the row changes only while it still names that attempt (StaleAttempt
    otherwise): a projection is never written for an attempt the row has moved past."""
    statement = db.statement(_update_statement, tuple(sorted(values)), expected_attempt is not None)
    row = conn.execute(statement, update_parameters(run_id, values, expected_attempt)).one_or_none()
    return updated(row, run_id, expected_attempt)


def updated_cte(db: Database, columns: tuple[str, ...], guarded: bool) -> sa.CTE:
    """:func:`update`'s statement as a data-modifying CTE, for a PostgreSQL statement that writes the
    projection together with other modules' rows (a transition's, protocol/transitions.py) and selects
    the row from it: :func:`update_parameters` gives its values, :func:`updated` reads the row."""
    return _update_statement(db, columns, guarded).cte("updated_run")


def update_parameters(run_id: str, values: Mapping[str, Any], expected_attempt: int | None) -> dict[str, Any]:
    """The values of :func:`update`'s (and :func:`updated_cte`'s) bind parameters."""
    parameters = {f"set_{name}": value for name, value in values.items()}
    parameters["match_run_id"] = run_id
    if expected_attempt is not None:
        parameters["match_run_attempt"] = expected_attempt
    return parameters


def updated(row: sa.Row[Any] | None, run_id: str, expected_attempt: int | None) -> Run:
    """The run an update returned; StaleAttempt when its guard matched no row (NotFound unguarded)."""
    if row is None:
        if expected_attempt is not None:
            raise StaleAttempt(
                f"run {run_id} no longer names attempt {expected_attempt}: its projection is not written"
            )
        raise NotFound(_missing(run_id))
    return from_row(row)


def _update_statement(db: Database, columns: tuple[str, ...], guarded: bool) -> sa.Update:
    """The UPDATE … RETURNING of :func:`update` for one set of columns (their values come with the
    execution; the ``match_*`` parameters select the row)."""
    unknown = [name for name in columns if name not in dataflow_runs.c or name == "updated_at_us"]
    if unknown:
        raise InputError(f"a run has no updatable column {unknown[0]!r}")
    statement = dataflow_runs.update().where(dataflow_runs.c.run_id == sa.bindparam("match_run_id"))
    if guarded:
        statement = statement.where(dataflow_runs.c.attempt == sa.bindparam("match_run_attempt"))
    values = {name: sa.bindparam(f"set_{name}", type_=dataflow_runs.c[name].type) for name in columns}
    return statement.values(updated_at_us=db.now_us_expr(), **values).returning(*dataflow_runs.c)


def list_page(
    conn: Connection,
    *,
    tenant: str | None = None,
    status: str | None = None,
    recovery_status: str | None = None,
    definition_name: str | None = None,
    created_after_us: int | None = None,
    created_before_us: int | None = None,
    before: tuple[int, str] | None = None,
    limit: int = PAGE_SIZE_DEFAULT,
    parameters: Mapping[str, str] | None = None,
) -> list[Run]:
    """Newest first; ``before`` is the (created_at_us, run_id) cursor of the previous page's last run;
    ``parameters`` keeps runs whose every named parameter has that value (see ``_parameter_condition``).
    A status or recovery status that is not one, or a filter holding a NUL (PostgreSQL cannot compare
    it), is an InputError on both engines."""
    if parameters is not None and len(parameters) > PARAMETER_FILTERS_MAX:
        raise InputError(f"at most {PARAMETER_FILTERS_MAX} parameter filters are accepted")
    for name, value, allowed in (("status", status, _STATUSES), ("recovery_status", recovery_status, _RECOVERIES)):
        if value is not None and value not in allowed:
            raise InputError(f"{name} must be one of: {', '.join(sorted(allowed))}")
    _refuse_nul("a run filter must not contain a NUL character", tenant, definition_name)
    query = sa.select(dataflow_runs)
    for number, (name, value) in enumerate((parameters or {}).items(), start=1):
        query = query.where(_parameter_condition(conn.dialect.name, number, name, value))
    conditions = [
        (tenant, dataflow_runs.c.tenant),
        (status, dataflow_runs.c.status),
        (recovery_status, dataflow_runs.c.recovery_status),
        (definition_name, dataflow_runs.c.definition_name),
    ]
    for value, column in conditions:
        if value is not None:
            query = query.where(column == value)
    if created_after_us is not None:
        query = query.where(dataflow_runs.c.created_at_us >= created_after_us)
    if created_before_us is not None:
        query = query.where(dataflow_runs.c.created_at_us < created_before_us)
    if before is not None:
        query = query.where(sa.tuple_(dataflow_runs.c.created_at_us, dataflow_runs.c.run_id) < sa.tuple_(*before))
    query = query.order_by(dataflow_runs.c.created_at_us.desc(), dataflow_runs.c.run_id.desc())
    rows = conn.execute(query.limit(max(1, min(limit, PAGE_SIZE_MAX)))).all()
    return [from_row(row) for row in rows]


# The most runs one partition status reads (newest first): a tenant's runs of one partitioned datasource.
PARTITION_RUNS_MAX = 50_000


def partitioned_runs(conn: Connection, tenant: str, datasource: str) -> list[tuple[Run, dict[str, Any] | None]]:
    """The tenant's runs whose target partitions ``datasource``, newest first, each with its partition
    values (``partition_json``; None when the stored text cannot be read). More than
    ``PARTITION_RUNS_MAX`` is an InputError: a status read from part of the runs would be wrong."""
    _refuse_nul("a datasource name must not contain a NUL character", tenant, datasource)
    rows = conn.execute(
        sa.select(dataflow_runs)
        .where(dataflow_runs.c.tenant == tenant, dataflow_runs.c.partition_datasource == datasource)
        .order_by(dataflow_runs.c.created_at_us.desc(), dataflow_runs.c.run_id.desc())
        .limit(PARTITION_RUNS_MAX + 1)
    ).all()
    if len(rows) > PARTITION_RUNS_MAX:
        raise InputError(
            f"the datasource has more than {PARTITION_RUNS_MAX} partitioned runs: "
            "partition status reads at most that many"
        )
    return [(from_row(row), _partition_values(row.partition_json)) for row in rows]


def list_by_key_prefix(conn: Connection, tenant: str, prefix: str, *, limit: int) -> list[Run]:
    """The tenant's runs whose idempotency key starts with ``prefix`` (taken literally: ``%`` and ``_``
    match only themselves), newest first, at most ``limit``: a schedule's tick runs
    (``schedule:<tenant>:<name>:``) or a definition's backfill days (``backfill:<tenant>:<name>:``).
    The unique (tenant, idempotency_key) index serves the tenant; the prefix narrows within it."""
    _refuse_nul("a run filter must not contain a NUL character", tenant, prefix)
    rows = conn.execute(
        sa.select(dataflow_runs)
        .where(dataflow_runs.c.tenant == tenant, dataflow_runs.c.idempotency_key.startswith(prefix, autoescape=True))
        .order_by(dataflow_runs.c.created_at_us.desc(), dataflow_runs.c.run_id.desc())
        .limit(max(1, limit))
    ).all()
    return [from_row(row) for row in rows]


def key_prefix_states(conn: Connection, tenant: str, prefix: str, *, limit: int) -> list[tuple[str, str, int]]:
    """``(idempotency key, status, created_at_us)`` of the tenant's runs whose key starts with ``prefix``
    (literally), newest first, at most ``limit``: three columns, no JSON parsed (a progress count over
    many backfill days)."""
    _refuse_nul("a run filter must not contain a NUL character", tenant, prefix)
    c = dataflow_runs.c
    rows = conn.execute(
        sa.select(c.idempotency_key, c.status, c.created_at_us)
        .where(c.tenant == tenant, c.idempotency_key.startswith(prefix, autoescape=True))
        .order_by(c.created_at_us.desc(), c.run_id.desc())
        .limit(max(1, limit))
    ).all()
    return [(str(key), str(status), int(created)) for key, status, created in rows]


def _partition_values(text: str | None) -> dict[str, Any] | None:
    try:
        values = json.loads(text) if text else None
    except (TypeError, ValueError):
        return None
    return values if isinstance(values, dict) and values else None


def parameters_text(parameters: Mapping[str, Any], chars_max: int | None = None) -> str:
    """A run's parameters as ``name=value`` pairs by name, a string as it is and a number or boolean as
    its JSON: the form ``--param`` and ``?param=`` filter by. Longer than ``chars_max``, it is cut and
    ends with an ellipsis (the JSON forms carry it whole)."""
    if not isinstance(parameters, Mapping):  # a row damaged by hand (from_row): shown as nothing
        return ""
    pairs = (f"{name}={value if isinstance(value, str) else _canonical(value)}" for name, value in parameters.items())
    text = " ".join(sorted(pairs))
    if chars_max is None or len(text) <= chars_max:
        return text
    return text[: chars_max - 1] + "…"


def _canonical(value: Any) -> str:
    """A stored value's canonical JSON (``1e-7``, not Python's ``1e-07``); a damaged one as Python shows it."""
    try:
        return hashing.canonical_json(value).decode("utf-8")
    except InputError:
        return repr(value)


def parse_parameter_filters(pairs: Collection[str], option: str) -> dict[str, str]:
    """``NAME=VALUE`` filters (the API's ``param``, the page's field) as a mapping. A pair without a
    name is refused by its position, never echoed: it may be a value pasted without its name."""
    if len(pairs) > PARAMETER_FILTERS_MAX:
        raise InputError(f"at most {PARAMETER_FILTERS_MAX} {option} filters are accepted")
    parsed: dict[str, str] = {}
    for number, pair in enumerate(pairs, start=1):
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise InputError(f"{option} number {number} must have the form NAME=VALUE")
        if name.strip() in parsed:
            raise InputError(f"{option} number {number} names a parameter given before")
        parsed[name.strip()] = value
    return parsed


def _parameter_condition(dialect: str, number: int, name: str, value: str) -> sa.ColumnElement[bool]:
    """Runs whose parameter ``name`` holds ``value`` in its canonical form: a string equal to it, or a
    number or boolean whose canonical JSON is exactly it (``12``, ``true``; a date is its ISO string).

    The stored ``parameters_json`` is RFC 8785 canonical JSON of one flat object of scalars, so a
    parameter is there exactly as the text ``{"name":<value>`` or ``,"name":<value>``, a number or
    boolean followed by ``,`` or ``}``. A raw ``"`` inside a string is always escaped, so ``{"`` and
    ``,"`` begin only a key: the match is exact, with no JSON parsing in SQL (a row damaged by hand
    matches nothing rather than failing the list). The patterns are bound values, never SQL text;
    ``instr``/``strpos`` compare case-sensitively on both engines, unlike SQLite's LIKE. Messages
    name the filter's position, never its text (it may be a secret pasted into the wrong field).
    """
    if not name or len(value) > PARAMETER_FILTER_CHARS_MAX:
        raise InputError(
            f"parameter filter number {number} needs a name and a value of at most {PARAMETER_FILTER_CHARS_MAX} "
            "characters"
        )
    if any(ord(char) in CC_CONTROLS for char in name + value):
        raise InputError(f"parameter filter number {number} must not contain a control character")
    key = hashing.canonical_json(name).decode("utf-8") + ":"
    patterns = [start + key + hashing.canonical_json(value).decode("utf-8") for start in "{,"]
    literal = _json_literal(value)
    if literal is not None:
        patterns += [start + key + literal + end for start in "{," for end in ",}"]
    column = dataflow_runs.c.parameters_json
    find = sa.func.strpos if dialect == "postgresql" else sa.func.instr
    return sa.or_(*(find(column, pattern) > 0 for pattern in patterns))


def _json_literal(value: str) -> str | None:
    """``value`` when it is the canonical JSON of a number or a boolean, else None."""
    try:
        loaded = json.loads(value)
        canonical = hashing.canonical_json(loaded).decode("utf-8")
    except (ValueError, InputError):  # not JSON, a non-finite number, an integer too long to read
        return None
    return canonical if isinstance(loaded, bool | int | float) and canonical == value else None


def resolve_run_id(conn: Connection, text: str) -> str:
    """The full run id for a full id or a unique tail of it (as the run history shows it)."""
    candidate = text.strip().lower()
    if len(candidate) == RUN_ID_CHARS:
        return candidate
    if len(candidate) < RUN_ID_TAIL_CHARS_MIN or not _RUN_ID_TEXT.match(candidate):
        raise InputError(
            f"run id {text!r} is neither a full run id nor a tail of at least {RUN_ID_TAIL_CHARS_MIN} "
            "hexadecimal characters"
        )
    # The pattern is hex and dashes only (checked above), so it carries no LIKE wildcard.
    query = (
        sa.select(dataflow_runs.c.run_id)
        .where(dataflow_runs.c.run_id.like(f"%{candidate}"))
        .order_by(dataflow_runs.c.run_id)
        .limit(RUN_ID_MATCHES_SHOWN_MAX)
    )
    matches = list(conn.execute(query).scalars())
    if not matches:
        raise NotFound(f"run {text} does not exist")
    if len(matches) > 1:
        raise InputError(f"run id tail {text!r} is ambiguous: it matches {', '.join(matches)}; give more characters")
    return str(matches[0])


def fairest_queued(conn: Connection, *, skip_locked: bool) -> sa.Row[str, int, int] | None:
    """The queued run to claim next, ``(run_id, attempt, tenant_stored_bytes)``: the oldest queued run of
    the tenant with the fewest running runs among the tenants with queued runs (ties: the tenant whose
    oldest queued run is oldest), so one tenant's thousands of queued runs cannot hold every worker while
    another waits. ``tenant_stored_bytes`` is its tenant's result_bytes usage (``results``' counter).

    ``skip_locked`` (PostgreSQL) locks the row ``FOR UPDATE SKIP LOCKED``, so concurrent claimers each
    take a different run. When every queued run of the fairest tenant is locked by other claimers, the
    oldest unlocked queued run of any tenant is taken instead (a second, equally indexed statement), so
    a worker never idles while work is queued."""
    if not skip_locked:
        return conn.execute(_FAIREST_QUEUED).one_or_none()
    row = conn.execute(_FAIREST_QUEUED_SKIP_LOCKED).one_or_none()
    return row if row is not None else conn.execute(_OLDEST_QUEUED_SKIP_LOCKED).one_or_none()


def _queued_tenant_after(after: sa.ColumnElement[str] | None) -> sa.ScalarSelect[str]:
    """The first tenant (by name) with a queued run, after ``after``: one probe of the status-tenant index."""
    probe = dataflow_runs.alias("probe")
    query = sa.select(probe.c.tenant).where(probe.c.status == RunStatus.QUEUED)
    if after is not None:
        query = query.where(probe.c.tenant > after)
    return query.order_by(probe.c.tenant).limit(1).scalar_subquery()


def _fairest_tenant() -> sa.ScalarSelect[str]:
    """The tenant to serve next. The tenants with queued runs are walked by a recursive skip scan (one
    index probe per tenant, never a read of every queued run); each is ranked by its running runs (the
    tenant-status index) and its oldest queued run (the status-tenant index). The cost grows with the
    number of tenants that have queued work, not with the number of queued or running runs."""
    start = sa.select(_queued_tenant_after(None).label("tenant")).cte("queued_tenants", recursive=True)
    step = sa.select(_queued_tenant_after(start.c.tenant).label("tenant")).where(start.c.tenant.is_not(None))
    tenants = start.union_all(step)
    running = dataflow_runs.alias("running")
    oldest = dataflow_runs.alias("oldest")
    running_count = (
        sa.select(sa.func.count())
        .select_from(running)
        .where(running.c.tenant == tenants.c.tenant, running.c.status == RunStatus.RUNNING)
        .scalar_subquery()
    )
    oldest_queued_us = (
        sa.select(oldest.c.created_at_us)
        .where(oldest.c.status == RunStatus.QUEUED, oldest.c.tenant == tenants.c.tenant)
        .order_by(oldest.c.created_at_us)
        .limit(1)
        .scalar_subquery()
    )
    return (
        sa.select(tenants.c.tenant)
        .where(tenants.c.tenant.is_not(None))
        .order_by(running_count, oldest_queued_us, tenants.c.tenant)
        .limit(1)
        .scalar_subquery()
    )


# Built once: every claim and every idle poll of a worker runs one of them. Each also reads the run's
# tenant's stored result bytes (one primary-key read), which the claim checks against result_bytes.
_CLAIMED = (
    dataflow_runs.c.run_id,
    dataflow_runs.c.attempt,
    results.tenant_stored_bytes(dataflow_runs.c.tenant).label("tenant_stored_bytes"),
)
_FAIREST_QUEUED = (
    sa.select(*_CLAIMED)
    .where(dataflow_runs.c.status == RunStatus.QUEUED, dataflow_runs.c.tenant == _fairest_tenant())
    .order_by(dataflow_runs.c.created_at_us)
    .limit(1)
)
_FAIREST_QUEUED_SKIP_LOCKED = _FAIREST_QUEUED.with_for_update(skip_locked=True, of=dataflow_runs)
_OLDEST_QUEUED_SKIP_LOCKED = (
    sa.select(*_CLAIMED)
    .where(dataflow_runs.c.status == RunStatus.QUEUED)
    .order_by(dataflow_runs.c.created_at_us)
    .limit(1)
    .with_for_update(skip_locked=True, of=dataflow_runs)
)


_ANY_QUEUED = sa.select(dataflow_runs.c.run_id).where(dataflow_runs.c.status == RunStatus.QUEUED).limit(1)


def any_queued(conn: Connection) -> bool:
    """Whether any run is queued (one probe of the status index): a worker that found nothing to claim
    asks this before it claims again (``worker.Worker``), not the claim's transaction of two statements."""
    return conn.execute(_ANY_QUEUED).first() is not None


# ---- read-only statements of the Ops projection (ops.ledger) ---------------------------------

CountColumn = Literal["status", "recovery_status"]


def tenant_run_ids(tenant: str) -> sa.Select[tuple[str]]:
    """The ids of a tenant's runs, as a subquery: a tenant's Dataflow subjects in Core's tables."""
    return sa.select(dataflow_runs.c.run_id).where(dataflow_runs.c.tenant == tenant)


def tenant_of(run_id: sa.ColumnElement[str]) -> sa.ScalarSelect[str]:
    """A scalar subquery: the tenant of the run ``run_id`` names (a run-id column of another table)."""
    return sa.select(dataflow_runs.c.tenant).where(dataflow_runs.c.run_id == run_id).scalar_subquery()


def join_tenant_runs(query: sa.Select[Any], run_id: sa.ColumnElement[str], tenant: str) -> sa.Select[Any]:
    """``query`` joined to the tenant's runs on ``run_id`` (a subject-id column): cheaper than
    :func:`tenant_run_ids` when the other side holds few rows (held leases)."""
    return query.join(dataflow_runs, dataflow_runs.c.run_id == run_id).where(dataflow_runs.c.tenant == tenant)


def count_in_status(
    tenant: sa.ColumnElement[str], status: RunStatus, count_max: sa.ColumnElement[int]
) -> sa.ScalarSelect[int]:
    """A scalar subquery: the tenant's runs in ``status``, counted up to ``count_max`` and no further (a
    quota's check, dataflow.protocol.quotas): ``ix_dataflow_runs_tenant_status_pair`` serves it, read no
    further than the limit. ``tenant`` and ``count_max`` are the caller's bind parameters."""
    found = (
        sa.select(sa.literal(1))
        .select_from(dataflow_runs)
        .where(dataflow_runs.c.tenant == tenant, dataflow_runs.c.status == status.value)
        .limit(count_max)
        .subquery()
    )
    return sa.select(sa.func.count()).select_from(found).scalar_subquery()


def count_by(
    conn: Connection, *columns: CountColumn, tenant: str | None = None, ordered: bool = True
) -> list[tuple[Any, ...]]:
    """Rows of ``(*values, count)``: runs grouped by the named columns (platform-wide or one
    tenant's), ordered by them unless ``ordered`` is False. The status-pair indexes serve it."""
    grouped = [dataflow_runs.c[name] for name in columns]
    query = sa.select(*grouped, sa.func.count()).group_by(*grouped)
    if ordered:
        query = query.order_by(*grouped)
    if tenant is not None:
        query = query.where(dataflow_runs.c.tenant == tenant)
    return [tuple(row) for row in conn.execute(query)]


def failures_by_error_code(conn: Connection, since_us: int = 0, tenant: str | None = None) -> dict[str, int]:
    """Failed runs recorded since ``since_us`` (database clock; 0: all), counted by ``error_code``, most first:
    the Ops views' recent failures, and (all of them, platform-wide) the metrics' failures counter, which only
    grows since a failed run stays failed. The ``(status, created_at_us)`` index serves it."""
    c = dataflow_runs.c
    count = sa.func.count().label("n")
    query = (
        sa.select(c.error_code, count)
        .where(c.status == RunStatus.FAILED, c.created_at_us >= since_us)
        .group_by(c.error_code)
        .order_by(count.desc(), c.error_code)
    )
    if tenant is not None:
        query = query.where(c.tenant == tenant)
    return {str(code or "unknown"): int(n) for code, n in conn.execute(query)}


# ---- unresolved: the one definition every reader counts and shows -----------------------------
#
# A run is unresolved when its projection says so (``UNRESOLVED_RECOVERY``, as ``Run.unresolved``) or
# when it is still ``running`` but its attempt's lease expired on the database clock, undecided by any
# sweeper, after a dispatch authorization: the next sweep makes it ``outcome_unknown`` (the sweeper's
# rule: an authorization anywhere in the run's history, or the projection's ``dispatch_authorized``).
# The read views (``dataflow.protocol.views``: runs, show, replays, the API and pages) and the counts (Ops,
# ``/metrics``) all evaluate this one condition, in SQL, so they cannot disagree.


def _expired_after_authorization(db: Database) -> sa.ColumnElement[bool]:
    """Running, its lease expired and unswept, with a dispatch authorization: unresolved until swept."""
    run_id = dataflow_runs.c.run_id
    return sa.and_(
        dataflow_runs.c.status == RunStatus.RUNNING,
        leases.expired_held(db, MODULE, run_id),
        sa.or_(
            dataflow_runs.c.recovery_status == RecoveryStatus.DISPATCH_AUTHORIZED,
            ledger.has_kind(MODULE, run_id, evidence.DISPATCH_AUTHORIZED),
        ),
    )


def _unresolved(db: Database) -> sa.ColumnElement[bool]:
    """The whole definition: projected unresolved, or expired after dispatch authorization."""
    return sa.or_(dataflow_runs.c.recovery_status.in_(sorted(UNRESOLVED_RECOVERY)), _expired_after_authorization(db))


def expired_after_authorization(conn: Connection, db: Database, run_ids: Collection[str]) -> set[str]:
    """The runs among ``run_ids`` (at most ``leases.EXPIRY_SUBJECTS_MAX``) that are running with an expired
    lease after a dispatch authorization: unresolved by the derivation (a read view asks about its page)."""
    wanted = sorted(set(run_ids))
    if not wanted:
        return set()
    if len(wanted) > leases.EXPIRY_SUBJECTS_MAX:
        raise InputError(f"at most {leases.EXPIRY_SUBJECTS_MAX} runs per derivation query, got {len(wanted)}")
    query = sa.select(dataflow_runs.c.run_id).where(
        dataflow_runs.c.run_id.in_(wanted), _expired_after_authorization(db)
    )
    return set(conn.execute(query).scalars())


def unresolved_page(
    conn: Connection, db: Database, tenant: str | None = None, *, limit: int
) -> tuple[int, list[tuple[Run, bool]]]:
    """The number of unresolved runs (platform-wide or one tenant's) and the oldest ``limit`` of them,
    oldest first, each with whether it is unresolved by its expired lease after dispatch authorization
    (judged by the statement that found it, so a sweep in between cannot make it look resolved)."""
    where: list[sa.ColumnElement[bool]] = [_unresolved(db)]
    if tenant is not None:
        where.append(dataflow_runs.c.tenant == tenant)
    total = int(conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs).where(*where)).scalar_one())
    after_authorization = _expired_after_authorization(db).label("expired_after_authorization")
    rows = conn.execute(
        sa.select(dataflow_runs, after_authorization)
        .where(*where)
        .order_by(dataflow_runs.c.created_at_us, dataflow_runs.c.run_id)
        .limit(max(1, min(limit, PAGE_SIZE_MAX)))
    ).all()
    return total, [(from_row(row), bool(row.expired_after_authorization)) for row in rows]


# ---- activity: what the pages chart -----------------------------------------------------------
#
# A run's outcome as the charts count it: its state now, with the one unresolved definition above.
OUTCOME_UNRESOLVED = "unresolved"
OUTCOME_IN_PROGRESS = "in progress"  # queued or running, not unresolved
ACTIVITY_OUTCOMES = (
    RunStatus.SUCCEEDED.value,
    RunStatus.FAILED.value,
    RunStatus.CANCELLED.value,
    OUTCOME_UNRESOLVED,
    OUTCOME_IN_PROGRESS,
)
# The most definitions the duration chart shows (those with the most succeeded runs in the window).
DURATION_DEFINITIONS_MAX = 20


def _activity_scope(tenant: str | None, since_us: int, definition_name: str | None) -> list[sa.ColumnElement[bool]]:
    _refuse_nul("a run filter must not contain a NUL character", tenant, definition_name)
    where = [dataflow_runs.c.created_at_us >= since_us]
    if tenant is not None:
        where.append(dataflow_runs.c.tenant == tenant)
    if definition_name is not None:
        where.append(dataflow_runs.c.definition_name == definition_name)
    return where


def outcome_counts(
    conn: Connection,
    db: Database,
    *,
    tenant: str | None,
    since_us: int,
    bucket_us: int,
    definition_name: str | None = None,
) -> list[tuple[int, str, int]]:
    """The runs recorded since ``since_us`` (one tenant's, or every tenant's for None), counted per
    ``bucket_us``-wide bucket of their recording time (buckets start at multiples of ``bucket_us`` from the
    epoch: hours and days in UTC) and per outcome now (``ACTIVITY_OUTCOMES``): ``(bucket_start_us, outcome,
    runs)`` rows, oldest bucket first. One statement over ``ix_dataflow_runs_tenant_created`` (or
    ``ix_dataflow_runs_created`` platform-wide)."""
    if bucket_us <= 0:
        raise InputError("a chart bucket must be longer than zero")
    c = dataflow_runs.c
    finished = sorted(status.value for status in FINISHED_STATUSES)
    classified = (
        sa.select(
            (c.created_at_us - c.created_at_us % sa.literal_column(str(int(bucket_us)))).label("bucket"),
            sa.case(
                (_unresolved(db), sa.literal(OUTCOME_UNRESOLVED)),
                (c.status.in_(finished), c.status),
                else_=sa.literal(OUTCOME_IN_PROGRESS),
            ).label("outcome"),
        )
        .where(*_activity_scope(tenant, since_us, definition_name))
        .subquery("classified")
    )
    query = (
        sa.select(classified.c.bucket, classified.c.outcome, sa.func.count().label("runs"))
        .group_by(classified.c.bucket, classified.c.outcome)
        .order_by(classified.c.bucket, classified.c.outcome)
    )
    return [(int(bucket), str(outcome), int(n)) for bucket, outcome, n in conn.execute(query)]


class DurationStats(BaseModel):
    """A definition's succeeded runs recorded in a window: how many, and their mean and longest duration
    (recorded → succeeded, ``views.elapsed_us``)."""

    model_config = ConfigDict(frozen=True)

    definition_name: str
    runs: int
    mean_us: int
    max_us: int


def duration_stats(
    conn: Connection, *, tenant: str | None, since_us: int, definition_name: str | None = None
) -> tuple[list[DurationStats], bool]:
    """Per definition, its succeeded runs recorded since ``since_us``: count, mean and longest duration;
    the ``DURATION_DEFINITIONS_MAX`` definitions with the most such runs, by name, and whether more
    definitions had succeeded runs."""
    c = dataflow_runs.c
    took = c.updated_at_us - c.created_at_us
    count = sa.func.count().label("runs")
    query = (
        sa.select(c.definition_name, count, sa.func.avg(took).label("mean_us"), sa.func.max(took).label("max_us"))
        .where(c.status == RunStatus.SUCCEEDED.value, *_activity_scope(tenant, since_us, definition_name))
        .group_by(c.definition_name)
        .order_by(count.desc(), c.definition_name)
        .limit(DURATION_DEFINITIONS_MAX + 1)
    )
    found = [
        DurationStats(definition_name=name, runs=int(n), mean_us=max(0, round(mean)), max_us=max(0, int(longest)))
        for name, n, mean, longest in conn.execute(query)
    ]
    shown = sorted(found[:DURATION_DEFINITIONS_MAX], key=lambda stats: stats.definition_name)
    return shown, len(found) > DURATION_DEFINITIONS_MAX


def usage_by_definition(tenant: str) -> sa.Subquery:
    """Per definition hash, the tenant's first use (``registered_at_us``) and its number of ``runs``."""
    return (
        sa.select(
            dataflow_runs.c.definition_hash,
            sa.func.min(dataflow_runs.c.created_at_us).label("registered_at_us"),
            sa.func.count(dataflow_runs.c.run_id).label("runs"),
        )
        .where(dataflow_runs.c.tenant == tenant)
        .group_by(dataflow_runs.c.definition_hash)
        .subquery("tenant_usage")
    )


def unresolved_warning(run: Run) -> str:
    """The operator's warning for an unresolved run: what it means and what to do. Never 'failed'."""
    if run.corrupt is not None:
        return (
            f"UNRESOLVED: the stored row of run {run.run_id} cannot be read ({run.corrupt}), so its state is not "
            f"known from it. `dataflow verify {run.run_id}` says what its ledger implies; do not act on this row."
        )
    if run.recovery_status == RecoveryStatus.EVIDENCE_FAILED and run.mode == Mode.ATOMIC:
        return (
            "UNRESOLVED: the evidence for this run did not verify, so success was not recorded and no result "
            "was stored. An atomic run writes nothing outside the platform database, so no external output "
            f"exists. Find the broken entry with `dataflow verify {run.run_id}` before running it again."
        )
    if run.recovery_status == RecoveryStatus.EVIDENCE_FAILED and run.publication_idempotency_key is None:
        return (
            "UNRESOLVED: the evidence for this run did not verify before any publication was authorized, so "
            "nothing was dispatched and no external output exists. Find the broken entry with "
            f"`dataflow verify {run.run_id}` before running it again."
        )
    if run.recovery_status == RecoveryStatus.EVIDENCE_FAILED:
        return (
            "UNRESOLVED: the evidence for this run did not verify, so success was not recorded. "
            f"Output may exist under idempotency key {run.publication_idempotency_key or run.idempotency_key} "
            f"with output digest {run.output_digest}. Inspect the ledger with `dataflow verify {run.run_id}` "
            "and the sink before acting (`dataflow reconcile "
            f"{run.run_id}` inspects it); do not assume the output is absent."
        )
    return (
        "UNRESOLVED: external output may exist. The publication may have reached the sink under "
        f"idempotency key {run.publication_idempotency_key} with output digest {run.output_digest}. "
        f"Do not re-run it; reconcile by inspecting the sink: `dataflow reconcile {run.run_id}`."
    )


def oldest_created_us(conn: Connection, status: RunStatus) -> int | None:
    """When the oldest run in ``status`` was created (None when there is none): one probe of
    ``ix_dataflow_runs_status`` (status, created_at_us), for the metrics' oldest queued age."""
    value = conn.execute(
        sa.select(sa.func.min(dataflow_runs.c.created_at_us)).where(dataflow_runs.c.status == status.value)
    ).scalar()
    return None if value is None else int(value)
