"""Authentication for the JSON API (a Bearer token) and the web pages (an HttpOnly session cookie).

The JSON API reads only the Authorization header, never the cookie, so a browser cannot be tricked
into calling it with ambient credentials (no CSRF surface). The web pages read only the cookie,
which is HttpOnly and SameSite=Strict; their POST forms also carry a CSRF token derived from the
session with a key that lives only in this server process. The login form, before any session
exists, uses a double submit: a random nonce in an HttpOnly, SameSite=Strict cookie, and in the form
the HMAC of that nonce, which a page on another site can neither read nor compute.

Every dependency names the tenant role it needs. A platform operator token (bound to no tenant)
passes only the dependencies marked ``platform_wide`` (the Ops projection, /metrics, the workers, and
the reconcile and cancel of any tenant's run); on every other endpoint it answers 403, so it can never
submit or read a tenant's runs.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable

from fastapi import Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from durable_dataflow.api import tokens
from durable_dataflow.api.operations import Caller
from durable_dataflow.api.tokens import Role
from durable_dataflow.core.errors import PermissionDenied
from durable_dataflow.platform import Platform

SESSION_COOKIE = "ddf_session"
SESSION_MAX_AGE_S = 8 * 3600
LOGIN_CSRF_COOKIE = "ddf_login_csrf"
LOGIN_CSRF_MAX_AGE_S = 3600
LOGIN_NONCE_BYTES = 32
LOGIN_NONCE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{43}$")  # what token_urlsafe(32) writes
STALE_FORM = "the form is stale or was not sent by this site; reload the page and try again"

bearer_scheme = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer ddf_...`")


def platform_of(request: Request) -> Platform:
    platform: Platform = request.app.state.platform
    return platform


PLATFORM_TOKEN_REFUSED = (
    "this endpoint needs a tenant token; a platform_operator token reads only the platform-wide "
    "/v1/ops/ledger, /ui/ops and /metrics, and reconciles and cancels runs"
)


def _require_role(caller: Caller, needed: Role, platform_wide: bool = False) -> Caller:
    """The caller, if its token holds ``needed``; a platform token only where ``platform_wide``."""
    if caller.token.is_platform:
        if not platform_wide:
            raise PermissionDenied(PLATFORM_TOKEN_REFUSED)
        return caller
    if not caller.token.allows(needed):
        raise PermissionDenied(f"this action needs the {needed.value} role; the token has {caller.token.role.value}")
    return caller


def api_caller(needed: Role, *, platform_wide: bool = False) -> Callable[..., Caller]:
    """A dependency: the Bearer token's caller, with at least the ``needed`` tenant role, or (only when
    ``platform_wide``: a platform-wide read) a platform operator."""

    def dependency(
        request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer_scheme)
    ) -> Caller:
        presented = credentials.credentials if credentials is not None else None
        caller = Caller(tokens.authenticate(platform_of(request).db, presented))
        return _require_role(caller, needed, platform_wide)

    return dependency


def web_caller(request: Request, needed: Role = Role.VIEWER, *, platform_wide: bool = False) -> Caller:
    """The session cookie's caller, with at least the ``needed`` role (Unauthenticated -> login page);
    a platform operator only where ``platform_wide``."""
    caller = Caller(tokens.authenticate(platform_of(request).db, request.cookies.get(SESSION_COOKIE)))
    return _require_role(caller, needed, platform_wide)


def _mac(request: Request, purpose: str, value: str) -> str:
    # The purpose keeps the two kinds of token apart: no session value can stand for a login nonce.
    key: bytes = request.app.state.csrf_key
    return hmac.new(key, f"{purpose}\x00{value}".encode(), hashlib.sha256).hexdigest()


def _check(expected: str, presented: str) -> None:
    if not hmac.compare_digest(expected, presented or ""):
        raise PermissionDenied(STALE_FORM)


def csrf_token(request: Request) -> str:
    """The per-session CSRF token: an HMAC of the session token under this process's key."""
    return _mac(request, "session", request.cookies.get(SESSION_COOKIE, ""))


def check_csrf(request: Request, presented: str) -> None:
    _check(csrf_token(request), presented)


def login_nonce(request: Request) -> str:
    """The login form's nonce: the one this browser's cookie holds (several open tabs keep working),
    else a new random one."""
    held = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    return held if LOGIN_NONCE_PATTERN.match(held) else secrets.token_urlsafe(LOGIN_NONCE_BYTES)


def login_csrf_token(request: Request, nonce: str) -> str:
    """The login form's CSRF field: an HMAC of the nonce under this process's key."""
    return _mac(request, "login", nonce)


def keep_login_nonce(request: Request, response: Response, nonce: str) -> None:
    """Set the nonce cookie: HttpOnly and SameSite=Strict, sent only back to the login form."""
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        nonce,
        max_age=LOGIN_CSRF_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/ui/login",
    )


def check_login_csrf(request: Request, presented: str) -> None:
    """Refuse a login POST whose form field is not the HMAC of the nonce its cookie holds."""
    nonce = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not LOGIN_NONCE_PATTERN.match(nonce):
        raise PermissionDenied(STALE_FORM)
    _check(login_csrf_token(request, nonce), presented)
