"""Where an execution reads and within which limits: the context every source resolution and engine run takes.

Its own module, below the sources and the engines, so the sources (which confine paths to the context's
roots) and the execution that resolves them (``compute``) do not import each other.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from durable_dataflow.core import secrets
from durable_dataflow.dataflow.definitions.definitions import LoadedDefinition
from durable_dataflow.dataflow.execution import interruption
from durable_dataflow.dataflow.execution.limits import ExecutionLimits
from durable_dataflow.dataflow.execution.workspace import data_roots_from_env
from durable_dataflow.datasources.objectstore import StoreGrant


def secrets_folders() -> tuple[Path, ...]:
    """The secrets directory, when one is configured: no source may read inside it."""
    folder = secrets.secrets_dir()
    return (folder,) if folder is not None else ()


@dataclass(frozen=True)
class ExecutionContext:
    """Where relative source paths start, which directories sources may read, and the limits."""

    base_dir: Path
    allowed_roots: tuple[Path, ...]
    limits: ExecutionLimits = field(default_factory=ExecutionLimits)
    # Paths no source may read even inside a root: the secrets directory and the platform database.
    forbidden: tuple[Path, ...] = field(default_factory=secrets_folders)
    # When the execution's time runs out (time.monotonic()); None until ``started()``.
    deadline_at: float | None = None
    # The secrets the definition may name (a tenant's grants, or the local operator's scope).
    secrets: secrets.SecretScope = field(default_factory=secrets.SecretScope.local)
    # The process's interruption, which stops the engine (None: nothing interrupts this execution).
    interruption: interruption.Interruption | None = None
    # The object-store prefixes an s3:// source may read (`objectstore.confine`); None: any bucket the
    # credentials reach (the local operator).
    store_grants: tuple[StoreGrant, ...] | None = None

    def started(self) -> ExecutionContext:
        """This context with the time limit counting from now (resolution and engine together)."""
        return dataclasses.replace(self, deadline_at=time.monotonic() + self.limits.time_limit_s)

    @classmethod
    def for_definition(cls, loaded: LoadedDefinition, limits: ExecutionLimits | None = None) -> ExecutionContext:
        """Roots: the definition's directory plus every directory in $DATAFLOW_DATA_ROOTS."""
        roots = (loaded.base_dir, *data_roots_from_env())
        return cls(base_dir=loaded.base_dir, allowed_roots=roots, limits=limits or ExecutionLimits())
