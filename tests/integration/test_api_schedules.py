"""Schedules and backfills through the JSON API and the web view, on SQLite and PostgreSQL: apply, list,
get, pause, resume, roles, tenant isolation, a resumable backfill, bad input refused with nothing
recorded, and the schedules page (its UNRESOLVED warning, a hostile name escaped). The last section holds
the red team's findings (commit cf6f558): a cron that matches no date, and a backfill day not written
YYYY-MM-DD.

Schedules in the other tiers: evaluation (exactly-once ticks, catch-up, overlap) in
tests/integration/test_schedules.py; `dataflow schedules` and `dataflow backfill` as real processes in
tests/acceptance/test_cli_schedules.py. Cancelling a single run: tests/integration/test_cancel.py."""

from __future__ import annotations

import datetime as dt
import json
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
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.dataflow.schedules.schedule_schema import schedule_ticks
from durable_dataflow.dataflow.schedules.schedule_schema import schedules as schedules_table
from durable_dataflow.dataflow.worker import Worker, WorkerOptions
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens
from support.cli import make_cli

HOUR = dt.timedelta(hours=1)
TABLES = ("schedules", "schedule_ticks", "dataflow_runs")
HOSTILE_NAME = '<script>alert("x")</script>\x1b[31m\u202eevil'


flow = flows.daily_flow


def hourly(**changes: Any) -> dict[str, Any]:
    return {"cron": "0 * * * *", "timezone": "Europe/Berlin", "parameters": {"day": "{{ tick.date - 1 day }}"},
            "overlap": "allow", "catchup_window": "7d", **changes}  # fmt: skip


@dataclass(frozen=True)
class Served:
    platform: Platform
    client: TestClient
    tokens: Tokens
    db_url: str
    tmp_path: Path

    def call(self, method: str, path: str, token: str, body: Any = None) -> Any:
        return self.client.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})

    def apply(self, document: dict[str, Any], token: str | None = None) -> dict[str, Any]:
        answer = self.call("POST", "/v1/schedules", token or self.tokens.operator, {"definition": document})
        assert answer.status_code in (200, 201), answer.text
        result: dict[str, Any] = answer.json()
        return result

    def tick(self, applied: dict[str, Any], after: dt.timedelta) -> list[schedules.TickDecision]:
        """Evaluate every schedule at ``after`` past this one's apply instant (what a worker does)."""
        moment = schedules.parse_now(applied["schedule"]["applied_at"])
        assert moment is not None
        return schedules.evaluate(self.platform.db, self.platform.runs, moment + after).decisions

    def counts(self) -> dict[str, int]:
        with self.platform.db.read() as conn:
            return {t: int(conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar() or 0) for t in TABLES}

    def browser(self, token: str) -> TestClient:
        """A browser session for ``token`` (the cookie set directly: the login form is tested elsewhere)."""
        return TestClient(self.client.app, follow_redirects=False, cookies={SESSION_COOKIE: token})


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    platform = Platform(db_url)
    app = create_app(platform, data_root=tmp_path / "tenants", sink_root=tmp_path / "sinks")
    with TestClient(app) as client:
        yield Served(platform, client, make_tokens(platform), db_url, tmp_path)
    platform.close()


def _make_unresolved(platform: Platform, run_id: str) -> None:
    """The projection of a run whose publication may exist (what a sweeper writes after a lost dispatch)."""
    with platform.db.begin() as conn:
        conn.execute(
            sa.text("UPDATE dataflow_runs SET status='outcome_unknown', recovery_status='outcome_unknown', "
                    "warning='the publication may exist' WHERE run_id=:r"),
            {"r": run_id},
        )  # fmt: skip


def test_apply_list_get_pause_and_resume(served: Served) -> None:
    """Proves the schedule life cycle over HTTP: apply answers 201 and re-applying the same document 200
    with nothing written; list and get show the ticks a worker decided, newest first, with their runs;
    pause stops ticks (and hides the next one), resume brings the next tick back."""
    first = served.apply(flow(hourly()))
    assert (first["created"], first["changed"]) == (True, True)
    assert first["schedule"]["applied_by"] == "token:acme-operator" and first["schedule"]["tenant"] == "acme"
    with served.platform.db.read() as conn:
        stored = conn.execute(sa.select(schedules_table)).all()
    again = served.call("POST", "/v1/schedules", served.tokens.operator, {"definition": flow(hourly())})
    assert again.status_code == 200 and (again.json()["created"], again.json()["changed"]) == (False, False)
    with served.platform.db.read() as conn:
        assert conn.execute(sa.select(schedules_table)).all() == stored  # unchanged, times included

    decided = served.tick(first, 2 * HOUR)
    assert [d.decision for d in decided] == ["submitted"] * 2
    listed = served.call("GET", "/v1/schedules", served.tokens.viewer).json()["schedules"]
    assert [s["name"] for s in listed] == ["daily"]
    item = listed[0]
    assert (item["cron"], item["timezone"], item["paused"], item["enabled"]) == ("0 * * * *", "Europe/Berlin",
                                                                               False, True)  # fmt: skip
    assert item["next_tick"] is not None and item["last_tick"] == decided[-1].tick
    assert item["last_run_id"] == decided[-1].run_id and item["last_run_status"] == "queued"
    assert (item["unresolved"], item["warning"]) == (False, None)
    one = served.call("GET", "/v1/schedules/daily?limit=5", served.tokens.viewer).json()
    assert one["schedule"] == item
    assert [(d["tick"], d["decision"], d["run_id"]) for d in one["decisions"]] == [
        (d.tick, d.decision, d.run_id) for d in reversed(decided)
    ]

    paused = served.call("POST", "/v1/schedules/daily/pause", served.tokens.operator)
    assert paused.status_code == 200 and paused.json()["schedule"]["paused"] is True
    assert served.tick(first, 5 * HOUR) == []  # paused: no tick is decided
    assert served.call("GET", "/v1/schedules", served.tokens.viewer).json()["schedules"][0]["next_tick"] is None
    resumed = served.call("POST", "/v1/schedules/daily/resume", served.tokens.operator)
    assert resumed.status_code == 200 and resumed.json()["schedule"]["paused"] is False
    assert served.call("GET", "/v1/schedules/daily", served.tokens.viewer).json()["schedule"]["next_tick"]
    assert served.counts() == {"schedules": 1, "schedule_ticks": 2, "dataflow_runs": 2}


@pytest.mark.parametrize(
    ("role", "method", "path", "body"),
    [
        ("viewer", "POST", "/v1/schedules", {"definition": flow(hourly(), name="other")}),
        ("submitter", "POST", "/v1/schedules", {"definition": flow(hourly(), name="other")}),
        ("viewer", "POST", "/v1/schedules/daily/pause", None),
        ("viewer", "POST", "/v1/schedules/daily/resume", None),
        ("viewer", "POST", "/v1/backfills", {"definition": flow(), "from": "2026-03-01", "to": "2026-03-02"}),
        ("submitter", "POST", "/v1/backfills", {"definition": flow(), "from": "2026-03-01", "to": "2026-03-02"}),
    ],
)
def test_only_operators_apply_pause_resume_and_backfill(
    served: Served, role: str, method: str, path: str, body: Any
) -> None:
    """Proves the roles: a viewer or submitter is refused 403 and nothing is written (the applied
    schedule stays as it was, no run is recorded); the same viewer reads the schedule."""
    applied = served.apply(flow(hourly()))
    served.call("POST", "/v1/schedules/daily/pause", served.tokens.operator)  # so a resume would change it
    with served.platform.db.read() as conn:
        before = conn.execute(sa.select(schedules_table)).all()
    answer = served.call(method, path, getattr(served.tokens, role), body)
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["code"] == "permission_denied"
    assert f"needs the operator role; the token has {role}" in answer.json()["error"]["message"]
    with served.platform.db.read() as conn:
        assert conn.execute(sa.select(schedules_table)).all() == before
    assert served.counts()["dataflow_runs"] == 0
    shown = served.call("GET", "/v1/schedules/daily", served.tokens.viewer).json()["schedule"]
    assert shown["applied_at"] == applied["schedule"]["applied_at"]


def test_another_tenant_neither_sees_nor_touches_a_schedule(served: Served) -> None:
    """Proves isolation: globex's list is empty, its get, pause and resume of acme's schedule answer 404
    exactly like a name nobody has, acme's schedule is untouched, and globex applying the same name
    makes its own schedule."""
    served.apply(flow(hourly()))
    other = served.tokens.other_operator
    assert served.call("GET", "/v1/schedules", other).json() == {"schedules": [], "next_cursor": None}
    missing = served.call("GET", "/v1/schedules/nope", served.tokens.operator)
    assert missing.status_code == 404
    for method, path in (("GET", "/v1/schedules/daily"), ("POST", "/v1/schedules/daily/pause"),
                         ("POST", "/v1/schedules/daily/resume")):  # fmt: skip
        answer = served.call(method, path, other)
        assert answer.status_code == 404, (path, answer.text)
        assert answer.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"
        assert "acme" not in answer.text
    assert served.call("GET", "/v1/schedules/daily", served.tokens.viewer).json()["schedule"]["paused"] is False
    own = served.apply(flow(hourly(cron="15 * * * *")), token=other)
    assert own["created"] is True and own["schedule"]["tenant"] == "globex"
    acme = served.call("GET", "/v1/schedules", served.tokens.viewer).json()["schedules"]
    assert [(s["tenant"], s["cron"]) for s in acme] == [("acme", "0 * * * *")]


def test_a_week_backfilled_in_two_calls_and_again_leaves_seven_runs(served: Served) -> None:
    """Proves resumability: three days, then the whole week (four new), then the week again (nothing new,
    every day reported with its run); seven runs in all, each under its day's backfill key."""
    body: dict[str, Any] = {"definition": flow(), "from": "2026-03-01", "to": "2026-03-03"}
    first = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert first.status_code == 201, first.text
    assert first.json()["submitted_total"] == 3
    week = {**body, "to": "2026-03-07"}
    second = served.call("POST", "/v1/backfills", served.tokens.operator, week)
    assert second.status_code == 201
    assert [d["created"] for d in second.json()["runs"]] == [False] * 3 + [True] * 4
    third = served.call("POST", "/v1/backfills", served.tokens.operator, week)
    assert third.status_code == 200, third.text
    report = third.json()
    assert (report["submitted_total"], report["existed_total"], report["unresolved_total"]) == (0, 7, 0)
    assert [d["tick"] for d in report["runs"]] == [f"2026-03-0{day}" for day in range(1, 8)]
    assert [d["idempotency_key"] for d in report["runs"]] == [f"backfill:acme:daily:2026-03-0{d}" for d in range(1, 8)]
    assert [d["run_id"] for d in report["runs"]] == [d["run_id"] for d in second.json()["runs"]]
    assert {d["status"] for d in report["runs"]} == {"queued"}
    assert served.counts()["dataflow_runs"] == 7
    run = served.platform.runs.get(report["runs"][4]["run_id"], "acme")
    assert run.parameters == {"day": "2026-03-05"} and run.provenance["actor"] == "token:acme-operator"


def test_a_backfill_is_cancelled_day_by_day(served: Served) -> None:
    """Proves POST /v1/backfills/cancel: the queued days are cancelled (recording the token), a day
    without a run is reported, and calling it again writes nothing."""
    body: dict[str, Any] = {"definition": flow(), "from": "2026-03-01", "to": "2026-03-02"}
    assert served.call("POST", "/v1/backfills", served.tokens.operator, body).status_code == 201
    wider = {**body, "to": "2026-03-03"}
    answer = served.call("POST", "/v1/backfills/cancel", served.tokens.operator, wider)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert [d["outcome"] for d in report["runs"]] == ["cancelled", "cancelled", "no_run"]
    assert report["totals"]["cancelled"] == 2 and report["totals"]["no_run"] == 1
    run = served.platform.runs.get(report["runs"][0]["run_id"], "acme")
    assert (run.status, run.recovery_status) == ("cancelled", "no_external_output")
    assert "token:acme-operator" in (run.error_message or "")
    before = served.counts()
    again = served.call("POST", "/v1/backfills/cancel", served.tokens.operator, wider).json()
    assert [d["outcome"] for d in again["runs"]] == ["already_cancelled", "already_cancelled", "no_run"]
    assert served.counts() == before
    refused = served.call("POST", "/v1/backfills/cancel", served.tokens.viewer, wider)
    assert refused.status_code == 403


def test_a_backfill_of_a_scheduled_definition_runs_its_ticks(served: Served) -> None:
    """Proves the schedule's ticks and parameters are used: an hourly Berlin schedule on the
    spring-forward day has 23 ticks, each run's day the tick's local date minus one."""
    body = {"definition": flow(hourly()), "from": "2026-03-29", "to": "2026-03-29"}
    answer = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert answer.status_code == 201, answer.text
    days = answer.json()["runs"]
    assert len(days) == 23 and days[0]["tick"] == "2026-03-28T23:00:00Z"
    assert days[0]["idempotency_key"] == "backfill:acme:daily:2026-03-28T23:00:00Z"
    assert served.platform.runs.get(days[0]["run_id"]).parameters == {"day": "2026-03-28"}


BAD_APPLIES = [
    ("cron", flow(hourly(cron="30 2 * *")), "cron"),
    ("timezone", flow(hourly(timezone="Europe/Atlantis")), "time zone"),
    ("no schedule", flow(), "no schedule"),
    # What every tick's submit refuses: it was applied (201) and each tick recorded a failed submit.
    ("source outside the data roots", {**flow(hourly()), "sources": {"nums": {
        "kind": "csv", "path": "/etc/passwd", "schema": {"n": "int64"}}}}, "outside the run's data roots"),
    ("sink outside the sink root", {**flow(hourly()), "target": {**flows.parquet_target(location="../../globex")}},
     "target location must not contain '..'"),
    ("absolute sink", {**flow(hourly()), "target": {**flows.parquet_target(location="/tmp/evil")}},
     "target location must be relative"),
    ("secret not granted", {**flow(hourly()), "target": {**flows.parquet_target(),
                                                        "options": {"password": {"secret": "NOT_GRANTED"}}}},
     "not granted to this tenant"),
]
BAD_BACKFILLS = [
    ("over the maximum", {"definition": flow(), "from": "2026-01-01", "to": "2027-01-05"}, "at most 366 days"),
    ("reversed", {"definition": flow(), "from": "2026-03-05", "to": "2026-03-01"}, "to must not be before from"),
    ("not a day", {"definition": flow(), "from": "2026-02-30", "to": "2026-03-01"}, "from must be a date"),
    ("far future", {"definition": flow(), "from": "9999-12-31", "to": "9999-12-31"}, "from must be a day from"),
    ("template", {"definition": flow(), "from": "2026-03-01", "to": "2026-03-02",
                  "parameters": {"day": "{{ os.system }}"}}, "parameters.day: a parameter expression must be"),
    ("parameter type", {"definition": flow(), "from": "2026-03-01", "to": "2026-03-02",
                        "parameters": {"day": "{{ tick.iso }}"}}, "declared date"),
    ("timezone", {"definition": flow(hourly(timezone="Mars/Olympus")), "from": "2026-03-01", "to": "2026-03-02"},
     "time zone"),
    ("both", {"definition": flow(), "definition_hash": "sha256:" + "0" * 64, "from": "2026-03-01",
              "to": "2026-03-02"}, "exactly one of"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [("/v1/schedules", {"definition": d}, e) for _, d, e in BAD_APPLIES]
    + [("/v1/backfills", b, e) for _, b, e in BAD_BACKFILLS],
    ids=[f"apply {w}" for w, _, _ in BAD_APPLIES] + [f"backfill {w}" for w, _, _ in BAD_BACKFILLS],
)
def test_bad_input_is_refused_422_with_nothing_recorded(
    served: Served, path: str, body: dict[str, Any], expected: str
) -> None:
    """Proves the CLI's refusals hold over HTTP: each answers 422 invalid_input naming the problem, and
    no schedule, decision or run is recorded."""
    answer = served.call("POST", path, served.tokens.operator, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_input"
    assert expected in answer.json()["error"]["message"], answer.text
    assert served.counts() == dict.fromkeys(TABLES, 0)


def test_an_unresolved_last_run_is_listed_as_the_cli_lists_it(served: Served) -> None:
    """Proves the list and the CLI are one read: the last tick's run made unresolved is flagged with its
    warning and recovery status, and GET /v1/schedules holds exactly what `schedules list --json` prints."""
    applied = served.apply(flow(hourly()))
    decided = served.tick(applied, HOUR)
    _make_unresolved(served.platform, decided[-1].run_id or "")
    item = served.call("GET", "/v1/schedules", served.tokens.viewer).json()["schedules"][0]
    assert item["unresolved"] is True and item["last_run_recovery_status"] == "outcome_unknown"
    assert "the publication may exist" in item["warning"]
    cli = make_cli(served.db_url, served.tmp_path)("schedules", "list", "--tenant", "acme", "--json")
    assert cli.code == 0, cli.output
    assert cli.json() == [item]


def test_the_schedules_page_shows_the_unresolved_run_and_escapes_a_hostile_name(served: Served) -> None:
    """Proves the page: a schedule's cron, zone, state, last tick and its run linked, UNRESOLVED with the
    warning block; a name stored with markup and control characters shows escaped; a platform
    operator is refused 403 and the nav links the page for tenant sessions only."""
    applied = served.apply(flow(hourly(timezone="America/New_York")))
    decided = served.tick(applied, HOUR)
    run_id = decided[-1].run_id or ""
    _make_unresolved(served.platform, run_id)
    with served.platform.db.begin() as conn:  # as if written by an older version: the page must not trust it
        for table in (schedules_table, schedule_ticks):
            conn.execute(sa.update(table).where(table.c.name == "daily").values(name=HOSTILE_NAME))
    page = served.browser(served.tokens.viewer).get("/ui/schedules")
    assert page.status_code == 200, page.text
    html = page.text
    assert "<code>0 * * * *</code>" in html and "America/New_York" in html and "<td>active</td>" in html
    assert f'<a href="/ui/runs/{run_id}">{run_id}</a>' in html and decided[-1].tick in html
    assert "UNRESOLVED: outcome_unknown" in html and 'role="alert"' in html and "the publication may exist" in html
    assert "<script>" not in html and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html
    assert "\x1b" not in html and "\u202e" not in html and "\\x1b[31m" in html
    assert re.search(r'<a href="/ui/schedules">Schedules</a>', html)
    platform_token = tokens.create_platform_token(served.platform.db, "oncall")[0]
    refused = served.browser(platform_token).get("/ui/schedules")
    assert refused.status_code == 403 and "needs a tenant token" in refused.text
    ops = served.browser(platform_token).get("/ui/ops").text
    assert "/ui/schedules" not in ops


def test_an_empty_schedules_page_says_so(served: Served) -> None:
    """Proves the empty state and the tenant scope of the page: globex's schedule is not on acme's page;
    without a session the page sends the browser to the login form."""
    served.apply(flow(hourly()), token=served.tokens.other_operator)
    html = served.browser(served.tokens.viewer).get("/ui/schedules").text
    assert "No schedules." in html and "0 * * * *" not in html
    anonymous = TestClient(served.client.app, follow_redirects=False).get("/ui/schedules")
    assert anonymous.status_code == 303 and anonymous.headers["location"] == "/ui/login"


# ---- the red team against the schedules API (commit cf6f558) ------------------------------------------------
# Finding 1: a schedule whose cron matches no date (``0 0 30 2 *``: February 30) was applied through
# POST /v1/schedules (201); then every evaluation of every tenant's schedules raised CroniterBadDateError, so
# every worker on the platform died at its first schedule evaluation (another tenant's queued run was never
# executed), and GET /v1/schedules, /ui/schedules and POST /v1/backfills answered 500. Now the apply is refused
# 422, a stored one (an older version applied it) is one evaluation error that stops no other schedule, and it
# lists with no next tick.
# Finding 5: backfill days given as ``20260301`` or ``2026-W10-1`` were accepted, though the refusal says
# YYYY-MM-DD.
# (Findings 2 to 4, on cancellation: test_cancel.py.)

IMPOSSIBLE_CRON = "0 0 30 2 *"  # February 30: croniter finds no date


def daily(cron: str = "0 3 * * *") -> dict[str, Any]:
    return {"cron": cron, "timezone": "UTC", "parameters": {"day": "{{ tick.date }}"}}


def _count(platform: Platform, table: str) -> int:
    with platform.db.read() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar() or 0)


def test_a_cron_matching_no_date_is_refused_and_never_stops_other_tenants(served: Served, tmp_path: Path) -> None:
    """Proves finding 1: the apply and a backfill of a February-30 cron answer 422 with nothing written;
    one stored anyway (as an older version applied it) is an evaluation error of that schedule only,
    lists with no next tick, and a real worker still executes another tenant's queued run."""
    refused = served.call("POST", "/v1/schedules", served.tokens.operator, {"definition": flow(daily(IMPOSSIBLE_CRON))})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "invalid_input" and "matches no date" in refused.text
    assert _count(served.platform, "schedules") == 0
    body = {"definition": flow(daily(IMPOSSIBLE_CRON)), "from": "2026-03-01", "to": "2026-03-02"}
    backfill = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert backfill.status_code == 422 and "matches no date" in backfill.text, backfill.text
    assert _count(served.platform, "dataflow_runs") == 0

    # Stored anyway: the schedule row an older version (or `schedules apply` before this fix) wrote.
    applied = served.call("POST", "/v1/schedules", served.tokens.operator, {"definition": flow(daily())})
    assert applied.status_code == 201, applied.text
    with served.platform.db.begin() as conn:
        body = json.loads(conn.execute(sa.select(schedules_table.c.definition_json)).scalar_one())
        body["schedule"]["cron"] = IMPOSSIBLE_CRON
        # Due at its apply instant, as migration 0012 leaves a schedule an older version applied.
        due = schedules_table.c.applied_at_us
        conn.execute(sa.update(schedules_table).values(definition_json=json.dumps(body), next_due_us=due))
    listed = served.call("GET", "/v1/schedules", served.tokens.viewer)
    assert listed.status_code == 200, listed.text
    (item,) = listed.json()["schedules"]
    assert item["cron"] == IMPOSSIBLE_CRON and item["next_tick"] is None
    assert served.call("GET", "/v1/schedules/daily", served.tokens.viewer).status_code == 200
    page = TestClient(served.client.app, cookies={SESSION_COOKIE: served.tokens.viewer}).get("/ui/schedules")
    assert page.status_code == 200 and IMPOSSIBLE_CRON in page.text

    evaluation = schedules.evaluate(served.platform.db, served.platform.runs)
    assert [(e["tenant"], e["name"], e["code"]) for e in evaluation.errors] == [("acme", "daily", "invalid_input")]
    victim = served.platform.runs.submit(flows.request(flows.definition(), tmp_path, "victim", tenant="globex")).run
    Worker(served.platform.runs, WorkerOptions(until_idle=True, poll_interval_s=0.05)).run()
    assert served.platform.runs.get(victim.run_id).status == "succeeded"


@pytest.mark.parametrize("day", ["20260301", "2026-W10-1"])
def test_a_backfill_day_must_be_written_yyyy_mm_dd(served: Served, day: str) -> None:
    """Proves finding 5: ISO 8601's basic, week and ordinal forms are refused as the message says."""
    body = {"definition": flow(), "from": day, "to": "2026-03-02"}
    answer = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert answer.status_code == 422 and "from must be a date, YYYY-MM-DD" in answer.text, answer.text
    assert _count(served.platform, "dataflow_runs") == 0

