"""Red-team findings against cancellation and the schedules API (commit cf6f558), on SQLite and PostgreSQL.

1. A schedule whose cron matches no date (``0 0 30 2 *``: February 30) was applied through
   POST /v1/schedules (201); then every evaluation of every tenant's schedules raised
   CroniterBadDateError, so every worker on the platform died at its first schedule evaluation
   (another tenant's queued run was never executed), and GET /v1/schedules, /ui/schedules and
   POST /v1/backfills answered 500. Now the apply is refused 422, a stored one (an older version
   applied it) is one evaluation error that stops no other schedule, and it lists with no next tick.
2. ``cancel._cancel_queued`` trusted a projection that says ``queued``: over a live attempt (its row
   edited, or written by a bug) it left the attempt's lease open, answered "no attempt had started",
   and the attempt went on to authorize, publish and succeed after ``run.cancelled``. Now the queued
   path closes any open lease of the attempt first, as the running path does.
3. A projection edited to ``cancelled`` over a live attempt was answered "already cancelled" while
   the attempt went on; now it is refused unless the ledger's head is ``run.cancelled``.
4. One day whose evidence fails verification stopped POST /v1/backfills/cancel (409) with the later
   days still queued, to be run and published; now that day is reported ``evidence_failed`` and the
   other days are cancelled.
5. Backfill days given as ``20260301`` or ``2026-W10-1`` were accepted, though the refusal says YYYY-MM-DD.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from durable_dataflow.api.app import create_app
from durable_dataflow.api.auth import SESSION_COOKIE
from durable_dataflow.core import crashpoints
from durable_dataflow.core.errors import Conflict
from durable_dataflow.dataflow.protocol import cancel, evidence
from durable_dataflow.dataflow.protocol.requests import AccessContext, Provenance
from durable_dataflow.dataflow.schedules import schedules
from durable_dataflow.dataflow.schedules.schedule_schema import schedules as schedules_table
from durable_dataflow.dataflow.worker import Worker, WorkerOptions
from durable_dataflow.platform import Platform
from support import flows
from support.api_runs import Tokens, make_tokens

IMPOSSIBLE_CRON = "0 0 30 2 *"  # February 30: croniter finds no date
CANCELLER = AccessContext("acme", "night-operator", ("operator",), (), "test")
CANCEL_PROVENANCE = Provenance("night-operator", "api")
FORGE_STATUS = sa.text("UPDATE dataflow_runs SET status=:s WHERE run_id=:r")
EDIT_ENTRIES = sa.text(
    "UPDATE ledger_entries SET payload_json = replace(payload_json, 'daily', 'dai1y') WHERE subject_id=:r"
)


flow = flows.daily_flow


def daily(cron: str = "0 3 * * *") -> dict[str, Any]:
    return {"cron": cron, "timezone": "UTC", "parameters": {"day": "{{ tick.date }}"}}


@dataclass(frozen=True)
class Served:
    platform: Platform
    client: TestClient
    tokens: Tokens

    def call(self, method: str, path: str, token: str, body: Any = None) -> Any:
        return self.client.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    platform = Platform(db_url, lease_ttl_s=5)
    app = create_app(platform, data_root=tmp_path / "tenants", sink_root=tmp_path / "sinks")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Served(platform, client, make_tokens(platform))
    platform.close()
    crashpoints.set_hook(None)


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
        conn.execute(sa.update(schedules_table).values(definition_json=json.dumps(body)))
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


def test_a_queued_projection_over_a_live_attempt_is_fenced_off(served: Served, tmp_path: Path) -> None:
    """Proves finding 2: the row of a claimed forward run is edited back to ``queued`` just before its
    pre-dispatch commit; the cancel closes the attempt's lease, so that commit is refused, nothing is
    published, and the run stays cancelled with a chain that verifies."""
    platform = served.platform
    platform.runs.submit(flows.request(flows.definition(flows.parquet_target()), tmp_path, "forged-queued"))
    claim = platform.runs.claim_next()
    assert claim is not None
    done: list[cancel.Cancellation] = []

    def forge_then_cancel(point: str) -> None:
        if point == crashpoints.BEFORE_PREDISPATCH_COMMIT and not done:
            with platform.db.begin() as conn:
                conn.execute(FORGE_STATUS, {"s": "queued", "r": claim.run.run_id})
            done.append(cancel.cancel(platform.runs, claim.run.run_id, access=CANCELLER, provenance=CANCEL_PROVENANCE))

    crashpoints.set_hook(forge_then_cancel)
    platform.runs.execute(claim)
    crashpoints.set_hook(None)
    assert done and done[0].cancelled
    assert flows.manifests(tmp_path / "sink") == [], "the attempt published after its run was cancelled"
    kinds = flows.kinds(platform, claim.run.run_id)
    assert kinds[-1] == evidence.RUN_CANCELLED and evidence.DISPATCH_AUTHORIZED not in kinds, kinds
    assert platform.runs.get(claim.run.run_id).status == "cancelled"
    assert flows.verify(platform, claim.run.run_id).ok


def test_a_cancelled_projection_over_a_live_attempt_is_not_taken_for_cancelled(served: Served, tmp_path: Path) -> None:
    """Proves finding 3: a running run's row edited to ``cancelled`` is not answered "already cancelled":
    the ledger's head is not ``run.cancelled``, so the cancel is refused naming `dataflow verify`."""
    platform = served.platform
    platform.runs.submit(flows.request(flows.definition(), tmp_path, "forged-cancelled"))
    claim = platform.runs.claim_next()
    assert claim is not None
    with platform.db.begin() as conn:
        conn.execute(FORGE_STATUS, {"s": "cancelled", "r": claim.run.run_id})
    with pytest.raises(Conflict, match="dataflow verify"):
        cancel.cancel(platform.runs, claim.run.run_id, access=CANCELLER, provenance=CANCEL_PROVENANCE)
    assert evidence.RUN_CANCELLED not in flows.kinds(platform, claim.run.run_id)


def test_one_day_with_broken_evidence_does_not_stop_a_backfill_cancel(served: Served) -> None:
    """Proves finding 4: the first day's recorded entry is edited; cancelling the backfill reports that
    day ``evidence_failed`` (nothing written for it) and still cancels the two other days."""
    body = {"definition": flow(), "from": "2026-03-01", "to": "2026-03-03"}
    submitted = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert submitted.status_code == 201, submitted.text
    ids = [day["run_id"] for day in submitted.json()["runs"]]
    with served.platform.db.begin() as conn:
        conn.execute(EDIT_ENTRIES, {"r": ids[0]})
    answer = served.call("POST", "/v1/backfills/cancel", served.tokens.operator, body)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert [day["outcome"] for day in report["runs"]] == ["evidence_failed", "cancelled", "cancelled"]
    assert report["totals"]["evidence_failed"] == 1 and "failed verification" in report["runs"][0]["detail"]
    assert [str(served.platform.runs.get(run_id).status) for run_id in ids] == ["queued", "cancelled", "cancelled"]


@pytest.mark.parametrize("day", ["20260301", "2026-W10-1"])
def test_a_backfill_day_must_be_written_yyyy_mm_dd(served: Served, day: str) -> None:
    """Proves finding 5: ISO 8601's basic, week and ordinal forms are refused as the message says."""
    body = {"definition": flow(), "from": day, "to": "2026-03-02"}
    answer = served.call("POST", "/v1/backfills", served.tokens.operator, body)
    assert answer.status_code == 422 and "from must be a date, YYYY-MM-DD" in answer.text, answer.text
    assert _count(served.platform, "dataflow_runs") == 0
