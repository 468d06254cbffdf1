"""What the JSON API and the web pages both do, as plain functions over a Platform and a caller.

Every read is scoped to the caller's tenant: another tenant's run is NotFound (404), exactly like a
run that does not exist, so its existence never leaks. No protocol logic lives here; submit,
reconcile and verification belong to Dataflow, the projection to Ops.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from durable_dataflow.api.tokens import TokenInfo
from durable_dataflow.core import units
from durable_dataflow.core.errors import InputError, NotFound, PermissionDenied
from durable_dataflow.dataflow.definitions.definitions import parse_definition
from durable_dataflow.dataflow.execution.workspace import Tenancy
from durable_dataflow.dataflow.protocol import cancel, reconcile, views
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance, RunRequest
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.dataflow.protocol.service import Submission
from durable_dataflow.ops import ledger as ops_ledger
from durable_dataflow.platform import Platform

LIST_LIMIT_MAX = 200
LIST_LIMIT_DEFAULT = 50
CURSOR_CHARS_MAX = 200
# A cursor's time is compared with a BIGINT column: a larger integer overflows in the database.
CURSOR_US_MAX = 2**63 - 1
CURSOR_RUN_ID_CHARS_MAX = 64


@dataclass(frozen=True)
class Caller:
    """An authenticated API caller: its token's stored facts."""

    token: TokenInfo

    @property
    def tenant(self) -> str:
        """The caller's tenant. A platform operator has none, so every tenant-scoped operation (each
        reads this) refuses it, even one whose endpoint forgot to: a second line behind the role check."""
        if self.token.is_platform:
            raise PermissionDenied("this endpoint needs a tenant token; a platform_operator token has no tenant")
        return self.token.tenant

    @property
    def ops_tenant(self) -> str | None:
        """The tenant whose Ops projection the caller sees: None (every tenant) for a platform operator."""
        return None if self.token.is_platform else self.tenant

    def access(self) -> AccessContext:
        return AccessContext(
            tenant=self.tenant,
            principal=self.token.principal,
            roles=(self.token.role.value,),
            scopes=(),
            auth_method="token",
        )

    def operator_access(self) -> AccessContext:
        """Who acts in a reconcile or cancel: the tenant's access context, or for a platform operator (which
        may act on any tenant's run) its own, tenant ``*`` and role ``platform_operator``, so the ledger
        entry names the platform principal."""
        if not self.token.is_platform:
            return self.access()
        return AccessContext(
            tenant=self.token.tenant,
            principal=self.token.principal,
            roles=(self.token.role.value,),
            scopes=(),
            auth_method="token",
        )

    def provenance(self) -> Provenance:
        return Provenance(actor=self.token.principal, trigger="api")


# ---- submit ----------------------------------------------------------------------------------


def definition_from_request(
    platform: Platform, caller: Caller, document: Mapping[str, Any] | None, definition_hash: str | None
) -> Any:
    """The inline document, or a definition the caller's tenant has already pinned."""
    if (document is None) == (definition_hash is None):
        raise InputError("give exactly one of 'definition' (a document) or 'definition_hash'")
    if document is not None:
        return parse_definition(json.dumps(document), "request.json")
    with platform.db.read() as conn:
        body = ops_ledger.definition_body(conn, caller.tenant, str(definition_hash))
    if body is None:
        raise NotFound("the definition_hash names no definition this tenant has registered")
    return parse_definition(body, "registered.json")


def submit(
    platform: Platform,
    caller: Caller,
    request_body: Mapping[str, Any],
    idempotency_key: str | None,
    tenancy: Tenancy,
    queue: bool,
) -> Submission:
    definition = definition_from_request(
        platform, caller, request_body.get("definition"), request_body.get("definition_hash")
    )
    space = tenancy.workspace(caller.tenant)
    request = RunRequest(
        definition=definition,
        base_dir=space.base_dir,
        parameters=dict(request_body.get("parameters") or {}),
        access=caller.access(),
        provenance=caller.provenance(),
        idempotency_key=idempotency_key,
        max_attempts=int(request_body["max_attempts"]),
        workspace=space,
    )
    return platform.runs.submit(request) if queue else platform.runs.run_inline(request)


# ---- list ------------------------------------------------------------------------------------


def encode_cursor(run: Run) -> str:
    raw = json.dumps([run.created_at_us, run.run_id], separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The (created_at_us, run_id) a cursor names; anything else is invalid input, never a 500."""
    problem = InputError("the cursor is not one this server issued; start again without it")
    if len(cursor) > CURSOR_CHARS_MAX:
        raise problem
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw.decode("utf-8"))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise problem from None
    valid = (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and 0 <= value[0] <= CURSOR_US_MAX
        and isinstance(value[1], str)
        and len(value[1]) <= CURSOR_RUN_ID_CHARS_MAX
        and value[1].isprintable()  # a NUL is refused by PostgreSQL's driver: never a 500
    )
    if not valid:
        raise problem
    return int(value[0]), str(value[1])


def to_us(moment: datetime | None) -> int | None:
    """A created_after / created_before bound in database-clock microseconds (naive: UTC)."""
    return None if moment is None else units.to_us(moment)


@dataclass(frozen=True)
class RunsAnswer:
    """A page of ``GET /v1/runs`` and ``/ui/runs``: the runs as read now and the next page's cursor."""

    listed: views.RunList
    next_cursor: str | None

    def as_json(self) -> dict[str, Any]:
        return {"runs": self.listed.as_json(), "next_cursor": self.next_cursor}


def list_runs(
    platform: Platform,
    caller: Caller,
    *,
    status: str | None = None,
    recovery_status: str | None = None,
    definition: str | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    cursor: str | None = None,
    limit: int = LIST_LIMIT_DEFAULT,
    parameters: Mapping[str, str] | None = None,
) -> RunsAnswer:
    """One page of the caller's runs, newest first (``views.run_list``, as `dataflow runs`), with the
    cursor of the next page; ``parameters`` keeps runs holding every named value."""
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InputError(f"limit must be between 1 and {LIST_LIMIT_MAX}")
    before = decode_cursor(cursor) if cursor else None
    with platform.db.read() as conn:
        listed = views.run_list(
            conn,
            platform.db,
            limit=limit,
            tenant=caller.tenant,
            status=status,
            recovery_status=recovery_status,
            definition_name=definition,
            created_after_us=to_us(created_after),
            created_before_us=to_us(created_before),
            before=before,
            parameters=parameters,
        )
    next_cursor = encode_cursor(listed.views[-1].run) if listed.more else None
    return RunsAnswer(listed, next_cursor)


def activity(
    platform: Platform, tenant: str | None, *, days: int, bucket_us: int, definition: str | None = None, durations: bool
) -> views.Activity:
    """What the pages chart (``views.activity``): ``tenant``'s runs of the last ``days`` days, or every
    tenant's for None (a platform operator's Ops page)."""
    with platform.db.read() as conn:
        return views.activity(
            conn, platform.db, tenant, days=days, bucket_us=bucket_us, definition_name=definition, durations=durations
        )


def get_run(platform: Platform, caller: Caller, run_id: str) -> views.ShownRun:
    """One run of the caller's tenant as read now (``views.shown_run``, as `dataflow show` shows it)."""
    with platform.db.read() as conn:
        return views.shown_run(conn, platform.db, run_id, caller.tenant)


def shown(platform: Platform, run: Run) -> views.ShownRun:
    """A run a write returned, as read now (``views.shown``: its lease read on the database clock)."""
    with platform.db.read() as conn:
        return views.shown(conn, platform.db, run)


# ---- evidence and reconciliation -------------------------------------------------------------


def evidence_of(platform: Platform, caller: Caller, run_id: str) -> views.RunEvidence:
    """The ledger entries, the verification of the chain (and of success facts), the latest checkpoint:
    ``views.run_evidence``, the same objects as `dataflow show --json` and `dataflow verify --json`."""
    with platform.db.read() as conn:
        service = platform.runs
        return views.run_evidence(
            conn, platform.db, run_id, service.config.evidence_key, caller.tenant, checks=service.result_checks
        )


def reconcile_run(platform: Platform, caller: Caller, run_id: str, resume: bool) -> reconcile.Reconciliation:
    """Dataflow's reconciliation, for a run of the caller's tenant, or of any tenant for a platform operator
    (the role is checked by the caller); the attempts it starts record the caller's principal, access
    context digest and provenance, as a submit does."""
    return reconcile.reconcile(
        platform.runs,
        run_id,
        access=caller.operator_access(),
        provenance=caller.provenance(),
        tenant=caller.ops_tenant,
        resume=resume,
    )


def cancel_run(platform: Platform, caller: Caller, run_id: str) -> cancel.Cancellation:
    """Cancel a run of the caller's tenant, or of any tenant for a platform operator (the role is checked
    by the caller); the ``run.cancelled`` entry records the caller's principal, access context digest
    and provenance."""
    return cancel.cancel(platform.runs, run_id, access=caller.operator_access(), provenance=caller.provenance(),
                         tenant=caller.ops_tenant)  # fmt: skip
