"""An in-process API server with two tenants (acme, globex), each with a submitter and an operator
token and its own data folder: the fixture of the confinement tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.schema import dataflow_runs
from durable_dataflow.platform import Platform

TENANTS = ("acme", "globex")
ROLES = ("submitter", "operator")


@dataclass
class Server:
    platform: Platform
    client: TestClient
    data: Path
    sinks: Path
    headers: dict[str, dict[str, str]]  # "<tenant>-<role>" -> Authorization header

    def post(self, who: str, document: dict[str, Any], **params: Any) -> Any:
        return self.client.post("/v1/runs", json={"definition": document}, headers=self.headers[who], params=params)

    def post_raw(self, who: str, body: str) -> Any:
        headers = {**self.headers[who], "content-type": "application/json"}
        return self.client.post("/v1/runs", content=body, headers=headers)

    def run_count(self) -> int:
        with self.platform.db.read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(dataflow_runs)).scalar_one())


@contextmanager
def open_server(
    db_url: str, tmp_path: Path, mine: Callable[[str], str] = lambda tenant: tenant, **client: Any
) -> Iterator[Server]:
    """The server over ``db_url`` with data root tmp/data and sink root tmp/sinks; each tenant's folder
    holds mine.csv (one column s, one row ``mine(tenant)``). Open it after setting the environment."""
    data, sinks = tmp_path / "data", tmp_path / "sinks"
    for tenant in TENANTS:
        (data / tenant).mkdir(parents=True)
        (data / tenant / "mine.csv").write_text(f"s\n{mine(tenant)}\n")
    platform = Platform(db_url)
    headers = {}
    for tenant in TENANTS:
        for role in ROLES:
            token = tokens.create_token(platform.db, tenant, role, f"{tenant}-{role}")[0]
            headers[f"{tenant}-{role}"] = {"Authorization": f"Bearer {token}"}
    try:
        with TestClient(create_app(platform, data_root=data, sink_root=sinks), **client) as test_client:
            yield Server(platform, test_client, data, sinks, headers)
    finally:
        platform.close()
