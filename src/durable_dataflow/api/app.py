"""The FastAPI application: the /v1 JSON API, the web operator view, /metrics, /healthz, OpenAPI.

``create_app(platform)`` builds one application over one Platform; nothing is process-global, so a
test can serve two platforms side by side. Only /healthz, the login page and the static files (the
stylesheet, the API reference page's scripts) answer without a token; /docs redirects to the reference
page, /ui/docs, which needs a session like every page.
"""

from __future__ import annotations

import importlib.resources
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from durable_dataflow import __version__
from durable_dataflow.api import errors, inline, middleware, schedules_api, v1, web
from durable_dataflow.api.auth import api_caller, platform_of
from durable_dataflow.api.metrics import Metrics
from durable_dataflow.api.operations import Caller
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.errors import DataflowError, InputError, Unauthenticated
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.platform import Platform

STATIC_DIR = Path(__file__).parent / "static"
# Swagger UI's files for the API reference page (/ui/docs), from the installed fastapi-offline package (the
# server extra), served under this path by the app itself: the page loads nothing from another host.
API_DOCS_ASSETS = Path(str(importlib.resources.files("fastapi_offline") / "static"))
API_DOCS_ASSETS_PATH = "/static/apidocs"
CSRF_KEY_BYTES = 32
HEALTH_UNREACHABLE = "the platform database is unreachable; the server log has the details"
logger = logging.getLogger(__name__)


def create_app(
    platform: Platform,
    *,
    data_root: Path | None = None,
    sink_root: Path | None = None,
    body_bytes_max: int | None = None,
) -> FastAPI:
    """The application over ``platform``. Each tenant's sources resolve under ``<data_root>/<tenant>``
    and its file sinks under ``<sink_root>/<tenant>`` (``dataflow.execution.workspace.server_tenancy``: an
    implicit root that would expose the working directory, the database or the secrets refuses).
    Request bodies over ``body_bytes_max`` (else $DATAFLOW_API_BODY_BYTES_MAX, else 4 MiB) answer 413."""
    app = FastAPI(
        title="Durable Dataflow API",
        version=__version__,
        description="Runs with provable recovery. Every endpoint but /healthz needs `Authorization: Bearer ddf_...`.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.platform = platform
    app.state.tenancy = workspace.server_tenancy(
        data_root=data_root, sink_root=sink_root, platform_files=platform.db.files(), grants=platform.runs.config.grants
    )
    app.state.metrics = Metrics(platform.db)
    # Inline submits execute here, bounded per server and per tenant, never in FastAPI's thread pool.
    app.state.inline = inline.InlineExecutor(platform.config.quotas)
    # Result downloads in progress at once (GET /v1/runs/{id}/result): each holds a few MiB while its client
    # reads, so a client that never reads cannot make many of them hold the server's memory.
    app.state.result_downloads = threading.BoundedSemaphore(v1.RESULT_DOWNLOADS_MAX)
    # The CSRF key lives only in this process: a restart invalidates open forms, nothing else.
    app.state.csrf_key = secrets.token_bytes(CSRF_KEY_BYTES)
    _install_error_handlers(app)
    # Added innermost first: timing sees every answer, and the headers cover the body limit's 413.
    app.add_middleware(middleware.BodyLimit, body_bytes_max=middleware.body_bytes_max_from_env(override=body_bytes_max))
    app.add_middleware(middleware.SecurityHeaders)
    _install_timing(app)
    app.include_router(v1.router)
    app.include_router(schedules_api.router)
    app.include_router(web.router)
    # Before /static: the more specific mount is matched first.
    app.mount(API_DOCS_ASSETS_PATH, StaticFiles(directory=API_DOCS_ASSETS), name="apidocs")
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _add_platform_routes(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def on_dataflow_error(request: Request, error: Exception) -> Response:
        if request.url.path.startswith("/ui/"):
            error = errors.handled_as(error, DataflowError)
            if isinstance(error, Unauthenticated):
                return RedirectResponse("/ui/login", status_code=303)
            return web.error_page(request, error)
        return await errors.on_dataflow_error(request, error)

    async def on_validation_error(request: Request, error: Exception) -> Response:
        # A form on a page is refused on the page (its HTML error), as a DataflowError is.
        if request.url.path.startswith("/ui/"):
            error = errors.handled_as(error, RequestValidationError)
            return web.error_page(request, InputError(errors.validation_message(error.errors())))
        return await errors.on_validation_error(request, error)

    async def on_http_error(request: Request, error: Exception) -> Response:
        error = errors.handled_as(error, StarletteHTTPException)
        if request.url.path.startswith("/ui/") and error.status_code == errors.MALFORMED_REQUEST_STATUS:
            return web.error_page(request, InputError(str(error.detail)))
        return await errors.on_http_error(request, error)

    app.add_exception_handler(DataflowError, on_dataflow_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)

    async def on_unexpected(request: Request, error: Exception) -> Response:
        # Answered outside every middleware (by Starlette's ServerErrorMiddleware): add the headers here.
        response = await errors.on_unexpected(request, error)
        response.headers.update(middleware.security_headers(request.url.path))
        return response

    app.add_exception_handler(Exception, on_unexpected)


def _install_timing(app: FastAPI) -> None:
    @app.middleware("http")
    async def time_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        template = getattr(route, "path", "unmatched")
        app.state.metrics.observe_request(request.method, template, response.status_code, time.perf_counter() - started)
        return response


def _add_platform_routes(app: FastAPI) -> None:
    @app.get("/healthz", tags=["platform"])
    def healthz(request: Request) -> JSONResponse:
        """Liveness and database reachability; no token needed, so the answer names no host, port,
        user or driver text: those go to the server log only."""
        db = platform_of(request).db
        try:
            with db.read() as conn:
                db.now_us(conn)
        except DataflowError as error:
            logger.warning("healthz: the platform database is unreachable: %s", error.message)
            return errors.error_response("storage_unavailable", HEALTH_UNREACHABLE)
        return JSONResponse({"status": "ok", "database": db.dialect})

    @app.get("/metrics", tags=["platform"], response_class=Response)
    def metrics(request: Request, caller: Caller = Depends(api_caller(Role.OPERATOR, platform_wide=True))) -> Response:
        """Prometheus metrics (operator, platform_operator): platform-wide aggregates, no run ids, no tenants."""
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(caller: Caller = Depends(api_caller(Role.VIEWER))) -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    @app.get("/redoc", include_in_schema=False)
    def api_docs() -> RedirectResponse:
        """The API reference is a page of the web view (/ui/docs): it reads the session cookie as every page
        does, so a browser without a session is sent to the login form from there."""
        return RedirectResponse(web.API_DOCS_PAGE, status_code=303)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/runs", status_code=303)
