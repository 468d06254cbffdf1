"""The platform object: one database and the services over it, built from a URL.

No process-wide singletons: tests open two platforms on one database to play two workers.
"""

from __future__ import annotations

import dataclasses
import threading
from types import TracebackType
from typing import TYPE_CHECKING

from durable_dataflow import migrations
from durable_dataflow.core import secrets
from durable_dataflow.core.db import Database
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow.execution import workspace
from durable_dataflow.dataflow.execution.limits import ExecutionLimits, with_data_dir
from durable_dataflow.dataflow.execution.limits import from_env as limits_from_env
from durable_dataflow.dataflow.protocol import quotas
from durable_dataflow.dataflow.protocol.service_config import ServiceConfig, lease_ttl_from_env
from durable_dataflow.lineage import settings as lineage_settings

if TYPE_CHECKING:
    from durable_dataflow.dataflow.protocol.service import RunService

EVIDENCE_KEY_NAME = "DATAFLOW_EVIDENCE_KEY"


def evidence_key_from_env() -> Secret | None:
    """The keyed-evidence secret when configured (environment or secrets directory), else None."""
    return secrets.resolve_platform_setting(EVIDENCE_KEY_NAME)


class Platform:
    """A platform database with its run service.

    Without an explicit ``limits`` the platform's execution limits come from the ``DATAFLOW_*``
    variables (``dataflow.execution.limits.from_env``), so every entry point (CLI, API server, Python) obeys them.
    Every setting is read (and refused when invalid) on opening; the run service itself is built on
    first use of ``runs``, because importing it loads the engine (DuckDB, pyarrow) and the providers,
    which a command that only reads runs (``dataflow runs``, ``show``, ``verify``) never needs.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        lease_ttl_s: float | None = None,
        holder: str | None = None,
        limits: ExecutionLimits | None = None,
        migrate: bool = True,
    ) -> None:
        self.db = Database(url)
        # Lineage configured (docs/lineage.md): every ledger append also writes its outbox key.
        self.lineage_configured = lineage_settings.configured()
        self.db.ledger_outbox = self.lineage_configured
        if migrate:
            migrations.upgrade(self.db)
        config = ServiceConfig(
            lease_ttl_s=lease_ttl_from_env(lease_ttl_s),
            # Executions spill under the platform's data directory (the SQLite file's folder), if it has one.
            limits=with_data_dir(limits if limits is not None else limits_from_env(), self.db.files()),
            evidence_key=evidence_key_from_env(),
            grants=workspace.grants_from_env(),
            quotas=quotas.from_env(),
        )
        if holder is not None:
            config = dataclasses.replace(config, holder=holder)
        self.config = config  # the run service's settings (``runs.config`` is this object)
        self._runs: RunService | None = None
        self._runs_lock = threading.Lock()

    @property
    def runs(self) -> RunService:
        """The run service (one per platform, built on first use, safe to ask for from any thread)."""
        service = self._runs
        if service is None:
            with self._runs_lock:
                if self._runs is None:
                    from durable_dataflow.dataflow.protocol.service import RunService

                    self._runs = RunService(self.db, self.config)
                service = self._runs
        return service

    def close(self) -> None:
        if self._runs is not None:
            self._runs.close()  # its holder lock first: the process's leases are then left to sweepers
        self.db.dispose()

    def __enter__(self) -> Platform:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
