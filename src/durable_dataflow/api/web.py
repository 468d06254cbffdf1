"""The web operator view: server-rendered pages, readable without JavaScript.

Pages: /ui/login, /ui/runs (history, with a warning block on every unresolved run and charts of the
last days: runs by outcome, durations per definition), /ui/runs/{id} (times and phases, the ledger
timeline on a time axis and as a table, verification, publication references, the Reconcile form for
operators),
/ui/schedules (the tenant's schedules, with a warning block on every unresolved last run, each
schedule's recent runs, and the tenant's backfills with their progress), /ui/backfills/{name} (every
day of a definition's backfills with its run),
/ui/datasources/{name}/partitions (a partitioned datasource's partitions as a grid of partition ×
state, each cell linking to its runs) and
/ui/ops (the Ops ledger projection of the operator's tenant, or of every tenant for a platform
operator, whose token opens no other page, with a chart of unresolved and failed runs over time).
POST forms carry a CSRF token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from durable_dataflow.api import auth, charts, operations, tokens
from durable_dataflow.api.auth import SESSION_COOKIE, SESSION_MAX_AGE_S, check_csrf, csrf_token, platform_of, web_caller
from durable_dataflow.api.errors import HTTP_STATUS_BY_CODE
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.errors import DataflowError, Unauthenticated
from durable_dataflow.core.text import printable
from durable_dataflow.core.units import US_PER_S
from durable_dataflow.dataflow.protocol import fleet, partitions, runs, views
from durable_dataflow.dataflow.protocol.runs import RecoveryStatus, RunStatus
from durable_dataflow.dataflow.schedules import backfill, schedules
from durable_dataflow.ops import ledger as ops_ledger

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
HISTORY_PAGE_SIZE = 50
TOKEN_FORM_CHARS_MAX = 200
# The run history's definition and parameter fields hold at most this many characters (more: 422).
FILTER_CHARS_MAX = 1_000
PARAMETERS_CELL_CHARS_MAX = 60
FINDINGS = frozenset({"present", "mismatch", "absent", "undecided"})
FINDING_TEXT = {
    "present": "The sink holds the publication with the recorded output digest. The run is now succeeded.",
    "mismatch": "The sink holds a publication under this key with ANOTHER digest. The run stays unresolved.",
    "absent": "The sink proved the publication absent and fenced the key. No earlier attempt can publish it now.",
    "undecided": "The inspection could not decide. Nothing changed; the run stays unresolved. Try again later.",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


def age_text(seconds: float) -> str:
    """A human age, in the pages' one duration form (``views.duration_text``): 850 ms, 12.3 s,
    3 min 12 s, 5 h 02 min, 3 d 04 h."""
    return views.duration_text(round(seconds * US_PER_S))


def duration_cell(run: runs.Run, now_us: int) -> str:
    """The run history's Duration: recorded → final transition (``12.3 s``); ``queued for …`` or
    ``running for …`` since recorded, on the database clock; ``—`` for an unresolved run, whose row
    moves with every reconcile attempt (``views.elapsed_us``)."""
    elapsed = views.elapsed_us(run, now_us)
    if elapsed is None:
        return "—"
    if run.status in views.FINISHED_STATUSES:
        return views.duration_text(elapsed)
    return f"{run.status} for {views.duration_text(elapsed)}"


def time_text(us: int) -> str:
    return views.time_text(us, "utc")


def parameters_cell(parameters: dict[str, Any]) -> str:
    """A run's parameters in one history cell, cut with an ellipsis (the run page shows them whole)."""
    return runs.parameters_text(parameters, PARAMETERS_CELL_CHARS_MAX)


def json_value(value: Any) -> str:
    """A ledger fact as the JSON value it is stored as (``null``, ``"text"``, ``true``), not a Python repr.
    Returned as text, so ``finalize`` (below) and autoescaping still apply to it."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


TEMPLATES.env.globals.update(age_text=age_text, time_text=time_text, parameters_cell=parameters_cell)
TEMPLATES.env.globals.update(duration_cell=duration_cell, duration_text=views.duration_text)
TEMPLATES.env.filters["json_value"] = json_value
# The templates compare a run's mode, recovery status and a partition's state with these members, never
# with string literals (a renamed member then fails where it is compared, not silently in a page).
TEMPLATES.env.globals.update(Mode=runs.Mode, RecoveryStatus=RecoveryStatus, PartitionState=partitions.PartitionState)
TEMPLATES.env.globals["FINISHED_STATUSES"] = views.FINISHED_STATUSES


def printable_output(value: Any) -> Any:
    """Jinja's ``finalize``: every ``{{ }}`` output passes here before it is escaped, so a control or
    bidirectional character a submitter put in a parameter, name, key or message reaches the page as
    a visible escape (``core.text.printable``). Markup is the templates' own and passes unchanged."""
    return value if isinstance(value, Markup) else printable(value if isinstance(value, str) else str(value))


# Set before any template is compiled: Jinja applies finalize when it compiles a template.
TEMPLATES.env.finalize = printable_output


def render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    base = {"csrf_token": csrf_token(request)}
    return TEMPLATES.TemplateResponse(request, name, {**base, **context}, status_code=status_code)


def error_page(request: Request, error: DataflowError) -> Response:
    status = HTTP_STATUS_BY_CODE.get(error.code, 500)
    return render(request, "error.html", {"caller": None, "code": error.code, "message": error.message}, status)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request) -> HTMLResponse:
    return _login_page(request, failed=False)


def _login_page(request: Request, *, failed: bool) -> HTMLResponse:
    """The login form, with the CSRF field of this browser's login nonce (set as its cookie)."""
    nonce = auth.login_nonce(request)
    context = {"caller": None, "failed": failed, "csrf_token": auth.login_csrf_token(request, nonce)}
    response = render(request, "login.html", context, status_code=401 if failed else 200)
    auth.keep_login_nonce(request, response, nonce)
    return response


@router.post("/login", response_model=None)
def login(
    request: Request,
    token: str = Form(default="", max_length=TOKEN_FORM_CHARS_MAX),
    csrf: str = Form(default="", max_length=TOKEN_FORM_CHARS_MAX),
) -> Response:
    """Check the form's CSRF field (403 before any token lookup), then the token; keep the token in
    an HttpOnly, SameSite=Strict cookie for this browser session."""
    auth.check_login_csrf(request, csrf)
    try:
        tokens.authenticate(platform_of(request).db, token.strip())
    except Unauthenticated:
        return _login_page(request, failed=True)
    response = RedirectResponse("/ui/runs", status_code=303)
    response.delete_cookie(auth.LOGIN_CSRF_COOKIE, path="/ui/login", httponly=True, samesite="strict")
    response.set_cookie(
        SESSION_COOKIE,
        token.strip(),
        max_age=SESSION_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/ui",
    )
    return response


@router.post("/logout")
def logout(request: Request, csrf: str = Form(default="")) -> RedirectResponse:
    web_caller(request, platform_wide=True)
    check_csrf(request, csrf)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/ui")
    return response


@router.get("/runs", response_class=HTMLResponse)
def history(
    request: Request,
    status: str = "",
    recovery_status: str = "",
    cursor: str = "",
    definition: str = Query(default="", max_length=FILTER_CHARS_MAX),
    param: str = Query(default="", max_length=FILTER_CHARS_MAX),
    days: int = Query(default=charts.WINDOW_DAYS_DEFAULT, ge=1, le=max(charts.WINDOW_DAYS)),
) -> Response:
    """The run history: parameters, status, Core recovery status, attempts, rows, recorded time and
    duration, and every warning; filtered by status, definition name and one ``NAME=VALUE`` parameter.
    Above it, two charts of the last ``days`` days (the definition filter applies to them): runs per
    day (per hour for up to two days) by outcome, and the duration of succeeded runs per definition."""
    caller = web_caller(request, platform_wide=True)
    if caller.token.is_platform:  # the landing page after login: a platform operator's page is /ui/ops
        return RedirectResponse("/ui/ops", status_code=303)
    page = operations.list_runs(
        platform_of(request),
        caller,
        status=status or None,
        recovery_status=recovery_status or None,
        cursor=cursor or None,
        limit=HISTORY_PAGE_SIZE,
        definition=definition or None,
        parameters=runs.parse_parameter_filters([param] if param else [], "the parameter filter"),
    )
    days, bucket_us = charts.window_of(days)
    outcomes_chart = durations_chart = None
    if not cursor:  # the charts head the newest page only: paging through older runs reads none
        found = operations.activity(
            platform_of(request), caller.tenant, days=days, bucket_us=bucket_us, definition=definition or None,
            durations=True,
        )  # fmt: skip
        outcomes_chart = charts.outcome_columns(
            found.counts, start_us=found.start_us, now_us=found.now_us, bucket_us=bucket_us
        )
        durations_chart = charts.duration_bars(found.durations, more=found.more_definitions)
    filters = {"status": status, "recovery_status": recovery_status, "definition": definition, "param": param}
    if days != charts.WINDOW_DAYS_DEFAULT:
        filters["days"] = str(days)
    context = {
        **filters,
        "days": days,
        "window_days": charts.window_choices(days),
        "outcomes_chart": outcomes_chart,
        "durations_chart": durations_chart,
        "filter_query": {name: value for name, value in filters.items() if value},
        "caller": caller,
        "page": page,
        "statuses": [s.value for s in RunStatus],
        "recovery_statuses": [s.value for s in RecoveryStatus],
    }
    return render(request, "runs.html", context)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, reconciled: str = "", cancelled: str = "") -> HTMLResponse:
    """One run: its state, times (milestones and phases), warning, publication references, verification
    and ledger timeline."""
    caller = web_caller(request)
    found = operations.evidence_of(platform_of(request), caller, run_id)
    view = found.page.shown.view
    finding = reconciled if reconciled in FINDINGS else ""
    ledger_times = [(entry.kind, entry.recorded_at_us) for entry in found.page.entries]
    phases = views.run_phases(ledger_times, found.page.shown.now_us)
    context = {
        "caller": caller,
        "evidence": found.as_json(),  # the JSON of GET /v1/runs/{id}/evidence, rendered
        "run": view.run,
        "view": view,
        # The Times block: the run's milestones and the phases between them, from its ledger entries.
        "milestones": views.run_milestones(ledger_times),
        "phases": phases,
        "total_us": phases[-1].end_us - phases[0].start_us if phases else None,
        "timeline": charts.run_timeline(
            [charts.TimelineEntry(e.seq, e.attempt, e.kind, e.recorded_at_us) for e in found.page.entries],
            phases,
            phases[-1].end_us if phases else found.page.shown.now_us,
        ),
        "is_operator": caller.token.allows(Role.OPERATOR),
        "finding": finding,
        "finding_text": FINDING_TEXT.get(finding, ""),
        "cancelled": cancelled == "yes" and view.run.status == RunStatus.CANCELLED,
        # Offered while nothing can have been published; the cancel itself decides under the lease.
        "cancellable": view.run.status in (RunStatus.QUEUED, RunStatus.RUNNING)
        and view.run.publication_idempotency_key is None,
    }
    return render(request, "run.html", context)


@router.post("/runs/{run_id}/reconcile")
def reconcile(request: Request, run_id: str, csrf: str = Form(default=""), resume: str = Form(default="")) -> Response:
    """Reconcile (operator role), then show the run page with the finding (POST, redirect, GET)."""
    caller = web_caller(request, Role.OPERATOR)
    check_csrf(request, csrf)
    result = operations.reconcile_run(platform_of(request), caller, run_id, resume=resume == "yes")
    return RedirectResponse(f"/ui/runs/{result.run.run_id}?reconciled={result.finding}", status_code=303)


@router.get("/schedules", response_class=HTMLResponse)
def schedules_page(request: Request) -> HTMLResponse:
    """The tenant's schedules: cron, time zone, state, next and last tick, the last run (UNRESOLVED with
    its warning block when it is), as ``dataflow schedules list`` shows them."""
    caller = web_caller(request)
    db = platform_of(request).db
    found = schedules.shown(db, caller.tenant)
    recent = backfill.recent_runs(db, caller.tenant, [item.status.applied.name for item in found])
    context = {
        "caller": caller,
        "items": found,
        # Per schedule: its newest runs, ticks and backfill days of its definition together.
        "recent": recent,
        "backfills": backfill.summaries(db, caller.tenant),
        "progress_states": backfill.PROGRESS_STATES,
    }
    return render(request, "schedules.html", context)


@router.get("/backfills/{name}", response_class=HTMLResponse)
def backfill_page(request: Request, name: str) -> HTMLResponse:
    """The backfills of definition ``name``: days per state, and every day with its run (linked), status,
    Core recovery status and duration; 404 when the tenant has no backfill of that name."""
    caller = web_caller(request)
    found = backfill.progress(platform_of(request).db, caller.tenant, name)
    context = {"caller": caller, "found": found, "progress_states": backfill.PROGRESS_STATES}
    return render(request, "backfill.html", context)


# The grid's columns: a partition's current publication, the states of the runs after it, and missing.
PARTITION_GRID_STATES = ("published", *(s.value for s in partitions.PendingState), "missing")
# The longest from/to value the partition page accepts (as GET /v1/datasources/{name}/partitions).
PARTITION_BOUND_CHARS_MAX = 200


@router.get("/datasources/{name}/partitions", response_class=HTMLResponse)
def partitions_page(
    request: Request,
    name: str,
    first: str = Query(default="", alias="from", max_length=PARTITION_BOUND_CHARS_MAX),
    last: str = Query(default="", alias="to", max_length=PARTITION_BOUND_CHARS_MAX),
) -> HTMLResponse:
    """The tenant's partitions of ``name`` (``dataflow partitions``) as a grid: one row per partition, one
    column per state, each cell coloured and linking to its runs; 404 for another tenant's datasource."""
    caller = web_caller(request)
    platform = platform_of(request)
    with platform.db.read() as conn:
        found = partitions.status(
            conn, platform.db, caller.tenant, name, first or None, last or None, partitions.API_BOUNDS
        )
    context = {"caller": caller, "found": found, "states": PARTITION_GRID_STATES, "first": first, "last": last}
    return render(request, "partitions.html", context)


@router.post("/runs/{run_id}/cancel")
def cancel(request: Request, run_id: str, csrf: str = Form(default="")) -> Response:
    """Cancel (operator role), then show the run page (POST, redirect, GET); a refusal is the error page."""
    caller = web_caller(request, Role.OPERATOR)
    check_csrf(request, csrf)
    result = operations.cancel_run(platform_of(request), caller, run_id)
    return RedirectResponse(f"/ui/runs/{result.run.run_id}?cancelled=yes", status_code=303)


# The API reference page: Swagger UI, its script and stylesheet served by the app (app.API_DOCS_ASSETS), started
# by static/docs.js. Its policy allows scripts and styles from this origin only (no inline script or style,
# no eval: Swagger UI 5 renders under it in Chromium) and the data: images of its stylesheet's icons.
API_DOCS_PAGE = "/ui/docs"
API_DOCS_CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


@router.get("/docs", response_class=HTMLResponse)
def api_docs_page(request: Request) -> HTMLResponse:
    """The interactive API reference (any tenant token, as GET /openapi.json): Swagger UI over
    /ui/openapi.json, every script and stylesheet from this server."""
    caller = web_caller(request)
    response = render(request, "docs.html", {"caller": caller})
    response.headers["Content-Security-Policy"] = API_DOCS_CONTENT_SECURITY_POLICY
    return response


@router.get("/openapi.json")
def api_docs_document(request: Request) -> dict[str, Any]:
    """The OpenAPI document of GET /openapi.json, for the reference page (the session cookie, read-only)."""
    web_caller(request)
    document: dict[str, Any] = request.app.openapi()
    return document


# The Ops page's chart: the runs that need an operator, by the day (hour) they were recorded.
OPS_CHART_OUTCOMES = (runs.OUTCOME_UNRESOLVED, runs.RunStatus.FAILED.value)


@router.get("/ops", response_class=HTMLResponse)
def ops_page(
    request: Request, days: int = Query(default=charts.WINDOW_DAYS_DEFAULT, ge=1, le=max(charts.WINDOW_DAYS))
) -> HTMLResponse:
    """The Ops ledger projection of the operator's tenant, or platform-wide for a platform operator, with
    a chart of the unresolved and failed runs over the last ``days`` days, by the day they were recorded."""
    caller = web_caller(request, Role.OPERATOR, platform_wide=True)
    platform = platform_of(request)
    db = platform.db
    projection = ops_ledger.read_projection(db, tenant=caller.ops_tenant)
    # The fleet is platform-wide: a tenant's operator does not see other tenants' workers' hosts.
    fleet_rows = fleet.list_workers(db) if caller.token.is_platform else None
    days, bucket_us = charts.window_of(days)
    found = operations.activity(platform, caller.ops_tenant, days=days, bucket_us=bucket_us, durations=False)
    trouble = charts.outcome_columns(
        found.counts, start_us=found.start_us, now_us=found.now_us, bucket_us=bucket_us, outcomes=OPS_CHART_OUTCOMES
    )
    context = {
        "caller": caller,
        "projection": projection,
        "workers": fleet_rows,
        "days": days,
        "window_days": charts.window_choices(days),
        "trouble_chart": trouble,
    }
    return render(request, "ops.html", context)
