"""Authentication for the JSON API (a Bearer token) and the web pages (an HttpOnly session cookie).

The JSON API reads only the Authorization header, never the cookie, so a browser cannot be tricked
into calling it with ambient credentials (no CSRF surface). The web pages read only the cookie,
which is HttpOnly and SameSite=Strict; their POST forms also carry a CSRF token derived from the
session with a key that lives only in this server process.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from durable_dataflow.api import tokens
from durable_dataflow.api.operations import Caller
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.errors import PermissionDenied
from durable_dataflow.platform import Platform

SESSION_COOKIE = "ddf_session"
SESSION_MAX_AGE_S = 8 * 3600

bearer_scheme = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer ddf_...`")


def platform_of(request: Request) -> Platform:
    platform: Platform = request.app.state.platform
    return platform


def _require_role(caller: Caller, needed: Role) -> Caller:
    if not caller.token.allows(needed):
        raise PermissionDenied(f"this action needs the {needed.value} role; the token has {caller.token.role.value}")
    return caller


def api_caller(needed: Role) -> Callable[..., Caller]:
    """A dependency: the Bearer token's caller, with at least the ``needed`` role."""

    def dependency(
        request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer_scheme)
    ) -> Caller:
        presented = credentials.credentials if credentials is not None else None
        caller = Caller(tokens.authenticate(platform_of(request).db, presented))
        return _require_role(caller, needed)

    return dependency


def web_caller(request: Request, needed: Role = Role.VIEWER) -> Caller:
    """The session cookie's caller, with at least the ``needed`` role (Unauthenticated -> login page)."""
    caller = Caller(tokens.authenticate(platform_of(request).db, request.cookies.get(SESSION_COOKIE)))
    return _require_role(caller, needed)


def csrf_token(request: Request) -> str:
    """The per-session CSRF token: an HMAC of the session token under this process's key."""
    session = request.cookies.get(SESSION_COOKIE, "")
    key: bytes = request.app.state.csrf_key
    return hmac.new(key, session.encode("utf-8"), hashlib.sha256).hexdigest()


def check_csrf(request: Request, presented: str) -> None:
    if not hmac.compare_digest(csrf_token(request), presented or ""):
        raise PermissionDenied("the form is stale or was not sent by this site; reload the page and try again")
