"""Schedules and backfills on the operator pages, and the offline API reference (issue 30, item 4), on
SQLite and PostgreSQL: a schedule's last tick links its run and lists its recent runs; a backfill of a
scheduled definition becomes its last run ("Last run" no longer stays "—") and shows its progress, days per
state, on /ui/schedules and day by day on /ui/backfills/<definition>, each day linking its run; /docs is
Swagger UI served by the app itself (nothing from another host), behind a session like every page, and the
JSON 404 of an unknown path points to it."""

from __future__ import annotations

import datetime as dt
import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.api.auth import SESSION_COOKIE
from durable_dataflow.dataflow.schedules import backfill, schedules
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens

HOUR = dt.timedelta(hours=1)
DAILY = {"cron": "0 3 * * *", "timezone": "UTC", "parameters": {"day": "{{ tick.date }}"}}
DAYS = [f"2026-03-0{day}" for day in range(1, 7)]
# The state each backfill day is put in (by its projection, as the worker and the sweeper would leave it).
DAY_STATES = {
    "2026-03-01": ("succeeded", "verified"),
    "2026-03-02": ("succeeded", "verified"),
    "2026-03-03": ("failed", "no_external_output"),
    "2026-03-04": ("running", "leased"),
    "2026-03-05": ("outcome_unknown", "outcome_unknown"),
    # 2026-03-06 stays queued; 2026-03-07 is cancelled through POST /v1/backfills/cancel.
}
EXPECTED_COUNTS = {"queued": 1, "running": 1, "succeeded": 2, "failed": 1, "cancelled": 1, "unresolved": 1}


@dataclass(frozen=True)
class Served:
    platform: Platform
    client: TestClient
    tokens: Tokens

    def call(self, method: str, path: str, token: str, body: Any = None) -> Any:
        return self.client.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})

    def browser(self, token: str | None) -> TestClient:
        """A browser session for ``token`` (the cookie set directly: the login form is tested elsewhere)."""
        cookies = {SESSION_COOKIE: token} if token is not None else None
        return TestClient(self.client.app, follow_redirects=False, cookies=cookies)

    def page(self, path: str) -> str:
        answer = self.browser(self.tokens.viewer).get(path)
        assert answer.status_code == 200, answer.text
        return answer.text


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    platform = Platform(db_url)
    app = create_app(platform, data_root=tmp_path / "tenants", sink_root=tmp_path / "sinks")
    with TestClient(app) as client:
        yield Served(platform, client, make_tokens(platform))
    platform.close()


def _set_state(platform: Platform, run_id: str, status: str, recovery: str) -> None:
    with platform.db.begin() as conn:
        conn.execute(
            sa.text("UPDATE dataflow_runs SET status=:s, recovery_status=:r WHERE run_id=:id"),
            {"s": status, "r": recovery, "id": run_id},
        )


def _schedule_row(page: str, name: str) -> str:
    found = re.search(rf'<tr class="[^"]*">\s*<th scope="row">{name}<br>.*?</tr>', page, re.S)
    assert found is not None, f"no schedule row for {name}"
    return found.group(0)


def _backfill_row(page: str, name: str) -> str:
    found = re.search(rf'<tr class="[^"]*">\s*<th scope="row"><a href="/ui/backfills/{name}">.*?</tr>', page, re.S)
    assert found is not None, f"no backfill row for {name}"
    return found.group(0)


def _counts(fragment: str) -> dict[str, int]:
    """The per-state counts of a backfill row (td) or of the backfill page (dd), by state."""
    found = re.findall(r'<(?:td|dd) class="count count-([a-z]+)(?: nonzero)?">(\d+)</(?:td|dd)>', fragment)
    return {state: int(n) for state, n in found}


def test_a_ticked_schedule_links_its_run_and_its_recent_runs(served: Served) -> None:
    """Two hourly ticks: the row shows the last tick, its run linked as the last run, and both runs under
    Recent runs (linked, newest first, each with its status and its time so far)."""
    hourly = flows.daily_flow({**DAILY, "cron": "0 * * * *", "overlap": "allow"})
    answer = served.call("POST", "/v1/schedules", served.tokens.operator, {"definition": hourly})
    assert answer.status_code == 201, answer.text
    applied_at = schedules.parse_now(answer.json()["schedule"]["applied_at"])
    assert applied_at is not None
    decided = schedules.evaluate(served.platform.db, served.platform.runs, applied_at + 2 * HOUR).decisions
    assert [d.decision for d in decided] == ["submitted"] * 2
    first, last = (d.run_id or "" for d in decided)
    row = _schedule_row(served.page("/ui/schedules"), "daily")
    assert f'<a href="/ui/runs/{last}">{last}</a>' in row and f"tick {decided[-1].tick}" in row
    recent = row.split('<ul class="recent-runs">', 1)[1]
    links = re.findall(r'<li><a href="/ui/runs/([0-9a-f-]+)">', recent)
    assert links == [last, first]
    assert recent.count('<span class="status status-queued">queued</span> · queued for ') == 2
    assert f"tick {decided[0].tick}" in recent


def test_a_backfill_is_the_last_run_and_shows_its_progress(served: Served) -> None:
    """A scheduled definition never ticked, backfilled over a week: its last run is the newest backfill day
    (linked, not "—"); the Backfills section counts the days per state (queued, running, succeeded, failed,
    cancelled, unresolved) and links the backfill's page, which lists every day with its run linked."""
    document = flows.daily_flow(DAILY)
    assert served.call("POST", "/v1/schedules", served.tokens.operator, {"definition": document}).status_code == 201
    before = _schedule_row(served.page("/ui/schedules"), "daily")
    assert before.count("<td>—</td>") >= 3 and "No backfills." in served.page("/ui/schedules")
    body = {"definition": document, "from": DAYS[0], "to": "2026-03-07"}
    submitted = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert submitted.status_code == 201, submitted.text
    by_day = {d["tick"][:10]: d["run_id"] for d in submitted.json()["runs"]}
    assert len(by_day) == 7
    for day, (status, recovery) in DAY_STATES.items():
        _set_state(served.platform, by_day[day], status, recovery)
    cancel = {**body, "from": "2026-03-07"}
    assert served.call("POST", "/v1/backfills/cancel", served.tokens.operator, cancel).status_code == 200

    page = served.page("/ui/schedules")
    row = _schedule_row(page, "daily")
    newest = submitted.json()["runs"][-1]  # recorded last: the last run
    assert f'<a href="/ui/runs/{newest["run_id"]}">{newest["run_id"]}</a>' in row
    assert f"backfill day {newest['tick']}" in row and "cancelled" in row
    assert len(re.findall(r'<li><a href="/ui/runs/', row)) == backfill.RECENT_RUNS_SHOWN
    summary = _backfill_row(page, "daily")
    assert _counts(summary) == EXPECTED_COUNTS
    assert '<progress max="7" value="4"' in summary and "2026-03-01T03:00:00Z – 2026-03-07T03:00:00Z" in summary

    days_page = served.page("/ui/backfills/daily")
    assert _counts(days_page) == EXPECTED_COUNTS
    rows = re.findall(r'<th scope="row">([0-9T:Z-]+)</th>\s*<td><a href="/ui/runs/([0-9a-f-]+)">', days_page)
    assert [(tick[:10], run_id) for tick, run_id in rows] == sorted(by_day.items())
    assert "UNRESOLVED: outcome_unknown" in days_page and 'role="alert"' in days_page
    assert '<span class="status status-cancelled">cancelled</span>' in days_page


def test_a_backfill_page_is_the_tenants_own(served: Served) -> None:
    """Another tenant's backfill, an unknown name and a name no definition can have answer 404 on the page;
    without a session the page sends the browser to the login form."""
    body = {"definition": flows.daily_flow(), "from": DAYS[0], "to": DAYS[1]}
    assert served.call("POST", "/v1/backfills", served.tokens.other_operator, body).status_code == 201
    assert "No backfills." in served.page("/ui/schedules")  # globex's backfill is not on acme's page
    for name in ("daily", "nope", "no%20such_name", "a_"):
        answer = served.browser(served.tokens.viewer).get(f"/ui/backfills/{name}")
        assert answer.status_code == 404, (name, answer.text)
    globex_viewer = tokens.create_token(served.platform.db, "globex", "viewer", "g")[0]
    other = served.browser(globex_viewer).get("/ui/backfills/daily")
    assert other.status_code == 200 and "2026-03-02" in other.text
    assert served.browser(None).get("/ui/backfills/daily").headers["location"] == "/ui/login"


def test_a_stale_re_run_replaces_its_days_state(served: Served) -> None:
    """A day with two runs, one under a stale key (``…:<tick>:<12 hex digits>``, as ``--only-missing
    --stale`` records a re-run), counts once, in its newest run's state, and the page links both runs."""
    body = {"definition": flows.daily_flow(), "from": DAYS[0], "to": DAYS[0]}
    older = served.call("POST", "/v1/backfills", served.tokens.operator, body).json()["runs"][0]
    stale_key = f"{older['idempotency_key']}:{'a' * backfill.STALE_KEY_HASH_CHARS}"
    with served.platform.db.begin() as conn:  # the older run, succeeded, moved under a stale key
        conn.execute(
            sa.text("UPDATE dataflow_runs SET idempotency_key=:k, status='succeeded', recovery_status='verified', "
                    "created_at_us = created_at_us - 1000000 WHERE run_id=:id"),
            {"k": stale_key, "id": older["run_id"]},
        )  # fmt: skip
    newer = served.call("POST", "/v1/backfills", served.tokens.operator, body).json()["runs"][0]
    assert newer["created"] is True and newer["run_id"] != older["run_id"]
    found = backfill.summaries(served.platform.db, "acme").items
    assert [(s.definition, s.days, s.counts["queued"], s.counts["succeeded"]) for s in found] == [("daily", 1, 1, 0)]
    page = served.page("/ui/backfills/daily")
    assert _counts(page)["queued"] == 1 and sum(_counts(page).values()) == 1
    assert f'<a href="/ui/runs/{newer["run_id"]}">{newer["run_id"]}</a>' in page
    assert f'earlier: <a href="/ui/runs/{older["run_id"]}">' in page
    assert backfill.parse_key("acme", stale_key) == ("daily", DAYS[0])
    assert backfill.parse_key("acme", f"schedule:acme:daily:{DAYS[0]}") is None
    assert backfill.parse_key("acme", "backfill:globex:daily:2026-03-01") is None


# ---- /docs: the API reference, offline -------------------------------------------------------------

OTHER_HOST = re.compile(r"""https?://(?!testserver[/"'])[^\s"'<>]+""")


def test_docs_is_swagger_ui_served_by_the_app_itself(served: Served) -> None:
    """/docs sends the browser to /ui/docs, which (with a session) answers 200 HTML loading Swagger UI's
    script and stylesheet from this server, names no other host, and whose scripts and stylesheet answer
    200; its OpenAPI document is the one GET /openapi.json answers a token."""
    browser = served.browser(served.tokens.viewer)
    redirect = browser.get("/docs")
    assert redirect.status_code == 303 and redirect.headers["location"] == "/ui/docs"
    assert browser.get("/redoc").headers["location"] == "/ui/docs"
    answer = browser.get("/ui/docs")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    page = answer.text
    assert OTHER_HOST.findall(page) == [], OTHER_HOST.findall(page)
    assets = re.findall(r'<(?:script src|link rel="(?:stylesheet|icon)" href)="([^"]+)"', page)
    assert {"/static/apidocs/swagger-ui-bundle.js", "/static/apidocs/swagger-ui.css", "/static/docs.js"} <= set(assets)
    for asset in assets:
        assert asset.startswith("/static/"), asset
        fetched = served.browser(None).get(asset)  # static files answer without a session, as the stylesheet does
        assert fetched.status_code == 200 and fetched.content, asset
    starter = served.browser(None).get("/static/docs.js").text
    assert '"/ui/openapi.json"' in starter and "validatorUrl: null" in starter
    policy = answer.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe" not in policy and "frame-ancestors 'none'" in policy
    document = browser.get("/ui/openapi.json")
    assert document.status_code == 200
    assert document.json() == served.call("GET", "/openapi.json", served.tokens.viewer).json()
    assert document.json()["openapi"].startswith("3.1")
    assert '<a href="/ui/docs">API reference</a>' in served.page("/ui/runs")


def test_docs_without_a_session_is_refused_like_every_page(served: Served) -> None:
    """Without a session /ui/docs and its document send the browser to the login form; a bad token too; a
    platform operator's token is refused 403 as on the tenant pages (and as GET /openapi.json refuses it)."""
    for path in ("/ui/docs", "/ui/openapi.json"):
        anonymous = served.browser(None).get(path)
        assert anonymous.status_code == 303 and anonymous.headers["location"] == "/ui/login", path
        forged = served.browser("ddf_not_a_token").get(path)
        assert forged.status_code == 303 and forged.headers["location"] == "/ui/login", path
    platform_token = tokens.create_platform_token(served.platform.db, "oncall")[0]
    assert served.browser(platform_token).get("/ui/docs").status_code == 403
    followed = TestClient(served.client.app).get("/docs")  # a browser following the redirects
    assert followed.status_code == 200 and 'action="/ui/login"' in followed.text


@pytest.mark.parametrize("path", ["/nope", "/v1/nope", "/v2/runs"])
def test_an_unknown_path_points_to_docs(served: Served, path: str) -> None:
    """An unknown path answers the JSON 404 not_found, whose message says to see /docs (and /openapi.json),
    never echoing the path; a known route's own not_found keeps its message."""
    answer = served.call("GET", path, served.tokens.viewer)
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert error["code"] == "not_found" and "see /docs" in error["message"] and "/openapi.json" in error["message"]
    assert path not in error["message"]
    known = served.call("GET", "/v1/runs/00000000-0000-4000-8000-000000000000", served.tokens.viewer)
    assert known.status_code == 404 and "/docs" not in known.json()["error"]["message"]
    unescaped = html.unescape(error["message"])
    assert unescaped == error["message"]
