"""The fleet as every reader shows it, on SQLite and PostgreSQL (issue 33): `dataflow workers [--json]`,
GET /v1/workers (platform operator only) and the Workers section of the Ops page, all from one read
(dataflow.protocol.fleet)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.api.auth import SESSION_COOKIE
from durable_dataflow.dataflow.protocol import fleet
from durable_dataflow.platform import Platform
from support.api_runs import Tokens, make_tokens
from support.cli import make_cli

ALIVE = "host-a:101:aaaaaa"
DEAD = "host-b:202:bbbbbb"


@dataclass(frozen=True)
class Fleet:
    platform: Platform
    client: TestClient
    tokens: Tokens
    platform_token: str
    db_url: str


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """Two registered processes: a worker beating within its TTL, and a sweeper whose last beat is 20 s old
    on the real database clock, four times its TTL (registered through a clock moved 20 s back)."""
    platform = Platform(db_url)
    platform.db.advance_clock(-20)
    fleet.register(platform.db, holder=DEAD, role=fleet.Role.SWEEPER, concurrency=1, ttl_s=5.0, holder_locked=False)
    platform.db.advance_clock(20)
    fleet.register(platform.db, holder=ALIVE, role=fleet.Role.WORKER, concurrency=4, ttl_s=60.0, holder_locked=False)
    platform_token = tokens.create_platform_token(platform.db, "oncall")[0]
    app = create_app(platform, data_root=tmp_path)
    with TestClient(app) as client:
        yield Fleet(platform, client, make_tokens(platform), platform_token, db_url)
    platform.close()


def test_v1_workers_lists_the_fleet_for_the_platform_operator_only(world: Fleet) -> None:
    """The platform token reads both rows with their states (alive, dead) and the counts; a tenant
    operator's token is refused 403 (the fleet is platform-wide), a missing token 401."""
    answer = world.client.get("/v1/workers", headers={"Authorization": f"Bearer {world.platform_token}"})
    assert answer.status_code == 200, answer.text
    document = answer.json()
    states = {w["holder"]: (w["role"], w["state"], w["concurrency"]) for w in document["workers"]}
    assert states == {ALIVE: ("worker", "alive", 4), DEAD: ("sweeper", "dead", 1)}
    assert (document["alive"], document["dead"], document["stopped"]) == (1, 1, 0)
    refused = world.client.get("/v1/workers", headers={"Authorization": f"Bearer {world.tokens.operator}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied", refused.text
    assert "platform_operator" in refused.json()["error"]["message"]
    assert world.client.get("/v1/workers").status_code == 401


def test_the_ops_page_shows_workers_to_the_platform_operator(world: Fleet) -> None:
    """/ui/ops for the platform operator has a Workers section naming both processes and their states; a
    tenant operator's Ops page has no such section (another tenant's workers' hosts are not its business)."""
    page = TestClient(world.client.app, cookies={SESSION_COOKIE: world.platform_token}).get("/ui/ops")
    assert page.status_code == 200, page.text
    assert "Workers: 1 alive, 1 dead" in page.text
    assert ALIVE in page.text and DEAD in page.text and 'class="worker-dead"' in page.text
    tenant_page = TestClient(world.client.app, cookies={SESSION_COOKIE: world.tokens.operator}).get("/ui/ops")
    assert tenant_page.status_code == 200 and "workers-heading" not in tenant_page.text


def test_dataflow_workers_prints_the_fleet(world: Fleet, tmp_path: Path) -> None:
    """`dataflow workers --json` (another process, the real database clock) prints the same states as the
    API; the table names the holders and the count per state."""
    cli = make_cli(world.db_url, tmp_path)
    shown = cli("workers", "--json")
    assert shown.code == 0, shown.output
    document = shown.json()
    assert {w["holder"]: w["state"] for w in document["workers"]} == {ALIVE: "alive", DEAD: "dead"}
    assert (document["alive"], document["dead"]) == (1, 1)
    table = cli("workers")
    assert table.code == 0, table.output
    assert "host-a:101" in table.stdout and "2 process(es): 1 alive, 1 dead" in table.stdout
