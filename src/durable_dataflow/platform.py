"""The platform object: one database and the services over it, built from a URL.

No process-wide singletons: tests open two platforms on one database to play two workers.
"""

from __future__ import annotations

import dataclasses
from types import TracebackType

from durable_dataflow import migrations
from durable_dataflow.core import secrets
from durable_dataflow.core.db import Database
from durable_dataflow.core.secrets import Secret
from durable_dataflow.dataflow import workspace
from durable_dataflow.dataflow.limits import ExecutionLimits
from durable_dataflow.dataflow.limits import from_env as limits_from_env
from durable_dataflow.dataflow.service import RunService, ServiceConfig, lease_ttl_from_env

EVIDENCE_KEY_NAME = "DATAFLOW_EVIDENCE_KEY"


def evidence_key_from_env() -> Secret | None:
    """The keyed-evidence secret when configured (environment or secrets directory), else None."""
    return secrets.resolve_platform_setting(EVIDENCE_KEY_NAME)


class Platform:
    """A platform database with its run service.

    Without an explicit ``limits`` the platform's execution limits come from the ``DATAFLOW_*``
    variables (``dataflow.limits.from_env``), so every entry point (CLI, API server, Python) obeys them.
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
        if migrate:
            migrations.upgrade(self.db)
        config = ServiceConfig(
            lease_ttl_s=lease_ttl_from_env(lease_ttl_s),
            limits=limits if limits is not None else limits_from_env(),
            evidence_key=evidence_key_from_env(),
            grants=workspace.grants_from_env(),
        )
        if holder is not None:
            config = dataclasses.replace(config, holder=holder)
        self.runs = RunService(self.db, config)

    def close(self) -> None:
        self.db.dispose()

    def __enter__(self) -> Platform:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
