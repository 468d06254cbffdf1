"""The ONE table from DataflowError codes to HTTP statuses, and the error body every answer uses.

Every error answer is ``{"error": {"code": ..., "message": ...}}``; a quota refusal (429) adds
``quota`` and ``limit`` to it and a ``Retry-After`` header. A code missing from the table
is a programming error and answers 500 with its code; an unexpected exception answers 500 with a
fixed message, so no internal detail (or secret) can leak through an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import islice
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from durable_dataflow.core.errors import DataflowError, QuotaExceeded
from durable_dataflow.core.invariants import InvariantViolation

HTTP_STATUS_BY_CODE: Mapping[str, int] = {
    "invalid_input": 422,
    "missing_capability": 422,
    "execution_failed": 422,
    "limit_exceeded": 422,
    "partition_violation": 422,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "payload_too_large": 413,
    "conflict": 409,
    "stale_attempt": 409,
    "lease_unavailable": 409,
    "evidence_failed": 409,
    "location_missing": 409,
    "interrupted": 409,
    "quota_exceeded": 429,
    "inconclusive": 502,
    "storage_unavailable": 503,
    "internal": 500,
}
# Starlette's own HTTP errors (unknown route, wrong method) get a code from this table.
CODE_BY_HTTP_STATUS: Mapping[int, str] = {
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}
MESSAGE_CHARS_MAX = 2000
VALIDATION_ERRORS_SHOWN_MAX = 5


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message[:MESSAGE_CHARS_MAX]}}


# Starlette answers a malformed form (too many fields or files) with 400; the table has no 400.
MALFORMED_REQUEST_STATUS = 400


def error_response(code: str, message: str) -> JSONResponse:
    status = HTTP_STATUS_BY_CODE.get(code, 500)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


ErrorT = TypeVar("ErrorT", bound=Exception)


def handled_as(error: Exception, kind: type[ErrorT]) -> ErrorT:
    """``error`` as the kind its handler was registered for. Starlette calls an exception handler only
    with that kind, so any other is a bug: raised always (an ``assert`` vanishes under ``python -O``)."""
    if not isinstance(error, kind):
        raise InvariantViolation(f"the handler of {kind.__name__} was called with {type(error).__name__}")
    return error


async def on_dataflow_error(request: Request, error: Exception) -> JSONResponse:
    error = handled_as(error, DataflowError)
    if isinstance(error, QuotaExceeded):
        return quota_response(error)
    return error_response(error.code, error.message)


def quota_response(error: QuotaExceeded) -> JSONResponse:
    """429 naming the quota and its limit, with ``Retry-After`` (seconds) saying when to try again."""
    body: dict[str, dict[str, Any]] = {"error": {**error_body(error.code, error.message)["error"]}}
    body["error"].update({"quota": error.quota, "limit": error.limit})
    status = HTTP_STATUS_BY_CODE[error.code]
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(error.retry_after_s)})


def validation_message(problems: Iterable[Mapping[str, Any]], prefix: tuple[str, ...] = ()) -> str:
    """The invalid_input message for pydantic's errors: each location and message, never the input.

    ``prefix`` goes before each location, so a body validated by hand reads like one FastAPI validated
    (``body.max_attempts: ...``).
    """
    shown = [
        f"{'.'.join(str(part) for part in (*prefix, *e.get('loc', ())))}: {e.get('msg', 'invalid')}"
        for e in islice(problems, VALIDATION_ERRORS_SHOWN_MAX)
    ]
    return "invalid request: " + "; ".join(shown)


async def on_validation_error(request: Request, error: Exception) -> JSONResponse:
    error = handled_as(error, RequestValidationError)
    # Only locations and messages: the offending input may hold a secret and is never echoed.
    return error_response("invalid_input", validation_message(error.errors()))


# Starlette's 404 for a path no route has: answered with where the API reference is instead.
NOT_FOUND_STATUS = 404
NOT_FOUND_DETAIL = "Not Found"
SEE_API_REFERENCE = (
    "see /docs for the API reference (a page of the web view: log in at /ui/login with a token) or GET "
    "/openapi.json with Authorization: Bearer ddf_..."
)


async def on_http_error(request: Request, error: Exception) -> JSONResponse:
    error = handled_as(error, StarletteHTTPException)
    if error.status_code == MALFORMED_REQUEST_STATUS:  # Starlette's form parser ("Too many fields")
        return error_response("invalid_input", str(error.detail))  # 422, as the one table says
    code = CODE_BY_HTTP_STATUS.get(error.status_code, "invalid_input")
    message = str(error.detail)
    if error.status_code == NOT_FOUND_STATUS and message == NOT_FOUND_DETAIL:  # no route has this path
        message = f"no endpoint has this path; {SEE_API_REFERENCE}"
    response = error_response(code, message)
    response.status_code = error.status_code
    return response


async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
    return error_response("internal", "internal error; the server log has the details")
