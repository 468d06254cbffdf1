"""The run service's settings (``ServiceConfig``), apart from the service itself.

``dataflow.protocol.service`` imports the engine, the sources and the providers; a platform reads its
settings (lease TTL, limits, evidence key, grants, quotas) when it opens, whether or not it will execute
anything. Keeping them here lets ``durable_dataflow.platform`` open without importing the service:
commands that only read runs (``dataflow runs``, ``show``, ``verify``) never load DuckDB or pyarrow.
``dataflow.protocol.service`` re-exports every name here.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from durable_dataflow.core import leases
from durable_dataflow.core.errors import InputError
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.execution import limits
from durable_dataflow.dataflow.execution.workspace import Grants
from durable_dataflow.dataflow.protocol.quotas import Quotas

LEASE_TTL_ENV = "DATAFLOW_LEASE_TTL"


def lease_ttl_from_env(explicit: float | None = None) -> float:
    """The lease TTL: explicit, else ``DATAFLOW_LEASE_TTL``, else the core default."""
    if explicit is not None:
        return explicit
    raw = os.environ.get(LEASE_TTL_ENV)
    if not raw:
        return leases.LEASE_TTL_S_DEFAULT
    try:
        return float(raw)
    except ValueError as error:
        raise InputError(f"{LEASE_TTL_ENV} must be a number of seconds, got {raw!r}") from error


@dataclass(frozen=True)
class ServiceConfig:
    lease_ttl_s: float = leases.LEASE_TTL_S_DEFAULT
    # Unique per service: the holder id is also the key of the process's liveness lock (core/holders.py).
    holder: str = field(default_factory=lambda: f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(3)}")
    limits: limits.ExecutionLimits = field(default_factory=limits.ExecutionLimits)
    evidence_key: Secret | None = None
    grants: Grants = field(default_factory=Grants)
    quotas: Quotas = field(default_factory=Quotas)  # per tenant (dataflow.protocol.quotas)
