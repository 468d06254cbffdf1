"""`GET /v1/datasources/{name}/partitions` (issue 27, item 4): the same status as `dataflow partitions`,
for the caller's tenant only, on SQLite and PostgreSQL platform databases.

Another tenant's token gets 404 for a datasource it has no partitioned run of (the answer for one that
does not exist), and its own run of the same datasource never shows to the first; a bad `from` is 422
naming the field and never echoing the value; a platform operator's token (no tenant) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.protocol import partitions
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens

DATASOURCE = "analytics.daily_totals"
PATH = f"/v1/datasources/{DATASOURCE}/partitions"


def _definition() -> Definition:
    return flows.daily_partition_definition(DATASOURCE, "delta")


def _run(platform: Platform, tmp_path: Path, tenant: str, key: str, day: str) -> Run:
    request = flows.request(_definition(), tmp_path / tenant, key, tenant=tenant, params={"day": day})
    run = platform.runs.run_inline(request).run
    assert run.status == "succeeded", run.error_message
    return run


@pytest.fixture
def world(platform: Platform) -> Iterator[tuple[TestClient, Tokens]]:
    with TestClient(create_app(platform)) as client:
        yield client, make_tokens(platform)


def _get(client: TestClient, token: str, path: str = PATH, **query: str) -> Any:
    return client.get(path, params=query, headers={"Authorization": f"Bearer {token}"})


def test_the_api_shows_the_callers_partitions_only(
    platform: Platform, tmp_path: Path, world: tuple[TestClient, Tokens]
) -> None:
    """acme's days 1 and 3 and globex's day 2: acme's viewer sees days 1-3 (day 2 missing, as acme has no
    run of it), with the current publication of each; globex's operator sees only its day 2, and before it
    had a run, 404 like an unknown datasource."""
    client, keys = world
    first = _run(platform, tmp_path, "acme", "d1", "2024-03-01")
    third = _run(platform, tmp_path, "acme", "d3", "2024-03-03")
    before = _get(client, keys.other_operator)
    assert before.status_code == 404 and before.json()["error"]["code"] == "not_found"
    theirs = _run(platform, tmp_path, "globex", "g2", "2024-03-02")
    answer = _get(client, keys.viewer)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["datasource"], body["tenant"], body["columns"]) == (DATASOURCE, "acme", ["day"])
    shown = {p["partition"]["day"]: p for p in body["partitions"]}
    assert sorted(shown) == ["2024-03-01", "2024-03-02", "2024-03-03"]
    assert shown["2024-03-01"]["current"]["run_id"] == first.run_id
    assert shown["2024-03-03"]["current"]["run_id"] == third.run_id
    assert shown["2024-03-02"] == {"partition": {"day": "2024-03-02"}, "state": "missing", "current": None, "after": []}
    assert theirs.run_id not in answer.text
    other = _get(client, keys.other_operator).json()
    assert [p["current"]["run_id"] for p in other["partitions"]] == [theirs.run_id] and other["tenant"] == "globex"
    ranged = _get(client, keys.viewer, **{"from": "2024-03-02", "to": "2024-03-04"}).json()
    assert [(p["partition"]["day"], p["state"]) for p in ranged["partitions"]] == [
        ("2024-03-02", "missing"), ("2024-03-03", "published"), ("2024-03-04", "missing")
    ]


def test_the_api_refuses_bad_input_clearly(
    platform: Platform, tmp_path: Path, world: tuple[TestClient, Tokens]
) -> None:
    """A `from` that is no date: 422 naming it, without the value; an unknown datasource: 404; a platform
    operator's token, which has no tenant: 403."""
    client, keys = world
    _run(platform, tmp_path, "acme", "d1", "2024-03-01")
    bad = _get(client, keys.viewer, **{"from": "secret-value-9"})
    message = bad.json()["error"]["message"]
    assert bad.status_code == 422 and message.startswith("from must be a date (YYYY-MM-DD)"), message
    assert "secret-value-9" not in bad.text
    assert _get(client, keys.viewer, "/v1/datasources/analytics.nothing/partitions").status_code == 404
    platform_token = tokens.create_platform_token(platform.db, "root")[0]
    assert _get(client, platform_token).status_code == 403


def test_an_api_backfill_with_only_missing_skips_the_published_days(
    platform: Platform, tmp_path: Path, world: tuple[TestClient, Tokens]
) -> None:
    """POST /v1/backfills with only_missing over days 1-3, day 2 published: days 1 and 3 submitted, day 2
    reported skipped with its publication's run; stale without only_missing, or only_missing on a cancel,
    is 422 and records nothing."""
    client, keys = world
    published = _run(platform, tmp_path, "acme", "d2", "2024-03-02")
    headers = {"Authorization": f"Bearer {keys.operator}"}
    body: dict[str, Any] = {"definition": json.loads(_definition().model_dump_json(by_alias=True)),
                            "from": "2024-03-01", "to": "2024-03-03", "only_missing": True}  # fmt: skip
    answer = client.post("/v1/backfills", json=body, headers=headers)
    assert answer.status_code == 201, answer.text
    report = answer.json()
    assert (report["submitted_total"], report["existed_total"], report["skipped_total"]) == (2, 0, 1)
    assert [(r["tick"], r["created"], r["skipped"]) for r in report["runs"]] == [
        ("2024-03-01", True, False), ("2024-03-02", False, True), ("2024-03-03", True, False)
    ]
    assert report["runs"][1]["run_id"] == published.run_id
    for path, extra in (("/v1/backfills", {"only_missing": False, "stale": True}),
                        ("/v1/backfills/cancel", {"only_missing": True})):  # fmt: skip
        refused = client.post(path, json={**body, **extra, "from": "2024-03-04", "to": "2024-03-04"}, headers=headers)
        assert refused.status_code == 422 and "only_missing" in refused.json()["error"]["message"], refused.text
    with platform.db.read() as conn:
        assert partitions.status(conn, platform.db, "acme", DATASOURCE).partitions[-1].label == "2024-03-03"
