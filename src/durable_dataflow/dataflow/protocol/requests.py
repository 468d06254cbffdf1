"""Run requests: who asks (access context), how (provenance), and what (definition, parameters).

The access context feeds a digest only — it never holds a token, password or resolved credential.
Provenance is informational and recorded with the run; it is not part of the request hash, so a
replay from another host or actor is still the same request.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from durable_dataflow import __version__
from durable_dataflow.core import hashing
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.names import check_tenant
from durable_dataflow.dataflow.execution.interruption import Trigger

if TYPE_CHECKING:  # types only: `MAX_ATTEMPTS_DEFAULT` is read by commands that load no definition
    from durable_dataflow.dataflow.definitions.definitions import Definition
    from durable_dataflow.dataflow.execution.workspace import Workspace

IDEMPOTENCY_KEY_CHARS_MAX = 255
MAX_ATTEMPTS_DEFAULT = 3
MAX_ATTEMPTS_LIMIT = 20


@dataclass(frozen=True)
class AccessContext:
    """Who the run acts for. Its digest is recorded before execution."""

    tenant: str
    principal: str
    roles: tuple[str, ...] = ()
    scopes: tuple[str, ...] = ()
    auth_method: str = "local"

    def digest(self) -> str:
        return hashing.digest(
            {
                "tenant": self.tenant,
                "principal": self.principal,
                "roles": sorted(self.roles),
                "scopes": sorted(self.scopes),
                "auth_method": self.auth_method,
            }
        )

    @classmethod
    def local(cls, tenant: str = "default") -> AccessContext:
        """The operating-system user at a terminal: the CLI's identity."""
        return cls(tenant=tenant, principal=_os_user(), roles=("operator",), auth_method="local-cli")


@dataclass(frozen=True)
class Provenance:
    """How the run was invoked."""

    actor: str
    trigger: Trigger
    host: str = field(default_factory=socket.gethostname)
    client_version: str = __version__
    parent_run: str | None = None
    # The client's own clock, informational only: ordering and expiry use the database clock.
    requested_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="milliseconds"))

    def as_json(self) -> dict[str, Any]:
        return {
            "actor": self.actor,
            "trigger": self.trigger,
            "host": self.host,
            "client_version": self.client_version,
            "parent_run": self.parent_run,
            "requested_at": self.requested_at,
        }


def asked_by(access: AccessContext, provenance: Provenance) -> dict[str, Any]:
    """Who asked for an operator's action (reconcile, resume, cancel), in the fields ``run.recorded``
    uses for a submit: never a credential."""
    return {
        "provenance": provenance.as_json(),
        "principal": access.principal,
        "access_context_digest": access.digest(),
    }


@dataclass(frozen=True)
class RunRequest:
    """Everything a submit needs. ``parameters`` are raw (strings from the CLI, JSON from the API)."""

    definition: Definition
    base_dir: Path
    parameters: Mapping[str, Any]
    access: AccessContext
    provenance: Provenance
    idempotency_key: str | None = None
    max_attempts: int = MAX_ATTEMPTS_DEFAULT
    # Where the run may read and write; None: the local operator's workspace over base_dir.
    workspace: Workspace | None = None


def check_request(request: RunRequest) -> None:
    """Refuse malformed request fields before anything is written (naming the field, never its value)."""
    key = request.idempotency_key
    if key is not None and not (0 < len(key) <= IDEMPOTENCY_KEY_CHARS_MAX and key.isprintable()):
        raise InputError(f"idempotency key must be 1 to {IDEMPOTENCY_KEY_CHARS_MAX} printable characters")
    check_tenant(request.access.tenant)
    if not 1 <= request.max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise InputError(f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}")


def request_hash(definition_hash: str, parameters: Mapping[str, Any], target: Mapping[str, Any] | None) -> str:
    """``{definition_hash, parameters, target}``: not provenance, not the key (DESIGN §3)."""
    return hashing.digest({"definition_hash": definition_hash, "parameters": dict(parameters), "target": target})


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
