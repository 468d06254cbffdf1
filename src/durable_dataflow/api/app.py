"""The FastAPI application: the /v1 JSON API, the web operator view, /metrics, /healthz, OpenAPI.

``create_app(platform)`` builds one application over one Platform; nothing is process-global, so a
test can serve two platforms side by side. Only /healthz, the login page and the stylesheet answer
without a token.
"""

from __future__ import annotations

import secrets
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
from durable_dataflow.api import errors, v1, web
from durable_dataflow.api.auth import api_caller, platform_of
from durable_dataflow.api.metrics import Metrics
from durable_dataflow.api.operations import Caller, data_root_from_env
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.errors import DataflowError, Unauthenticated
from durable_dataflow.platform import Platform

STATIC_DIR = Path(__file__).parent / "static"
CSRF_KEY_BYTES = 32


def create_app(platform: Platform, *, data_root: Path | None = None) -> FastAPI:
    """The application over ``platform``; API-submitted source paths resolve under ``data_root``."""
    app = FastAPI(
        title="Durable Dataflow API",
        version=__version__,
        description="Runs with provable recovery. Every endpoint but /healthz needs `Authorization: Bearer ddf_...`.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.platform = platform
    app.state.data_root = (data_root or data_root_from_env()).resolve()
    app.state.metrics = Metrics(platform.db)
    # The CSRF key lives only in this process: a restart invalidates open forms, nothing else.
    app.state.csrf_key = secrets.token_bytes(CSRF_KEY_BYTES)
    _install_error_handlers(app)
    _install_timing(app)
    app.include_router(v1.router)
    app.include_router(web.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _add_platform_routes(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def on_dataflow_error(request: Request, error: Exception) -> Response:
        if request.url.path.startswith("/ui/"):
            assert isinstance(error, DataflowError)
            if isinstance(error, Unauthenticated):
                return RedirectResponse("/ui/login", status_code=303)
            return web.error_page(request, error)
        return await errors.on_dataflow_error(request, error)

    app.add_exception_handler(DataflowError, on_dataflow_error)
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.on_http_error)
    app.add_exception_handler(Exception, errors.on_unexpected)


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
        """Liveness and database reachability; no token needed."""
        db = platform_of(request).db
        try:
            with db.read() as conn:
                db.now_us(conn)
        except DataflowError as error:
            return errors.error_response("storage_unavailable", f"the database is unreachable: {error.message}")
        return JSONResponse({"status": "ok", "database": db.dialect})

    @app.get("/metrics", tags=["platform"], response_class=Response)
    def metrics(request: Request, caller: Caller = Depends(api_caller(Role.OPERATOR))) -> Response:
        """Prometheus metrics (operator role): platform-wide aggregates, no run ids, no tenants."""
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(caller: Caller = Depends(api_caller(Role.VIEWER))) -> dict[str, Any]:
        return app.openapi()

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/runs", status_code=303)
