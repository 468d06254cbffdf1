"""Two pure-ASGI middlewares around the whole application: a request-body size limit and the
security headers of every response.

Pure ASGI rather than ``@app.middleware("http")``: the body limit must see each chunk as the server
receives it (a chunked body has no Content-Length to check up front), and both must also cover
answers produced without a route (404s, 405s, static files, the 413 itself).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from durable_dataflow.api import errors
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions.definitions import parse_size

BODY_BYTES_MAX_VARIABLE = "DATAFLOW_API_BODY_BYTES_MAX"
# Far above any real request (a definition is at most 1 MiB), far below what hurts a server.
BODY_BYTES_MAX_DEFAULT = 4 * 1024 * 1024
STATIC_PREFIX = "/static/"

# No script at all, styles and images from this origin only, never framed, forms post only here.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'none'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# API answers and pages show one tenant's runs to one token: no browser or proxy may keep them.
NO_STORE = {"Cache-Control": "no-store"}


def body_bytes_max_from_env(environ: Mapping[str, str] = os.environ, override: int | None = None) -> int:
    """The request-body limit in bytes: ``override`` (None = not given), else the variable (bytes or a
    size such as ``8MiB``), else 4 MiB. A bad value raises InputError naming where it came from."""
    raw: int | str
    if override is not None:
        origin, raw = "body_bytes_max", override
    elif environ.get(BODY_BYTES_MAX_VARIABLE, "").strip():
        origin, raw = BODY_BYTES_MAX_VARIABLE, environ[BODY_BYTES_MAX_VARIABLE].strip()
    else:
        return BODY_BYTES_MAX_DEFAULT
    try:
        size = parse_size(raw) if not isinstance(raw, bool) else 0
    except ValueError as error:
        raise InputError(f"{origin}: {error}") from None
    if size < 1:
        raise InputError(f"{origin} (the largest request body the API accepts) must be at least 1 byte")
    return size


def security_headers(path: str) -> dict[str, str]:
    """The headers every response carries; all but static assets also say ``Cache-Control: no-store``."""
    return dict(SECURITY_HEADERS) if path.startswith(STATIC_PREFIX) else {**SECURITY_HEADERS, **NO_STORE}


class SecurityHeaders:
    """Adds :func:`security_headers` to every HTTP response that does not already set them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        added = security_headers(scope.get("path", ""))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in added.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)


class BodyTooLarge(HTTPException):
    """The request body passed the limit while it was being read."""

    def __init__(self, body_bytes_max: int) -> None:
        super().__init__(status_code=413, detail=_too_large_text(body_bytes_max))


def _too_large_text(body_bytes_max: int) -> str:
    return f"the request body is larger than {body_bytes_max} bytes, the most this server accepts"


class _CountedBody:
    """The receive and send of one request: counts body bytes, and once past the limit, stops the read
    and holds back the application's own answer to it (a form parser's 400, say) for the 413."""

    def __init__(self, receive: Receive, send: Send, body_bytes_max: int) -> None:
        self._receive = receive
        self._send = send
        self.body_bytes_max = body_bytes_max
        self.received_bytes = 0
        self.exceeded = False
        self.started = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received_bytes += len(message.get("body", b""))
            if self.received_bytes > self.body_bytes_max:
                self.exceeded = True
                raise BodyTooLarge(self.body_bytes_max)
        return message

    async def send(self, message: Message) -> None:
        if self.exceeded and not self.started:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class BodyLimit:
    """Answers 413 ``payload_too_large`` to a request body over ``body_bytes_max``, on every route.

    A declared Content-Length over the limit is refused before the application runs, so nothing is
    read; a body without one (chunked) is counted as it arrives and the read stops at the first chunk
    past the limit, so at most the limit plus one chunk is ever held in memory.
    """

    def __init__(self, app: ASGIApp, body_bytes_max: int) -> None:
        self.app = app
        self.body_bytes_max = body_bytes_max

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.body_bytes_max:
            await self._refuse(scope, receive, send)
            return
        body = _CountedBody(receive, send, self.body_bytes_max)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if not body.exceeded or body.started:
                raise
        if body.exceeded and not body.started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = errors.error_response("payload_too_large", _too_large_text(self.body_bytes_max))
        await response(scope, receive, send)
