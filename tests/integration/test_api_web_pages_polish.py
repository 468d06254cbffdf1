"""Run page and /docs polish (issue 30): ledger facts as JSON, no alert link to the page it is on,
/docs leads to the API reference page, and each run's recorded time, duration and phases."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from durable_dataflow.api import web
from durable_dataflow.api.app import create_app
from durable_dataflow.dataflow.protocol.runs import Run
from durable_dataflow.platform import Platform
from support.api_runs import (
    Tokens,
    copy_examples,
    make_atomic_run,
    make_outcome_unknown_run,
    make_queued_run,
    make_tokens,
    web_login,
)

FACT = re.compile(r'<li><span class="muted">([^<]*)</span> <code>([^<]*)</code></li>')


@pytest.fixture
def site(db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Run, Tokens]]:
    platform = Platform(db_url)
    unknown = make_outcome_unknown_run(platform, copy_examples(tmp_path), "acme")
    tokens = make_tokens(platform)
    yield TestClient(create_app(platform), follow_redirects=False), unknown, tokens
    platform.close()


def _page(client: TestClient, token: str, url: str) -> str:
    assert web_login(client, token).status_code == 303
    answer = client.get(url)
    assert answer.status_code == 200, answer.text
    return answer.text


def test_ledger_facts_are_json_values(site: tuple[TestClient, Run, Tokens]) -> None:
    """Every fact in the run page's ledger timeline parses as JSON (strings and an object's keys in double
    quotes, never a Python repr's single ones), the facts include a string and an object, and the
    filter writes a missing value as `null`, not `None`."""
    client, unknown, tokens = site
    text = _page(client, tokens.viewer, f"/ui/runs/{unknown.run_id}")
    facts = [(name, json.loads(html.unescape(value))) for name, value in FACT.findall(text)]
    assert facts, "no ledger facts on the run page"
    kinds = {type(value) for _, value in facts}
    assert str in kinds and dict in kinds, facts
    assert web.json_value(None) == "null" and web.json_value({"a": None}) == '{"a": null}'


def test_the_alert_links_to_the_run_only_from_other_pages(site: tuple[TestClient, Run, Tokens]) -> None:
    """The unresolved alert's "open the run" link is absent on that run's own page and present on the
    runs list, where it leads somewhere."""
    client, unknown, tokens = site
    link = f'<a href="/ui/runs/{unknown.run_id}">open the run</a>'
    own = _page(client, tokens.viewer, f"/ui/runs/{unknown.run_id}")
    assert 'role="alert"' in own and link not in own and "press Reconcile below" in own
    assert link in client.get("/ui/runs").text


def test_docs_says_where_the_api_reference_is(site: tuple[TestClient, Run, Tokens]) -> None:
    """GET /docs (and /redoc) send the browser to the API reference page, /ui/docs, which needs a session:
    without one, the login form (the page itself: tests/integration/test_web_schedules_backfills.py)."""
    client, _, _ = site
    for path in ("/docs", "/redoc"):
        answer = client.get(path)
        assert answer.status_code == 303 and answer.headers["location"] == "/ui/docs", answer.text
    assert client.get("/ui/docs").headers["location"] == "/ui/login"


# ---- durations and phases (issue 30, item 4) ---------------------------------------------------

PHASE_ROW = re.compile(r'<tr><th scope="row">([^<]*)</th><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td></tr>')
MILESTONE = re.compile(r"<dt>([^<]*)</dt><dd>([^<]*)</dd>")
DURATION = r"(\d+ ms|\d+\.\d s|\d+ min \d\d s)"  # an example run takes well under an hour


@pytest.fixture
def timed(db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Platform, dict[str, Run], Tokens]]:
    """An atomic run that succeeded, a queued one, and a forward-recovery run left outcome_unknown."""
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    made = {
        "succeeded": make_atomic_run(platform, examples, "acme"),
        "queued": make_queued_run(platform, examples, "acme", "timed-queued"),
        "unknown": make_outcome_unknown_run(platform, examples, "acme"),
    }
    yield TestClient(create_app(platform), follow_redirects=False), platform, made, make_tokens(platform)
    platform.close()


def _row(history: str, run_id: str) -> str:
    found = re.search(rf'<tr class="[^"]*">\s*<th scope="row"><a href="/ui/runs/{run_id}">.*?</tr>', history, re.S)
    assert found is not None, f"no history row for {run_id}"
    return found.group(0)


def _times(page: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The run page's Times block: its (term, value) pairs and its phases' names, in page order."""
    block = page.split('<h2 id="times-heading">Times</h2>', 1)[1].split("</section>", 1)[0]
    milestones = [(html.unescape(t), html.unescape(v)) for t, v in MILESTONE.findall(block)]
    return milestones, [html.unescape(name) for name, *_ in PHASE_ROW.findall(block)]


def test_history_shows_when_each_run_was_recorded_and_how_long_it_took(
    timed: tuple[TestClient, Platform, dict[str, Run], Tokens],
) -> None:
    """Recorded (time and age) and Duration columns: a finished run's duration, "queued for" a queued one's
    time so far, and none for an unresolved run (its row moves with every reconcile attempt)."""
    client, _, made, tokens = timed
    history = _page(client, tokens.viewer, "/ui/runs")
    assert '<th scope="col">Recorded</th>' in history and '<th scope="col">Duration</th>' in history
    cells = {name: re.findall(r"<td[^>]*>(.*?)</td>", _row(history, run.run_id), re.S) for name, run in made.items()}
    for name, run in made.items():
        recorded = cells[name][-2]
        assert web.time_text(run.created_at_us) in recorded and " ago</span>" in recorded, recorded
    assert re.fullmatch(DURATION, cells["succeeded"][-1]), cells["succeeded"]
    assert re.fullmatch(f"queued for {DURATION}", cells["queued"][-1]), cells["queued"]
    assert cells["unknown"][-1] == "—", cells["unknown"]


def test_run_page_shows_the_times_and_phases_of_a_run(
    timed: tuple[TestClient, Platform, dict[str, Run], Tokens],
) -> None:
    """The Times block: a success's moments and phases in order with its duration; a queued run's open
    phase; a forward-recovery run's dispatch authorization, its unresolved phase still open, and after a
    reconciliation that finds the publication, the phase that ends at its confirmation."""
    client, _, made, tokens = timed
    assert web_login(client, tokens.operator).status_code == 303
    milestones, phases = _times(client.get(f"/ui/runs/{made['succeeded'].run_id}").text)
    assert [term for term, _ in milestones] == ["Recorded", "Started", "Succeeded", "Duration"]
    assert milestones[0][1] == web.time_text(made["succeeded"].created_at_us)
    assert re.fullmatch(DURATION, milestones[-1][1]), milestones
    assert phases == ["recorded → started", "started → succeeded"]

    milestones, phases = _times(client.get(f"/ui/runs/{made['queued'].run_id}").text)
    assert [term for term, _ in milestones] == ["Recorded", "Terminal", "Duration so far"]
    assert milestones[1][1] == "not yet: still queued" and phases == ["recorded → now (still queued)"]
    assert re.fullmatch(DURATION, milestones[-1][1]), milestones

    page = client.get(f"/ui/runs/{made['unknown'].run_id}").text
    milestones, phases = _times(page)
    assert [term for term, _ in milestones] == [
        "Recorded", "Started", "Dispatch authorized", "Outcome unknown", "Terminal", "Duration so far"
    ]  # fmt: skip
    assert phases == [
        "recorded → started", "started → dispatch authorized", "dispatch authorized → outcome unknown",
        "outcome unknown → now (still outcome_unknown)",
    ]  # fmt: skip
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert csrf is not None
    answer = client.post(f"/ui/runs/{made['unknown'].run_id}/reconcile", data={"csrf": csrf.group(1)})
    assert answer.status_code == 303, answer.text
    milestones, phases = _times(client.get(answer.headers["location"]).text)
    assert [term for term, _ in milestones] == ["Recorded", "Started", "Dispatch authorized", "Confirmed", "Duration"]
    assert phases[-1] == "dispatch authorized → confirmed" and len(phases) == 3
    assert re.fullmatch(DURATION, milestones[-1][1]), milestones
