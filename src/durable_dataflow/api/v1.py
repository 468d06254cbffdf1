"""The JSON API under /v1. Handlers are plain ``def``s: FastAPI runs them in its thread pool, and the
synchronous core does the work (DESIGN: no twin async API). The one exception is the submit: it hands
its work to the inline executor (``api.inline``) or the thread pool and awaits it, so an inline
execution never holds a thread that reads need."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from durable_dataflow.api import operations
from durable_dataflow.api.auth import api_caller, platform_of
from durable_dataflow.api.bodies import body_openapi, json_body
from durable_dataflow.api.operations import Caller
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import Conflict, PermissionDenied, StorageUnavailable
from durable_dataflow.core.invariants import InvariantViolation
from durable_dataflow.dataflow.execution import results
from durable_dataflow.dataflow.protocol import fleet, partitions, runs
from durable_dataflow.dataflow.protocol.requests import (
    IDEMPOTENCY_KEY_CHARS_MAX,
    MAX_ATTEMPTS_DEFAULT,
    MAX_ATTEMPTS_LIMIT,
)
from durable_dataflow.dataflow.protocol.runs import RecoveryStatus, RunStatus
from durable_dataflow.datasources import registry
from durable_dataflow.ops import ledger as ops_ledger

router = APIRouter(prefix="/v1")

Viewer = Annotated[Caller, Depends(api_caller(Role.VIEWER))]
Submitter = Annotated[Caller, Depends(api_caller(Role.SUBMITTER))]
Operator = Annotated[Caller, Depends(api_caller(Role.OPERATOR))]
# A tenant operator (its tenant) or a platform operator (every tenant): the platform-wide reads, and
# reconcile and cancel, so cross-tenant on-call needs a platform token, not the database URL.
OpsReader = Annotated[Caller, Depends(api_caller(Role.OPERATOR, platform_wide=True))]
OpsActor = OpsReader
DEFINITION_NAME_CHARS_MAX = 200
# Result downloads one server streams at once (each holds about 10 MiB while its client reads); past it 503.
RESULT_DOWNLOADS_MAX = 8

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": 'No valid token: `{"error": {"code": "unauthenticated", ...}}`'},
    403: {"description": "The token's role does not allow this"},
    404: {"description": "Not found, or belongs to another tenant"},
    422: {"description": "Invalid input"},
}


class SubmitRunBody(BaseModel):
    """A run request: exactly one of an inline definition document or a registered definition hash."""

    model_config = ConfigDict(extra="forbid")

    definition: dict[str, Any] | None = Field(default=None, description="The definition document as JSON")
    definition_hash: str | None = Field(default=None, max_length=71, description="A definition already pinned")
    parameters: dict[str, Any] = Field(default_factory=dict)
    max_attempts: int = Field(default=MAX_ATTEMPTS_DEFAULT, ge=1, le=MAX_ATTEMPTS_LIMIT)


class ReconcileBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resume: bool = Field(default=False, description="After a proven absence, re-dispatch the stored result")


# Bodies are dependencies declared after the caller's, so they are read only once the token is checked.
SubmitRunJson = Annotated[SubmitRunBody, Depends(json_body(SubmitRunBody))]
ReconcileJson = Annotated[ReconcileBody, Depends(json_body(ReconcileBody, required=False))]


@router.post(
    "/runs",
    status_code=201,
    responses={
        200: {"description": "A replay: the existing run"},
        409: {},
        429: {"description": "A quota, or every inline execution slot, is in use; see Retry-After"},
    },
    openapi_extra=body_openapi(SubmitRunBody),
)
async def submit_run(
    request: Request,
    response: Response,
    caller: Submitter,
    body: SubmitRunJson,
    queue: bool = Query(default=False, description="Only record the run; a worker executes it"),
    idempotency_key: str | None = Header(default=None, alias="Idempotency-Key", max_length=IDEMPOTENCY_KEY_CHARS_MAX),
) -> dict[str, Any]:
    """Submit a run: 201 when recorded, 200 with the existing run on a replay, 409 on a conflicting request,
    429 past a quota. An inline submit executes in the server's inline executor (``api.inline``), never
    in the threads that answer reads; a queued one is recorded from FastAPI's thread pool."""
    platform = platform_of(request)
    tenancy = request.app.state.tenancy
    started = time.perf_counter()

    def submit_and_show() -> tuple[bool, dict[str, Any]]:
        submission = operations.submit(platform, caller, body.model_dump(), idempotency_key, tenancy, queue)
        if submission.created and not queue:  # executed here, its attempt claimed in the recording commit
            request.app.state.metrics.runs.observe_run(submission.run, time.perf_counter() - started)
        return submission.created, operations.shown(platform, submission.run).as_json()

    if queue:
        created, shown = await run_in_threadpool(submit_and_show)
    else:
        created, shown = await request.app.state.inline.run(caller.tenant, submit_and_show)
    request.app.state.metrics.observe_commit("submit", time.perf_counter() - started)
    response.status_code = 201 if created else 200
    return {"run": shown, "created": created}


@router.get("/runs", responses=ERROR_RESPONSES)
def list_runs(
    request: Request,
    caller: Viewer,
    status: RunStatus | None = None,
    recovery_status: RecoveryStatus | None = None,
    definition: str | None = Query(default=None, max_length=DEFINITION_NAME_CHARS_MAX),
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    cursor: str | None = Query(default=None, max_length=operations.CURSOR_CHARS_MAX),
    limit: int = Query(default=operations.LIST_LIMIT_DEFAULT, ge=1, le=operations.LIST_LIMIT_MAX),
    param: list[str] | None = Query(
        default=None, description="NAME=VALUE: only runs with this parameter value (repeatable, all must match)"
    ),
) -> dict[str, Any]:
    """The caller's runs, newest first; pass ``next_cursor`` back as ``cursor`` for the next page."""
    page = operations.list_runs(
        platform_of(request),
        caller,
        status=status,
        recovery_status=recovery_status,
        definition=definition,
        created_after=created_after,
        created_before=created_before,
        cursor=cursor,
        limit=limit,
        parameters=runs.parse_parameter_filters(param or [], "param"),
    )
    return page.as_json()


@router.get("/runs/{run_id}", responses=ERROR_RESPONSES)
def get_run(request: Request, run_id: str, caller: Viewer) -> dict[str, Any]:
    """One run as read now (``views.shown_run``: the run JSON of `dataflow show --json`)."""
    return {"run": operations.get_run(platform_of(request), caller, run_id).as_json()}


@router.get("/runs/{run_id}/evidence", responses=ERROR_RESPONSES)
def get_evidence(request: Request, run_id: str, caller: Viewer) -> dict[str, Any]:
    """The run's ledger entries, the verification result and the latest verified checkpoint."""
    return operations.evidence_of(platform_of(request), caller, run_id).as_json()


ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"


@router.get(
    "/runs/{run_id}/result",
    response_class=StreamingResponse,
    responses={
        **ERROR_RESPONSES,
        200: {
            "description": "The stored result: the exact committed bytes, an Arrow IPC stream",
            "content": {ARROW_STREAM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
        409: {"description": "The run stored no result (queued or running yet, or it failed or was cancelled first)"},
    },
)
def get_result(request: Request, run_id: str, caller: Viewer) -> StreamingResponse:
    """The run's stored result bytes (what `dataflow result` exports), as an Arrow IPC stream sent in pieces
    of ``results.READ_CHUNK_BYTES``, each read from the database in its own short read transaction (a stored
    result never changes), so a download holds one piece in memory and no database connection while the
    client reads; ``Content-Length`` is its size. 404 for another tenant's run, as for one that does not
    exist; 409 when the run stored no result."""
    db = platform_of(request).db
    with db.read() as conn:
        runs.get(conn, run_id, caller.tenant)  # NotFound for another tenant's run too
        with results.open_stored(conn, run_id) as found:
            if found is None:
                raise Conflict(f"run {run_id} has no stored result")
            size = found[1].size
    slots: threading.BoundedSemaphore = request.app.state.result_downloads
    if not slots.acquire(blocking=False):
        raise StorageUnavailable(
            f"{RESULT_DOWNLOADS_MAX} result downloads are in progress on this server: ask again shortly"
        )
    headers = {"Content-Length": str(size)}
    try:
        pieces = _result_pieces(db, run_id, size, slots)
    except BaseException:
        slots.release()
        raise
    return StreamingResponse(pieces, media_type=ARROW_STREAM_MEDIA_TYPE, headers=headers)


async def _result_pieces(
    db: Database, run_id: str, size: int, slot: threading.BoundedSemaphore
) -> AsyncIterator[bytes]:
    """The stored bytes piece by piece, each read in the thread pool (the event loop never waits on the
    database); the download's slot is released when the stream ends, fails or its client goes away."""
    try:
        pieces = _stored_pieces(db, run_id, size)
        while (piece := await run_in_threadpool(next, pieces, None)) is not None:
            yield piece
    finally:
        slot.release()


def _stored_pieces(db: Database, run_id: str, size: int) -> Iterator[bytes]:
    """The ``size`` stored bytes, a piece at a time, each read by ``results.open_stored``'s chunked reader in a
    read transaction that ends before the piece is handed on (none is open while the client reads it)."""
    position = 0
    while position < size:
        with db.read() as conn, results.open_stored(conn, run_id) as found:
            if found is None or found[1].size != size:
                raise InvariantViolation("a stored result is never deleted or changed, and the route found it")
            reader = found[1]
            reader.seek(position)
            piece = bytes(reader.read(min(results.READ_CHUNK_BYTES, size - position)))
        position += len(piece)
        yield piece


@router.post(
    "/runs/{run_id}/reconcile",
    responses={**ERROR_RESPONSES, 409: {"description": "Nothing to reconcile"}},
    openapi_extra=body_openapi(ReconcileBody, required=False),
)
def reconcile_run(request: Request, run_id: str, caller: OpsActor, body: ReconcileJson) -> dict[str, Any]:
    """Inspect the sink for an outcome_unknown run (operator role of its tenant, or platform_operator);
    ``resume`` re-dispatches after absence."""
    platform = platform_of(request)
    started = time.perf_counter()
    result = operations.reconcile_run(platform, caller, run_id, resume=body.resume)
    request.app.state.metrics.observe_commit("reconcile", time.perf_counter() - started)
    return {
        "run": operations.shown(platform, result.run).as_json(),
        "finding": result.finding,
        "detail": result.detail,
        "resumed": result.resumed,
    }


@router.post(
    "/runs/{run_id}/cancel",
    responses={**ERROR_RESPONSES, 409: {"description": "Finished, or dispatch authorized: not cancellable"}},
)
def cancel_run(request: Request, run_id: str, caller: OpsActor) -> dict[str, Any]:
    """Cancel a queued run, or a running one before dispatch authorization (operator role of its tenant, or
    platform_operator). After the
    authorization a publication may exist: 409 with the reconcile instruction."""
    platform = platform_of(request)
    result = operations.cancel_run(platform, caller, run_id)
    shown = operations.shown(platform, result.run).as_json()
    return {"run": shown, "cancelled": result.cancelled, "detail": result.detail}


@router.get("/definitions", responses=ERROR_RESPONSES)
def list_definitions(request: Request, caller: Viewer) -> dict[str, Any]:
    """The pinned definitions the caller's tenant has run."""
    with platform_of(request).db.read() as conn:
        found = ops_ledger.list_definitions(conn, caller.tenant)
    return {"definitions": [asdict(d) for d in found]}


class ValidateBody(BaseModel):
    """What to validate: exactly one of a definition document or a pinned hash, and the parameters."""

    model_config = ConfigDict(extra="forbid")

    definition: dict[str, Any] | None = Field(default=None, description="The definition document as JSON")
    definition_hash: str | None = Field(default=None, max_length=71, description="A definition already pinned")
    parameters: dict[str, Any] = Field(default_factory=dict)


@router.post("/definitions/validate", responses=ERROR_RESPONSES, openapi_extra=body_openapi(ValidateBody))
def validate_definition(
    request: Request, caller: Submitter, body: Annotated[ValidateBody, Depends(json_body(ValidateBody))]
) -> dict[str, Any]:
    """Check a definition as a run in the caller's tenant would, reading no data and recording nothing:
    200 with ``valid`` and every problem (step, source, column, parameter); 422 when it does not parse."""
    from durable_dataflow.dataflow.protocol.validation import validate_definition as validate

    platform = platform_of(request)
    d = operations.definition_from_request(platform, caller, body.definition, body.definition_hash)
    space = request.app.state.tenancy.workspace(caller.tenant)
    return validate(platform.runs, d, body.parameters, space, caller.access()).as_json()


@router.get("/datasources", responses=ERROR_RESPONSES)
def list_datasources(request: Request, caller: Viewer) -> dict[str, Any]:
    """The caller's tenant's datasources (registered by its runs' first publications) and the platform's
    declarations (tenant "*"), never another tenant's; options hold secret references only, never values."""
    with platform_of(request).db.read() as conn:
        found = registry.list_datasources(conn, caller.tenant)
    return {
        "datasources": [
            {
                "name": d.name,
                "provider": d.provider,
                "location": d.location,
                "options": dict(d.options),
                "registered_at": d.registered_at.isoformat(),
                "tenant": d.tenant,
                "created_by_run": d.created_by_run,
            }
            for d in found
        ],
        "providers": registry.available_providers(),
    }


# The longest --from/--to value a partition status accepts (a partition value is a parameter's value).
PARTITION_BOUND_CHARS_MAX = 200


@router.get("/datasources/{name}/partitions", responses=ERROR_RESPONSES)
def datasource_partitions(
    request: Request,
    name: str,
    caller: Viewer,
    first: str | None = Query(default=None, alias="from", max_length=PARTITION_BOUND_CHARS_MAX),
    last: str | None = Query(default=None, alias="to", max_length=PARTITION_BOUND_CHARS_MAX),
) -> dict[str, Any]:
    """The partitions of the caller's tenant's datasource (``dataflow partitions``): per partition value its
    current publication and the runs after it; the missing days of a date range. 404 when the tenant
    has no partitioned run of it (another tenant's datasource is unknown here)."""
    platform = platform_of(request)
    with platform.db.read() as conn:
        return partitions.status(conn, platform.db, caller.tenant, name, first, last, partitions.API_BOUNDS).as_json()


@router.get("/ops/ledger", responses=ERROR_RESPONSES)
def ops_ledger_projection(request: Request, caller: OpsReader) -> dict[str, Any]:
    """The Ops ledger projection: of the caller's tenant (operator role), or platform-wide, every tenant's
    unresolved runs included (platform_operator role, ``tenant`` null)."""
    return ops_ledger.read_projection(platform_of(request).db, tenant=caller.ops_tenant).as_json()


WORKERS_NEED_PLATFORM = (
    "the fleet is platform-wide: GET /v1/workers needs a platform_operator token (dataflow tokens create --platform)"
)


@router.get("/workers", responses=ERROR_RESPONSES)
def list_workers(request: Request, caller: OpsReader) -> dict[str, Any]:
    """Every worker process and `dataflow serve` sweeper, alive, dead or stopped, with its host, pid, version,
    start, last beat and attempts in flight (platform_operator role only: a tenant token is refused)."""
    if not caller.token.is_platform:
        raise PermissionDenied(WORKERS_NEED_PLATFORM)
    return fleet.document(fleet.list_workers(platform_of(request).db))
