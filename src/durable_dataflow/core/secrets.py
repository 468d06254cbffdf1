"""Secrets are referenced by name, granted per tenant, and resolved in memory only when needed.

A definition names a secret (``{secret: CRM_DSN}``); what that name may resolve to depends on who
the run acts for, its ``SecretScope``:

- a **tenant** (a run submitted with an API token) may name only the secrets the platform's
  grants file (``$DATAFLOW_GRANTS``, section ``secrets``) grants to that tenant; each grant says
  where the value lives (an environment variable or a file in ``$DATAFLOW_SECRETS_DIR``);
- the platform's own **operator** at a terminal (``dataflow run`` / ``submit``) may also use the
  *local default*: a name not in the grants file resolves from the environment variable of that
  name, then from the file of that name in ``$DATAFLOW_SECRETS_DIR``.

The platform's own settings (every ``DATAFLOW_*`` name: the database URL, the evidence key, …) can
never be named by a definition nor granted. Refusals never say whether a variable exists: an
ungranted, reserved and unset secret get the same message. A resolved value is never returned
inside an error message, never logged and never persisted: callers hold it in a local variable
for one call and drop it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from durable_dataflow.core.errors import InputError

SECRET_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SECRET_FILE_BYTES_MAX = 64 * 1024
SECRETS_DIR_ENV = "DATAFLOW_SECRETS_DIR"
# Names that belong to the platform itself: never resolvable from a definition, never grantable.
RESERVED_PREFIX = "DATAFLOW_"
EVERY_TENANT = "*"


class Secret:
    """A resolved secret value that refuses to print itself."""

    __slots__ = ("_value", "name")

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self._value = value

    def reveal(self) -> str:
        """The plain value: call at the last moment, pass straight to the driver, never store."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret({self.name!r}, '***')"

    __str__ = __repr__


def secrets_dir() -> Path | None:
    """The configured secrets directory (``DATAFLOW_SECRETS_DIR``), resolved, or None."""
    configured = os.environ.get(SECRETS_DIR_ENV)
    if not configured:
        return None
    try:
        return Path(configured).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (before Python 3.13)
        raise InputError(f"{SECRETS_DIR_ENV} cannot be resolved (a symlink loop or an unreadable path)") from None


def is_reserved(name: str) -> bool:
    """A platform setting's name (``DATAFLOW_*``, in any case): never a definition's secret."""
    return name.upper().startswith(RESERVED_PREFIX)


def _from_env(variable: str) -> str | None:
    return os.environ.get(variable)


def _from_file(file_name: str) -> str | None:
    folder = secrets_dir()
    if folder is None:
        return None
    path = folder / file_name
    if not path.is_file():
        return None
    with path.open("rb") as file:  # never more than the cap, whatever the file's size
        data = file.read(SECRET_FILE_BYTES_MAX)
    return data.decode("utf-8", errors="replace").strip()


def resolve_platform_setting(name: str) -> Secret | None:
    """One of the platform's OWN secrets (e.g. ``DATAFLOW_EVIDENCE_KEY``): from the environment,
    then from ``$DATAFLOW_SECRETS_DIR``; None when unset. Never call it for a name a definition gave."""
    value = _from_env(name)
    if value is None:
        value = _from_file(name)
    if value is not None and not value.strip():
        # An empty key would key the ledger with a MAC anyone can compute: a mistake, never a setting.
        raise InputError(f"{name} is set but empty: give it a value, or unset it")
    return None if value is None else Secret(name, value)


@dataclass(frozen=True)
class SecretGrant:
    """One granted secret: where its value lives and which tenants may name it."""

    name: str
    source: Literal["env", "file"]
    ref: str  # the environment variable's name, or the file's name inside $DATAFLOW_SECRETS_DIR
    tenants: frozenset[str]

    def granted_to(self, tenant: str) -> bool:
        return EVERY_TENANT in self.tenants or tenant in self.tenants

    def read(self) -> str | None:
        return _from_env(self.ref) if self.source == "env" else _from_file(self.ref)


def check_grant(grant: SecretGrant) -> None:
    """Refuse a grant that would hand out a platform setting or read outside the secrets folder."""
    if not SECRET_NAME_PATTERN.fullmatch(grant.name) or not SECRET_NAME_PATTERN.fullmatch(grant.ref):
        raise InputError("a granted secret's name and its env/file must be letters, digits and underscores")
    if is_reserved(grant.name) or is_reserved(grant.ref):
        raise InputError(f"the platform's own settings ({RESERVED_PREFIX}*) cannot be granted")
    if not grant.tenants:
        raise InputError("a granted secret must name at least one tenant (or '*')")


@dataclass(frozen=True)
class SecretScope:
    """The secrets one run may name: the grants for its tenant, plus the local default for the
    platform's own operator (``tenant=None``)."""

    tenant: str | None
    grants: Mapping[str, SecretGrant] = field(default_factory=dict)

    @classmethod
    def local(cls, grants: Mapping[str, SecretGrant] | None = None) -> SecretScope:
        """The platform operator's scope: every grant, then any non-reserved variable or file."""
        return cls(tenant=None, grants=dict(grants or {}))

    def _lookup(self, name: str) -> str | None:
        if not SECRET_NAME_PATTERN.fullmatch(name) or is_reserved(name):
            return None
        grant = self.grants.get(name)
        if grant is not None:
            return grant.read() if self.tenant is None or grant.granted_to(self.tenant) else None
        if self.tenant is not None:
            return None
        value = _from_env(name)
        return value if value is not None else _from_file(name)

    def resolve(self, name: str) -> Secret:
        """The value ``name`` stands for in this scope; InputError when it is not available here
        (ungranted, reserved and unset alike, so the refusal reveals nothing)."""
        value = self._lookup(name)
        if value is None:
            raise InputError(self.unavailable())
        return Secret(name, value)

    def check(self, name: str) -> None:
        """Refuse a name before anything is recorded (the value is read and dropped)."""
        self.resolve(name)

    def unavailable(self) -> str:
        if self.tenant is None:
            return (
                "a referenced secret is not set: define an environment variable or a file of that name in "
                f"{SECRETS_DIR_ENV}, or grant it in DATAFLOW_GRANTS ({RESERVED_PREFIX}* names are never secrets)"
            )
        return "a referenced secret is not granted to this tenant or is not set: ask the platform operator"
