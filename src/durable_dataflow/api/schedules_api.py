"""Schedules and backfills in the JSON API under /v1 (docs/api.md, docs/schedules.md): the same facts
and refusals as ``dataflow schedules …`` and ``dataflow backfill``, through the same functions
(``dataflow.schedules.schedules``, ``dataflow.schedules.backfill``), for the caller's tenant only.

A schedule of another tenant answers 404 exactly like one that does not exist; a platform operator
token answers 403 on every route here (a schedule is a tenant's). The server's database clock is
the present instant: the API has no ``--now``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from durable_dataflow.api import operations, v1
from durable_dataflow.api.auth import api_caller, platform_of
from durable_dataflow.api.bodies import body_openapi, json_body
from durable_dataflow.api.operations import Caller
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.definitions.schedule_spec import SCHEDULE_PARAMETERS_MAX
from durable_dataflow.dataflow.schedules import backfill, schedules
from durable_dataflow.platform import Platform

router = APIRouter(prefix="/v1", tags=["schedules"])

Viewer = Annotated[Caller, Depends(api_caller(Role.VIEWER))]
Operator = Annotated[Caller, Depends(api_caller(Role.OPERATOR))]
DAY_CHARS_MAX = 32
DECISIONS_DEFAULT = 20
NAME_CHARS_MAX = 200  # a schedule's name is a definition name (schedule_schema.NAME_LENGTH)
ERROR_RESPONSES = v1.ERROR_RESPONSES


class ApplyScheduleBody(BaseModel):
    """A definition document with a ``schedule:`` block, as POST /v1/runs takes it inline."""

    model_config = ConfigDict(extra="forbid")

    definition: dict[str, Any] = Field(description="The definition document as JSON, with its schedule block")


class BackfillBody(BaseModel):
    """A backfill: exactly one of an inline definition document or a registered definition hash, and a
    range of days (both included)."""

    model_config = ConfigDict(extra="forbid")

    definition: dict[str, Any] | None = Field(default=None, description="The definition document as JSON")
    definition_hash: str | None = Field(default=None, max_length=71, description="A definition already pinned")
    first: str = Field(alias="from", max_length=DAY_CHARS_MAX, description="The first day, YYYY-MM-DD")
    last: str = Field(alias="to", max_length=DAY_CHARS_MAX, description="The last day (included), YYYY-MM-DD")
    parameters: dict[str, StrictStr | StrictInt | StrictFloat | StrictBool] = Field(
        default_factory=dict,
        max_length=SCHEDULE_PARAMETERS_MAX,
        description="Values or templates such as {{ tick.date }}; they override the schedule's",
    )
    only_missing: StrictBool = Field(
        default=False, description="Submit only the days whose partition has no current publication (a submit only)"
    )
    stale: StrictBool = Field(
        default=False, description="With only_missing: also the days another definition hash published (a submit only)"
    )


# Bodies are dependencies declared after the caller's, so they are read only once the token is checked.
ApplyJson = Annotated[ApplyScheduleBody, Depends(json_body(ApplyScheduleBody))]
BackfillJson = Annotated[BackfillBody, Depends(json_body(BackfillBody))]


@router.get("/schedules", responses=ERROR_RESPONSES)
def list_schedules(
    request: Request,
    caller: Viewer,
    cursor: str | None = Query(default=None, max_length=NAME_CHARS_MAX),
    limit: int = Query(default=schedules.LIST_PAGE_DEFAULT, ge=1, le=schedules.LIST_PAGE_MAX),
) -> dict[str, Any]:
    """One page of the tenant's applied schedules by name: next tick, last tick and its decision, the
    last run's status and recovery status, and its warning when it is unresolved (as ``dataflow
    schedules list --json``); pass ``next_cursor`` back as ``cursor`` for the next page."""
    after = (caller.tenant, cursor) if cursor else None
    page = schedules.shown_page(platform_of(request).db, caller.tenant, after=after, limit=limit)
    next_after = page.next_after
    return {
        "schedules": [item.as_json() for item in page.items],
        "next_cursor": next_after[1] if next_after is not None else None,
    }


@router.post(
    "/schedules",
    status_code=201,
    responses={**ERROR_RESPONSES, 200: {"description": "Applied already: unchanged (nothing written) or updated"}},
    openapi_extra=body_openapi(ApplyScheduleBody),
)
def apply_schedule(request: Request, response: Response, caller: Operator, body: ApplyJson) -> dict[str, Any]:
    """Pin the definition and its schedule for the tenant (operator): 201 when new; 200 when it was
    applied before, with ``changed`` false when the same one was (nothing is written then)."""
    platform = platform_of(request)
    definition = operations.definition_from_request(platform, caller, body.definition, None)
    space = request.app.state.tenancy.workspace(caller.tenant)
    result = schedules.apply(platform.runs, definition, space, caller.access())
    response.status_code = 201 if result.created else 200
    return {"schedule": result.schedule.as_json(), "created": result.created, "changed": result.changed}


@router.get("/schedules/{name}", responses=ERROR_RESPONSES)
def get_schedule(
    request: Request,
    name: str,
    caller: Viewer,
    limit: int = Query(default=DECISIONS_DEFAULT, ge=1, le=schedules.DECISIONS_SHOWN_MAX),
) -> dict[str, Any]:
    """One schedule as listed, and its newest ``limit`` tick decisions, newest first."""
    db = platform_of(request).db
    (item,) = schedules.shown(db, caller.tenant, name=name)
    decided = schedules.decisions(db, caller.tenant, item.status.applied.name, limit=limit)
    return {"schedule": item.as_json(), "decisions": [d.as_json() for d in decided]}


@router.post("/schedules/{name}/pause", responses=ERROR_RESPONSES)
def pause_schedule(request: Request, name: str, caller: Operator) -> dict[str, Any]:
    """Stop deciding ticks (operator); pausing a paused schedule writes nothing."""
    return {"schedule": schedules.set_paused(platform_of(request).db, caller.tenant, name, True).as_json()}


@router.post("/schedules/{name}/resume", responses=ERROR_RESPONSES)
def resume_schedule(request: Request, name: str, caller: Operator) -> dict[str, Any]:
    """Decide ticks again from now on (operator): ticks of the paused time never run."""
    return {"schedule": schedules.set_paused(platform_of(request).db, caller.tenant, name, False).as_json()}


def _planned(platform: Platform, caller: Caller, body: BackfillBody) -> tuple[Definition, list[backfill.BackfillItem]]:
    """The body's definition and every day of its backfill, all checked (InputError before anything)."""
    definition = operations.definition_from_request(platform, caller, body.definition, body.definition_hash)
    first = backfill.parse_day(body.first, backfill.API_NAMES.first)
    last = backfill.parse_day(body.last, backfill.API_NAMES.last)
    return definition, backfill.plan(definition, caller.tenant, first, last, body.parameters, backfill.API_NAMES)


@router.post(
    "/backfills",
    status_code=201,
    responses={**ERROR_RESPONSES, 200: {"description": "Every day had its run already: nothing submitted"}, 409: {}},
    openapi_extra=body_openapi(BackfillBody),
)
def submit_backfill(request: Request, response: Response, caller: Operator, body: BackfillJson) -> dict[str, Any]:
    """Queue one run per day (or per tick of the definition's schedule) under the key
    ``backfill:<tenant>:<name>:<tick>`` (operator). Everything is checked before the first run is
    recorded; calling it again submits only the days without a run and reports every day."""
    platform = platform_of(request)
    definition, items = _planned(platform, caller, body)
    results = backfill.run_selected(
        platform.runs,
        definition,
        items,
        only_missing=body.only_missing,
        stale=body.stale,
        access=caller.access(),
        provenance=caller.provenance(),
        workspace=request.app.state.tenancy.workspace(caller.tenant),
    )
    shown = backfill.load_views(platform.db, results)
    created = sum(1 for r in results if r.created)
    skipped = sum(1 for r in results if r.skipped)
    response.status_code = 201 if created else 200
    return {
        "definition": definition.name,
        "runs": [r.as_json(v) for r, v in zip(results, shown, strict=True)],
        "submitted_total": created,
        "existed_total": len(results) - created - skipped,
        "unresolved_total": sum(1 for v in shown if v.unresolved),
        "skipped_total": skipped,
    }


@router.post("/backfills/cancel", responses=ERROR_RESPONSES, openapi_extra=body_openapi(BackfillBody))
def cancel_backfill(request: Request, caller: Operator, body: BackfillJson) -> dict[str, Any]:
    """Cancel every day's run of the backfill (the same body) that cannot have published yet, and report
    every day: ``cancelled``, ``already_cancelled``, ``finished``, ``refused`` (its dispatch was
    authorized: reconcile it) or ``no_run`` (operator). 200 even when some day was refused."""
    if body.only_missing or body.stale:
        raise InputError("only_missing and stale apply to submitting a backfill, not to cancelling one")
    platform = platform_of(request)
    definition, items = _planned(platform, caller, body)
    results = backfill.cancel_runs(
        platform.runs, caller.tenant, items, access=caller.access(), provenance=caller.provenance()
    )
    totals = {str(o): sum(1 for r in results if r.outcome == o) for o in backfill.CancelOutcome}
    return {"definition": definition.name, "runs": [r.as_json() for r in results], "totals": totals}
