"""The partition grid page `/ui/datasources/{name}/partitions` (issue 27, item 4): one row per partition,
one column per state, each cell coloured by its state and linking to its runs; the tenant's partitions
only (another tenant's session gets 404); the run page of a partitioned run links to it. SQLite and
PostgreSQL platform databases, a Delta sink.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.definitions.definitions import Definition
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.datasources import registry
from durable_dataflow.datasources.delta import DeltaProvider
from durable_dataflow.datasources.testing import FaultInjectingProvider
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import make_tokens, web_login

DATASOURCE = "analytics.daily_totals"
PAGE = f"/ui/datasources/{DATASOURCE}/partitions"


def _definition() -> Definition:
    return flows.daily_partition_definition(DATASOURCE, "faulty")


def _run(platform: Platform, tmp_path: Path, key: str, day: str, *, queue: bool = False) -> Run:
    request = flows.request(_definition(), tmp_path, key, params={"day": day})
    return (platform.runs.submit(request) if queue else platform.runs.run_inline(request)).run


def _cell(html: str, label: str, state: str) -> str:
    """The grid cell of partition ``label`` and column ``state`` (its class and its content)."""
    row = re.search(rf'<tr>\s*<th scope="row">{re.escape(label)}</th>(.*?)</tr>', html, flags=re.DOTALL)
    assert row is not None, label
    cells = re.findall(r'<td class="cell( cell-[a-z]+)?">(.*?)</td>', row.group(1), flags=re.DOTALL)
    states = ["published", "queued", "running", "unresolved", "failed", "missing"]
    assert len(cells) == len(states), cells
    style, content = cells[states.index(state)]
    return f"{style.strip()}|{content}"


def test_the_grid_shows_each_partition_by_state_with_links_to_its_runs(platform: Platform, tmp_path: Path) -> None:
    """Day 2's only run lost its answer (unresolved), day 1 published then queued again, day 3 missing in
    the range: each cell has its state's class and links to its run; the unresolved run's warning block is
    on the page; globex's session gets 404; the run page links to the grid."""
    faulty = FaultInjectingProvider(DeltaProvider(), "fail_before_send", fail_times=1)
    registry.register_provider("faulty", lambda: faulty)
    unknown = _run(platform, tmp_path, "d2", "2024-03-02")
    published = _run(platform, tmp_path, "d1", "2024-03-01")
    queued = _run(platform, tmp_path, "d1-again", "2024-03-01", queue=True)
    assert (unknown.status, published.status, queued.status) == ("outcome_unknown", "succeeded", "queued")
    keys = make_tokens(platform)
    client = TestClient(create_app(platform), follow_redirects=False)
    assert web_login(client, keys.viewer).status_code == 303
    page = client.get(PAGE, params={"from": "2024-03-01", "to": "2024-03-03"})
    assert page.status_code == 200, page.text
    html = page.text
    assert _cell(html, "2024-03-01", "published").startswith("cell-published|")
    assert f'href="/ui/runs/{published.run_id}"' in _cell(html, "2024-03-01", "published")
    assert f'href="/ui/runs/{queued.run_id}"' in _cell(html, "2024-03-01", "queued")
    assert _cell(html, "2024-03-01", "missing") == "|"
    assert _cell(html, "2024-03-02", "unresolved").startswith("cell-unresolved|")
    assert f'href="/ui/runs/{unknown.run_id}"' in _cell(html, "2024-03-02", "unresolved")
    assert _cell(html, "2024-03-02", "missing").startswith("cell-missing|")
    assert _cell(html, "2024-03-03", "missing") == "cell-missing|missing"
    assert 'role="alert"' in html and unknown.run_id in html
    bad = client.get(PAGE, params={"from": "not-a-day"})
    assert bad.status_code == 422 and "from must be a date" in bad.text
    assert "--from" not in bad.text and "not-a-day" not in bad.text
    other = TestClient(create_app(platform), follow_redirects=False)
    assert web_login(other, keys.other_operator).status_code == 303
    assert other.get(PAGE).status_code == 404
    run_page = client.get(f"/ui/runs/{published.run_id}").text
    assert f'href="/ui/datasources/{DATASOURCE}/partitions"' in run_page
