"""API tokens: created once, stored as a SHA-256 hash, checked on every request, revocable.

A token is ``ddf_`` followed by 43 URL-safe characters (256 random bits), so a leaked one is easy
to recognise in logs and secret scanners. Because it carries that much entropy, looking it up by
its unsalted hash is safe: no dictionary attack applies.

A tenant token (viewer, submitter, operator) acts for one tenant. A platform operator token acts
for none: it is stored with the tenant ``PLATFORM_TENANT`` ("*"), which ``core.names.TENANT_PATTERN`` (and the
run request's own tenant check) makes impossible for a real tenant, so no tenant-scoped query can
ever match it. It is created only by ``create_platform_token``, which the CLI calls for whoever
holds the database URL; the API has no way to create any token.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection

from durable_dataflow.api.schema import TOKEN_NAME_LENGTH, api_tokens
from durable_dataflow.core.db import Database
from durable_dataflow.core.errors import Conflict, InputError, NotFound, Unauthenticated
from durable_dataflow.core.hashing import sha256_bytes
from durable_dataflow.core.invariants import invariant
from durable_dataflow.core.names import check_tenant

TOKEN_PREFIX = "ddf_"
TOKEN_RANDOM_BYTES = 32
TOKEN_ID_RANDOM_BYTES = 8
# A presented token longer than this is refused before it is hashed.
TOKEN_CHARS_MAX = 200
TOKENS_LISTED_MAX = 10_000
NAME_PATTERN = re.compile(rf"^[A-Za-z0-9_.@:-]{{1,{TOKEN_NAME_LENGTH}}}$")
# The tenant stored for a platform operator token: core.names.TENANT_PATTERN forbids it for every real tenant.
PLATFORM_TENANT = "*"


class Role(enum.StrEnum):
    VIEWER = "viewer"  # reads runs, evidence, definitions and datasources of its tenant
    SUBMITTER = "submitter"  # a viewer that may also submit runs
    OPERATOR = "operator"  # a submitter that may also reconcile and resume, and read ops and metrics
    # Bound to no tenant: reads the platform-wide Ops projection and /metrics, and nothing else.
    PLATFORM_OPERATOR = "platform_operator"


# Each tenant role includes the roles below it. The platform operator is outside this order: it
# holds none of the tenant roles, and no tenant role holds it.
ROLE_RANK = {Role.VIEWER: 1, Role.SUBMITTER: 2, Role.OPERATOR: 3}
TENANT_ROLES = tuple(ROLE_RANK)


@dataclass(frozen=True)
class TokenInfo:
    """What is stored about a token: never the token itself."""

    token_id: str
    tenant: str
    role: Role
    name: str
    created_at_us: int
    revoked_at_us: int | None

    @property
    def principal(self) -> str:
        """The identity recorded with the runs this token submits."""
        return f"token:{self.name}"

    @property
    def is_platform(self) -> bool:
        """A platform operator token: bound to no tenant."""
        return self.role is Role.PLATFORM_OPERATOR

    def allows(self, needed: Role | str) -> bool:
        """Whether the token holds ``needed``: a tenant role by rank, the platform role only itself."""
        wanted = Role(needed)
        if self.is_platform or wanted is Role.PLATFORM_OPERATOR:
            return self.role is wanted
        return ROLE_RANK[self.role] >= ROLE_RANK[wanted]


def hash_token(token: str) -> str:
    return sha256_bytes(token.encode("utf-8"))


def _info(row: sa.Row[object]) -> TokenInfo:
    data = row._mapping
    tenant, role = str(data["tenant"]), Role(str(data["role"]))
    invariant(
        (role is Role.PLATFORM_OPERATOR) == (tenant == PLATFORM_TENANT),
        f"token {data['token_id']}: only a platform_operator token has the platform tenant",
    )
    return TokenInfo(
        token_id=str(data["token_id"]),
        tenant=tenant,
        role=role,
        name=str(data["name"]),
        created_at_us=int(str(data["created_at_us"])),
        revoked_at_us=None if data["revoked_at_us"] is None else int(str(data["revoked_at_us"])),
    )


def _check_new(tenant: str, role: str, name: str | None) -> Role:
    check_tenant(tenant)
    if role == Role.PLATFORM_OPERATOR:
        raise InputError("a platform_operator token belongs to no tenant: use `dataflow tokens create --platform`")
    try:
        checked = Role(role)
    except ValueError:
        raise InputError(f"the role must be one of {', '.join(r.value for r in TENANT_ROLES)}") from None
    _check_name(name)
    return checked


def _check_name(name: str | None) -> None:
    if name is not None and not NAME_PATTERN.fullmatch(name):
        raise InputError(f"the token name must be 1 to {TOKEN_NAME_LENGTH} letters, digits or '_.@:-'")


def create_token(db: Database, tenant: str, role: str, name: str | None = None) -> tuple[str, TokenInfo]:
    """Create a tenant token; returns the token text (shown once, never stored) and what is stored."""
    return _insert(db, tenant, _check_new(tenant, role, name), name)


def create_platform_token(db: Database, name: str | None = None) -> tuple[str, TokenInfo]:
    """Create a platform operator token (no tenant): for whoever holds the database URL, never the API."""
    _check_name(name)
    return _insert(db, PLATFORM_TENANT, Role.PLATFORM_OPERATOR, name)


def _insert(db: Database, tenant: str, checked: Role, name: str | None) -> tuple[str, TokenInfo]:
    token = TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_RANDOM_BYTES)
    token_id = "tok_" + secrets.token_hex(TOKEN_ID_RANDOM_BYTES)
    try:
        with db.begin() as conn:
            values = {
                "token_id": token_id,
                "tenant": tenant,
                "role": checked.value,
                "name": name or token_id,
                "token_hash": hash_token(token),
                "created_at_us": db.now_us(conn),
                "revoked_at_us": None,
            }
            conn.execute(api_tokens.insert().values(**values))
            info = _get(conn, token_id)
    except exc.IntegrityError as error:  # 256 random bits collided: astronomically unlikely
        raise Conflict("the token could not be stored; create it again") from error
    return token, info


def _get(conn: Connection, token_id: str) -> TokenInfo:
    row = conn.execute(sa.select(api_tokens).where(api_tokens.c.token_id == token_id)).one_or_none()
    if row is None:
        raise NotFound(f"token {token_id} does not exist")
    return _info(row)


def list_tokens(db: Database, tenant: str | None = None) -> list[TokenInfo]:
    """Every token's stored facts (never the token), oldest first."""
    query = sa.select(api_tokens).order_by(api_tokens.c.created_at_us, api_tokens.c.token_id)
    if tenant is not None:
        query = query.where(api_tokens.c.tenant == tenant)
    with db.read() as conn:
        return [_info(row) for row in conn.execute(query.limit(TOKENS_LISTED_MAX))]


def revoke_token(db: Database, token_id: str) -> TokenInfo:
    """Revoke a token from now on; revoking a revoked token keeps its first revocation time."""
    with db.begin() as conn:
        _get(conn, token_id)
        conn.execute(
            api_tokens.update()
            .where(api_tokens.c.token_id == token_id, api_tokens.c.revoked_at_us.is_(None))
            .values(revoked_at_us=db.now_us(conn))
        )
        return _get(conn, token_id)


def authenticate(db: Database, presented: str | None) -> TokenInfo:
    """The live token matching ``presented``; Unauthenticated otherwise (the same message for every cause)."""
    if not presented or len(presented) > TOKEN_CHARS_MAX or not presented.startswith(TOKEN_PREFIX):
        raise Unauthenticated("a valid API token is required (Authorization: Bearer ddf_...)")
    with db.read() as conn:
        row = conn.execute(
            sa.select(api_tokens).where(
                api_tokens.c.token_hash == hash_token(presented), api_tokens.c.revoked_at_us.is_(None)
            )
        ).one_or_none()
    if row is None:
        raise Unauthenticated("the API token is unknown or revoked")
    return _info(row)
